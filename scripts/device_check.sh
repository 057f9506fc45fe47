#!/usr/bin/env bash
# One device-machine call on a fresh GPU machine: install what the tests need from the wheels in
# the git-ignored .whl/ folder (DeepGEMM + tvm-ffi, fastapi/uvicorn/pydantic/openai), run one part
# of a registered GPU suite (scripts/run_suite.py: time-balanced parts, a per-file summary, the
# measured times written to $OUT/gpu_times.json to commit as test/registered/gpu_times.json),
# then the benchmarks.
# Usage (from the repo root, .whl/ carried): bash scripts/device_check.sh [pytest -k expr]
# Env: SUITE (default h200-1gpu), PART (i/n, default 1/1; `python scripts/run_suite.py --suite
# h200-1gpu --list --parts N` shows the parts), FILES (instead of a part: the suite's files whose
# path contains one of these space-separated words), TESTS (instead of the suite: these pytest paths,
# their GPU tests), BENCHES (default none; several as "a.py --flag x; b.py", each run with its
# arguments, its log named after the script), BENCH_TIMEOUT (seconds each benchmark may take,
# default 600), PYTEST_TIMEOUT (seconds the tests may take, default 3000; the benchmarks still
# run after it).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/sglang_site
if ls .whl/*.whl >/dev/null 2>&1; then
  # one version of each package; the wrong-torch DeepGEMM wheel goes to its own folder for the
  # test that checks it is refused
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 1; }
  if ls .whl/wrong/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/sglang_wrong_site .whl/apache_tvm_ffi-*.whl .whl/wrong/*.whl \
      && export SGLANG_TEST_WRONG_DEEP_GEMM_SITE=/tmp/sglang_wrong_site
  fi
fi
export PYTHONPATH="$PWD/python:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/tmp/deep_gemm_cache}"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name())'
python3 -m sglang.check_env 2>&1 | sed -n 1,12p
# --continue-on-collection-errors: a file whose optional package is missing here must not stop
# the run (those files skip themselves with importorskip; this is the safety net).
if [ -n "${TESTS:-}" ]; then
  timeout "${PYTEST_TIMEOUT:-3000}" python3 -m pytest $TESTS -m "gpu or multi_gpu" -v -rs -p no:cacheprovider \
    --continue-on-collection-errors ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest_gpu.log"
else
  # times are measured for whole files only: not with a -k selection
  if [ -n "${1:-}" ]; then select_args=(-k "$1"); else select_args=(--write-times "$OUT/gpu_times.json"); fi
  if [ -n "${FILES:-}" ]; then part_args=(--files $FILES); else part_args=(--part "${PART:-1/1}"); fi
  timeout "${PYTEST_TIMEOUT:-3000}" python3 scripts/run_suite.py --suite "${SUITE:-h200-1gpu}" \
    "${part_args[@]}" "${select_args[@]}" 2>&1 | tee "$OUT/suite.log"
fi
status=${PIPESTATUS[0]}
export PYTHONPATH="$PYTHONPATH:$PWD/scripts"  # the profiles import each other's helpers
IFS=';' read -ra bench_cmds <<< "${BENCHES-}"
for cmd in "${bench_cmds[@]}"; do
  read -ra argv <<< "$cmd"
  [ ${#argv[@]} -eq 0 ] && continue
  echo "== ${argv[*]}"
  timeout "${BENCH_TIMEOUT:-600}" python3 "${argv[@]}" 2>&1 | tee -a "$OUT/$(basename "${argv[0]}" .py).log"
done
exit "$status"
