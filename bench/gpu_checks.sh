#!/usr/bin/env bash
# The GPU checks of a session in one device call (carry [".whl", ".whl_trl"]): the `gpu`-marked
# tests of the files given in TESTS (default: the newest first), then the support matrix's
# GPU cells of the features in FEATURES (the families in FAMILIES, default all) and
# MULTI_TURN_FAMILIES' multi_turn cells, into $OUT/gpu_cells; the probe workers' logs, with
# the whole traceback of each failing probe, into $OUT/gpu_cells/logs (a device call returns
# only what is under $OUT). Each part has its own time limit, so one slow part cannot
# take the others' time. Merge the cells here afterwards:
#   mmrl support-matrix --gpu-results <files_at>/gpu_cells/results.json --feature F ...
# The rollout_agreement cells of three families alone, no tests, no multi_turn cells:
#   TESTS=" " FEATURES=rollout_agreement FAMILIES="idefics3 smolvlm internvl" MULTI_TURN_FAMILIES=" " \
#     bash bench/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
py=${PYTHON:-python3}
source bench/device_wheels.sh
install_device_wheels "$py" pydantic || exit 2
read -r -a tests <<< "${TESTS:-tests/test_rollout_sharded.py tests/test_media_probes.py tests/test_rollout_zoo.py tests/test_gpu.py}"
for file in "${tests[@]}"; do
  name=$(basename "$file" .py)
  timeout "${TEST_LIMIT:-150}" "$py" -m pytest -q -m gpu -p no:cacheprovider --durations=5 "$file" \
    > "$out/$name.log" 2>&1
  echo "$file: rc $? $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$out/$name.log" | tail -1)"
done
cells=$out/gpu_cells
chosen=()
for f in ${FEATURES:-reads_media rollout_agreement}; do chosen+=(--feature "$f"); done
for f in ${FAMILIES:-}; do chosen+=(--family "$f"); done
timeout "${MATRIX_LIMIT:-200}" "$py" -m mmrl.cli support-matrix --device cuda "${chosen[@]}" --output "$cells" \
  --log-dir "$cells/logs" --no-progress > "$out/matrix.log" 2>&1
echo "matrix ${FEATURES:-reads_media rollout_agreement}: rc $? $(tail -1 "$out/matrix.log")"
families=()
for f in ${MULTI_TURN_FAMILIES:-idefics3 smolvlm llava_onevision}; do families+=(--family "$f"); done
if [[ ${#families[@]} -gt 0 ]]; then
  timeout "${MATRIX_LIMIT:-200}" "$py" -m mmrl.cli support-matrix --device cuda --feature multi_turn "${families[@]}" \
    --output "$cells" --log-dir "$cells/logs" --no-progress > "$out/matrix_multi_turn.log" 2>&1
  echo "matrix multi_turn: rc $? $(tail -1 "$out/matrix_multi_turn.log")"
fi
