#!/usr/bin/env bash
# The GPU checks (the CUDA tests of tests/gpu/, docs/gpu.md) as one command for a bare, offline GPU machine.
#
#   bash scripts/gpu_check.sh --prepare-wheels   here, with a package index: downloads scripts/gpu_wheels.txt into
#                                                .wheels/ (git-ignored; pure-Python wheels)
#   bash scripts/gpu_check.sh OUTDIR             there: prints the versions, installs what is missing from .wheels/
#                                                and then the project (no index, no network), runs each test file of
#                                                CHECKS below as its own pytest (-m cuda), and writes
#                                                OUTDIR/gpu_check.log and OUTDIR/gpu_check.json. Exit 0: every file
#                                                passed; 1: some did not; 3: no CUDA device (every CUDA test skipped).
#
# With this workplace's device tool, after --prepare-wheels in the checkout the session was started in:
#   run   command: bash scripts/gpu_check.sh "$OUT"    carry: [".wheels"]    timeout_s: 480
# The files share GPU_CHECK_BUDGET seconds (default 360), each bounded by its own limit too; a file that fails or
# overruns is recorded (its finished tests' figures kept) while the next one runs.
#
# Environment: GPU_CHECK_ONLY=parity,gpt124 (a subset of CHECKS), GPU_CHECK_BUDGET=SECONDS, GPU_CHECK_INSTALL=0 (use
# the Python environment as it is), PYTHON (python3). On a machine without a GPU every step runs and every CUDA test
# skips (exit 3): how the pipeline is proved on a CPU (docs/gpu.md).
set -uo pipefail # not -e: a step that fails is reported, and the checks still run
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=.wheels
# Each check: tests/gpu/test_gpu_NAME.py, run in a process of its own (a fresh CUDA context and allocator, and
# cuBLAS and torch's deterministic flags as the file sets them), and its limit in seconds.
# test_gpu_meta_init: the meta-device model check joins here, after gpt124, when that feature lands.
CHECKS="parity:150 gpt124:220 hardware:90 checkpoint:100 gloo2:150"

if [ "${1:-}" = "--prepare-wheels" ]; then
  set -e
  rm -rf "$WHEELS"
  mkdir -p "$WHEELS"
  # Python 3.12 on x86-64 Linux, as the GPU machine has; --no-deps: the list names every package that is missing.
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$WHEELS" -r scripts/gpu_wheels.txt
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
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
JSON="$OUT/gpu_check.json"
: >"$LOG"
rm -f "$JSON"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
START=$(date +%s)
BUDGET="${GPU_CHECK_BUDGET:-360}"

names=()
for check in $CHECKS; do names+=("${check%%:*}"); done
if [ -n "${GPU_CHECK_ONLY:-}" ]; then
  for name in ${GPU_CHECK_ONLY//,/ }; do
    case " ${names[*]} " in
      *" $name "*) ;;
      *) echo "gpu_check.sh: unknown check '$name' in GPU_CHECK_ONLY; known: ${names[*]}" && exit 2 ;;
    esac
  done
fi

echo "gpu_check.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "--- versions (before installing)"
"$PYTHON" scripts/gpu_check.py versions "$JSON"

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
echo "--- versions (as the tests run)"
"$PYTHON" scripts/gpu_check.py versions "$JSON"

# scripts/ for the plugin that writes the JSON (gpu_check.py); the checkout, should the install have failed.
export PYTHONPATH="$PWD/scripts:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OSDP_GPU_CHECK_JSON="$JSON"
# Only the plugins named here: the machine's own (coverage, benchmark, xdist...) stay out of the timings.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
ran=()
for check in $CHECKS; do
  name="${check%%:*}" limit="${check##*:}"
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ ",$GPU_CHECK_ONLY," != *",$name,"* ]]; then continue; fi
  file="tests/gpu/test_gpu_$name.py"
  left=$((BUDGET - ($(date +%s) - START)))
  [ "$left" -lt "$limit" ] && limit="$left"
  if [ "$limit" -lt 15 ]; then
    echo "===== $name: not started, out of the time budget ($BUDGET s)"
    ran+=("$file=skipped:0")
    continue
  fi
  echo "===== $name: $file, up to $limit s"
  began=$(date +%s)
  # timeout signals the whole process group (torchrun agents pass SIGTERM on to their workers), then kills it.
  timeout -k 20 "$limit" "$PYTHON" -m pytest -p gpu_check -p no:cacheprovider -m cuda -v -s -ra "$file"
  status=$?
  ran+=("$file=$status:$(($(date +%s) - began))")
  echo "===== $name: pytest exit status $status after $(($(date +%s) - began)) s"
done

echo "===== summary"
"$PYTHON" scripts/gpu_check.py summary "$JSON" "${ran[@]}"
status=$?
echo "gpu_check.sh: exit status $status after $(($(date +%s) - START)) s; log $LOG, figures $JSON"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null || true
exit "$status"
