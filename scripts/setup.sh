#!/usr/bin/env bash
# Creates .venv (once) and installs lightning_osdp with its test and CLI extras.
# torch is pinned to the CPU build through constraints.txt: an unpinned torch would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
