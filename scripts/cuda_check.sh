#!/usr/bin/env bash
# The CUDA checks, as one prepared script for a GPU machine (under 5 minutes): the cuda-marked tests and the
# parity suite on the GPU build of torch that machine has.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e ".[test]"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
python -m pytest -q -ra -m cuda tests/test_cuda.py
