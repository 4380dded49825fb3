#!/usr/bin/env bash
# Set up mmrl in ./.venv on a CPU machine: torch 2.14.1 + torchvision 0.29.1 (the pair
# whose torchvision imports on CPU; the Qwen-VL image and video processors need it), then
# mmrl with its test extras and the extra pieces of scripts/install_extras.sh.
#   bash scripts/setup.sh && .venv/bin/mmrl train recipes/tiny_vlm_count.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install -q -e ".[test]"
bash scripts/install_extras.sh
.venv/bin/python -c "import mmrl, torch, transformers; print(f'mmrl {mmrl.__version__} ready: torch {torch.__version__}, transformers {transformers.__version__}')"
