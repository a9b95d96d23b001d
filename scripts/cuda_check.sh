#!/usr/bin/env bash
# The old name of the CUDA checks: they are scripts/gpu_check.sh now (docs/gpu.md). OUTDIR defaults to /tmp/gpu_check.
exec bash "$(dirname "$0")/gpu_check.sh" "${1:-${TMPDIR:-/tmp}/gpu_check}"
