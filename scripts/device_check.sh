#!/usr/bin/env bash
# One device-machine call: install the package in place, run the GPU tests, then the benchmarks.
# Usage (on the GPU machine, from the repo root): bash scripts/device_check.sh [pytest -k expr]
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name())'
python3 -m pytest test/registered -m "gpu or multi_gpu" -v -rs -p no:cacheprovider ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest_gpu.log"
status=${PIPESTATUS[0]}
for bench in ${BENCHES:-scripts/bench_grid_barrier.py}; do
  python3 "$bench" 2>&1 | tee "$OUT/$(basename "$bench" .py).log"
done
exit "$status"
