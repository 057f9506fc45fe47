#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels scripts/device_check.sh installs on a fresh
# GPU machine (CPython 3.12, x86_64) into the git-ignored .whl/ folder; carry .whl to the device.
# DeepGEMM 0.1.5.post1 + tvm-ffi 0.1.11 fit the GPU machines' torch 2.11; .whl/wrong/ holds a wheel
# built for torch 2.13, which the adapter test expects to be refused. transformers 5.23 is the
# reference the parity tests compare with (the GPU image has an older one). xgrammar 0.2.9
# (structured output) requires apache-tvm-ffi >= 0.1.11, so it shares DeepGEMM's 0.1.11; its other
# requirements (pydantic, transformers, torch, triton, numpy, typing-extensions) are carried here
# or already on the GPU image.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || grep -qx "/.whl/" .gitignore || echo "/.whl/" >> .git/info/exclude
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$@"; }
mkdir -p .whl/wrong
get .whl sgl-deep-gemm==0.1.5.post1 apache-tvm-ffi==0.1.11 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic_core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2 openai==3.57.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 \
  opentelemetry-api==1.45.2 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  transformers==5.23.0 xgrammar==0.2.9
get .whl/wrong sgl-deep-gemm==0.1.5.post2
ls -la .whl .whl/wrong
