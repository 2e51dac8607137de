#!/usr/bin/env bash
# The multi-LoRA kernels on a CUDA machine: the kernel test suite (its gpu-marked cases run there;
# the interpreter-only cases skip) and then bench/kernels.py. Logs and results go to $OUT (default out/).
# Uses the machine's python3 (no virtualenv needed: torch, triton, peft, hypothesis, pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
python3 -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))'
PYTHONUNBUFFERED=1 python3 -m pytest tests/kernels -q -p no:cacheprovider -o addopts="-ra --strict-markers" 2>&1 | tee "$out/kernels_tests.log"
if [[ "${1:-}" != "--tests-only" ]]; then
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/kernels.py --out "$out" "$@" 2>&1 | tee "$out/kernels_bench.log"
fi
