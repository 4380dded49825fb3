#!/usr/bin/env bash
# Set up mmrl in ./.venv on a CPU machine: torch 2.14.1 + torchvision 0.29.1 (the pair that
# works together here, see docs/environment.md), then mmrl with its test extras.
#   bash scripts/setup.sh            # then: .venv/bin/mmrl models
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
