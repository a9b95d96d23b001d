#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the demo: a real 2-process CPU training run with strategy="osdp".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
