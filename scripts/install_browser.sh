#!/usr/bin/env bash
# Headless Chromium for the support-matrix page test (tests/test_support_matrix_page.py):
# Debian's `chromium` package when /usr/bin/chromium is missing and apt-get can run, and
# Playwright's Python package in .venv to drive it. Never `playwright install`: its own
# browser download does not work here; the test passes the Debian executable instead.
#   bash scripts/install_browser.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    # Everything apt prints goes to a log; only a failure shows it.
    log=$(mktemp)
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; } >"$log" 2>&1; then
      tail -n 20 "$log" >&2
      echo "install_browser.sh: apt-get could not install chromium; the page test will be skipped" >&2
    fi
    rm -f "$log"
  else
    echo "install_browser.sh: no chromium and no usable apt-get (need root); the page test will be skipped" >&2
  fi
fi

if [ -x "$PYTHON" ] && ! "$PYTHON" -c "import playwright" >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q playwright
fi
