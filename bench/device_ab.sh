#!/usr/bin/env bash
# The packed 0.5B update, main's mmrl against older (or other) commits', alternating in one
# device call (timings drift between calls; rounds in one call are what compare). Here:
#   rm -rf .gl/base && mkdir -p .gl/base && git archive <commit> mmrl | tar -x -C .gl/base
# then on the device (carry [".whl", ".gl"]):
#   bash bench/device_ab.sh [rounds] [extra bench/packing.py arguments]
# SIDES (default "base main") names the sides of a round: "main" is this tree, any other
# name X is $AB_TREES/X/mmrl (AB_TREES defaults to .gl), archived the same way. Each run's
# JSON goes to $OUT/ab/ (its log to $AB_LOGS, default /tmp/ab_logs); a line per run and the
# medians are printed, each side against the first. PYTHON picks the interpreter (default
# python3, the device image's). `mmrl.models` (the zoo, outside the package) is main's on
# every side unless a side's tree has its own (`git archive <commit> models | tar -x -C
# .gl/X/mmrl`).
set -uo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-3}
shift || true
out=${OUT:-/tmp}/ab
logs=${AB_LOGS:-/tmp/ab_logs}
py=${PYTHON:-python3}
trees=${AB_TREES:-.gl}
mkdir -p "$out" "$logs"
read -r -a sides <<< "${SIDES:-base main}"
for side in "${sides[@]}"; do
  if [[ $side != main && ! -d $trees/$side/mmrl ]]; then
    echo "device_ab.sh: no $trees/$side/mmrl (see the comment at the top)"; exit 2
  fi
done
if ! "$py" -c "import pydantic" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e .
fi
for i in $(seq "$pairs"); do
  for side in "${sides[@]}"; do
    path=""; [[ $side != main ]] && path=$trees/$side
    PYTHONPATH=$path timeout 200 "$py" bench/packing.py --dtype bfloat16 --micro-batch-tokens 32768 \
      --modes compiled_32768 "$@" --out "$out/${side}_$i.json" > "$logs/${side}_$i.log" 2>&1
    echo "$side $i: $(grep -A1 'median s' "$logs/${side}_$i.log" | tail -1)"
  done
done
"$py" - "$out" "${sides[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, sides = Path(sys.argv[1]), sys.argv[2:]
steps = {side: [] for side in sides}
for side in sides:
    for path in sorted(out.glob(f"{side}_*.json")):
        report = json.loads(path.read_text())
        steps[side].append(next(iter(report["median_step_s"].values())))  # the one mode run
medians = {side: statistics.median(values) for side, values in steps.items() if values}
print("median step:", {side: round(value, 4) for side, value in medians.items()})
first = sides[0]
for side in sides[1:]:
    if first in medians and side in medians:
        print(f"{side} vs {first}: {medians[first] / medians[side]:.3f}x")
EOF
