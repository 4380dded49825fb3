#!/usr/bin/env bash
# The packed 0.5B update, main's mmrl against older (or other) commits', alternating in one
# device call (timings drift between calls; rounds in one call are what compare). Here:
#   rm -rf .gl/base && mkdir -p .gl/base && git archive <commit> mmrl | tar -x -C .gl/base
# then on the device (carry [".whl", ".gl"]):
#   bash bench/device_ab.sh [rounds] [extra bench/packing.py arguments]
# SIDES (default "base main") names the sides of a round: "main" is this tree, any other
# name X is $AB_TREES/X/mmrl (AB_TREES defaults to .gl), archived the same way. Each run's
# JSON and log go to $AB_LOGS (default /tmp/ab_logs); a line per run and the medians are
# printed, each side against the first, and $OUT/ab/summary.json holds every run's figures
# (one file: the device returns at most 8). PYTHON picks the interpreter (default
# python3, the device image's). `mmrl.models` (the zoo, outside the package) is main's on
# every side unless a side's tree has its own (`git archive <commit> models | tar -x -C
# .gl/X/mmrl`).
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
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
source bench/device_wheels.sh
install_device_wheels "$py" pydantic || exit 2
for i in $(seq "$rounds"); do
  for side in "${sides[@]}"; do
    path=""; [[ $side != main ]] && path=$trees/$side
    rm -f "$logs/${side}_$i.json"  # a failed run must not leave an earlier call's figures in the summary
    PYTHONPATH=$path timeout 200 "$py" bench/packing.py --dtype bfloat16 --micro-batch-tokens 32768 \
      --modes compiled_32768 "$@" --out "$logs/${side}_$i.json" > "$logs/${side}_$i.log" 2>&1
    echo "$side $i: $(grep -A1 'median s' "$logs/${side}_$i.log" | tail -1)"
  done
done
"$py" - "$out" "$logs" "$rounds" "${sides[@]}" -- "$@" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, logs, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
cut = sys.argv.index("--")
sides, extra = sys.argv[4:cut], sys.argv[cut + 1:]
runs, first_report = {side: [] for side in sides}, None
for i in range(1, rounds + 1):
    for side in sides:
        path = logs / f"{side}_{i}.json"
        if not path.is_file():
            continue  # that run failed or timed out: its log says why
        report = json.loads(path.read_text())
        first_report = first_report or report
        mode = next(iter(report["median_step_s"]))  # the first mode run (compiled_32768 unless --modes)
        runs[side].append({"round": i, "mode": mode, "median_step_s": report["median_step_s"][mode],
                           **{key: report.get(key, {}).get(mode)  # peak_gib: GPU runs only
                              for key in ("real_tokens_per_s", "peak_gib", "samples_s")},
                           "attention_calls": report.get("attention_calls")})
medians = {side: statistics.median(r["median_step_s"] for r in done) for side, done in runs.items() if done}
print("median step:", {side: round(value, 4) for side, value in medians.items()})
first = sides[0]
speedups = {side: medians[first] / medians[side] for side in medians if first in medians}
for side in sides[1:]:
    if side in speedups:
        print(f"{side} vs {first}: {speedups[side]:.3f}x")
first_report = first_report or {}
summary = {"bench": "bench/device_ab.sh (bench/packing.py, the sides alternating in one call)",
           "device": first_report.get("device"), "versions": first_report.get("versions"),
           "sides": sides, "rounds": rounds, "packing_arguments": extra, "runs": runs,
           "median_step_s": medians, "speedup_vs_first": speedups}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"wrote {out / 'summary.json'}")
EOF
