#!/usr/bin/env bash
# The packed 0.5B update, main's mmrl against an older commit's, alternating in one device
# call (timings drift between calls; pairs in one call are what compare). Here:
#   rm -rf .gl/base && mkdir -p .gl/base && git archive <commit> mmrl | tar -x -C .gl/base
# then on the device (carry [".whl", ".gl"]):
#   bash bench/device_ab.sh [pairs] [extra bench/packing.py arguments]
# Each run's JSON goes to $OUT/ab/ (its log to /tmp/ab_logs/); a line per run and the medians
# are printed. PYTHON picks the interpreter (default python3, the device image's).
# `mmrl.models` (the zoo, outside the package) is main's in both runs.
set -uo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-3}
shift || true
out=${OUT:-/tmp}/ab
logs=/tmp/ab_logs
py=${PYTHON:-python3}
mkdir -p "$out" "$logs"
if [[ ! -d .gl/base/mmrl ]]; then echo "device_ab.sh: no .gl/base/mmrl (see the comment at the top)"; exit 2; fi
if ! "$py" -c "import pydantic" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e .
fi
for i in $(seq "$pairs"); do
  for side in base main; do
    path=""; [[ $side == base ]] && path=.gl/base
    PYTHONPATH=$path timeout 200 "$py" bench/packing.py --dtype bfloat16 --micro-batch-tokens 32768 \
      --modes compiled_32768 "$@" --out "$out/${side}_$i.json" > "$logs/${side}_$i.log" 2>&1
    echo "$side $i: $(grep -A1 'median s' "$logs/${side}_$i.log" | tail -1)"
  done
done
"$py" - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
steps = {}
for path in sorted(Path(sys.argv[1]).glob("*_*.json")):
    side = path.stem.split("_")[0]
    report = json.loads(path.read_text())
    steps.setdefault(side, []).append(next(iter(report["median_step_s"].values())))  # the one mode run
medians = {side: statistics.median(values) for side, values in steps.items()}
print("median step:", {side: round(value, 4) for side, value in medians.items()},
      "main vs base: %.3fx" % (medians["base"] / medians["main"]) if len(medians) == 2 else "")
EOF
