#!/usr/bin/env bash
# Headless Chromium for the support-matrix page test (filled in with the page test).
set -euo pipefail
