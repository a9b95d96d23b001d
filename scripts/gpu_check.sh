#!/usr/bin/env bash
# The GPU checks (issue 16) as one prepared script for a bare, offline GPU machine; docs/gpu.md says what they check.
#
#   bash scripts/gpu_check.sh --prepare-wheels   here, with a package index: downloads scripts/gpu_wheels.txt into
#                                                .wheels/ (git-ignored, about 17 MiB; pure-Python wheels)
#   bash scripts/gpu_check.sh OUTDIR             there: prints the versions, installs what is missing from .wheels/
#                                                and then the project (no index, no network), runs
#                                                scripts/gpu_check.py and writes OUTDIR/gpu_check.log and
#                                                OUTDIR/gpu_check.json. Exit 0: every check passed; 1: some did not;
#                                                3: no CUDA device (nothing checked).
#
# With this workplace's device tool, after --prepare-wheels in the checkout the session was started in:
#   run   command: bash scripts/gpu_check.sh "$OUT"    carry: [".wheels"]    timeout_s: 540
# It finishes in under 8 minutes: the checks share GPU_CHECK_BUDGET seconds (default 420), each bounded by its own
# timeout too, and a check that fails, errs or overruns is recorded while the next one runs.
#
# Environment: GPU_CHECK_ONLY=parity,gpt124 (a subset: env parity gpt124 hardware checkpoint gloo2),
# GPU_CHECK_BUDGET=SECONDS, GPU_CHECK_DEVICE=cpu (a dry run of the checks on the CPU at small sizes: it proves the
# script runs, nothing about a GPU), GPU_CHECK_INSTALL=0 (use the Python environment as it is), PYTHON (python3).
set -uo pipefail # not -e: a step that fails is reported, and the checks still run
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=.wheels

if [ "${1:-}" = "--prepare-wheels" ]; then
  set -e
  rm -rf "$WHEELS"
  mkdir -p "$WHEELS"
  # Python 3.12 on x86-64 Linux, as the GPU machine has; --no-deps: the list names every package that is missing.
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$WHEELS" -r scripts/gpu_wheels.txt
  for wheel in "$WHEELS"/*.whl; do
    case "$wheel" in
      *-py3-none-any.whl | *-py2.py3-none-any.whl) ;;
      *) echo "note: $wheel is not pure Python: it installs on CPython 3.12 x86-64 only" ;;
    esac
  done
  du -ch "$WHEELS"/*.whl
  exit 0
fi

OUT="${1:?usage: bash scripts/gpu_check.sh OUTDIR   (or --prepare-wheels)}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
START=$(date +%s)

echo "gpu_check.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
"$PYTHON" - <<'EOF'
import platform
import sys

import torch

print(f"python {platform.python_version()} ({sys.executable})")
cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuDNN {cudnn}")
print(f"CUDA available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"

install="skipped (GPU_CHECK_INSTALL=0)"
if [ "${GPU_CHECK_INSTALL:-1}" != 0 ]; then
  echo "--- installing from $WHEELS (no package index)"
  # pip sees only .wheels/: no configured index, find-links or constraints of whatever machine this is.
  export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT
  # Resolved against what is installed: a missing dependency of these is named, not silently skipped.
  if "$PYTHON" -m pip install --no-index --find-links "$WHEELS" -r scripts/gpu_wheels.txt; then
    deps="dependencies from $WHEELS ok"
  else
    deps="dependencies from $WHEELS FAILED"
  fi
  # The project itself, no dependencies and no build isolation (an isolated build would fetch setuptools).
  if "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation -e .; then
    project="project installed editable"
  elif "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation .; then
    project="project installed (not editable)"
  else
    project="project NOT installed: imported from PYTHONPATH"
  fi
  install="$deps; $project"
  echo "--- $install"
fi
export OSDP_GPU_CHECK_INSTALL="$install"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

args=(--out "$OUT" --device "${GPU_CHECK_DEVICE:-cuda}" --budget "${GPU_CHECK_BUDGET:-420}")
if [ -n "${GPU_CHECK_ONLY:-}" ]; then
  args+=(--only "$GPU_CHECK_ONLY")
fi
"$PYTHON" scripts/gpu_check.py "${args[@]}"
status=$?
echo "gpu_check.sh: exit status $status after $(($(date +%s) - START)) s; log $LOG, figures $OUT/gpu_check.json"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null || true
exit "$status"
