#!/usr/bin/env bash
# Optional pieces the full test suite needs beyond `pip install -e .[test]`; called by
# scripts/setup.sh. Each block says what it installs and why.
set -euo pipefail
cd "$(dirname "$0")/.."

# A headless browser for the support-matrix page test.
bash scripts/install_browser.sh
