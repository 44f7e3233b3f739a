#!/usr/bin/env bash
# Set up .venv from scratch: torch (CPU build), the core, every built-in
# backend distribution in editable mode, PoCL for OpenCL, and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"yirage needs Python >= 3.10, but {sys.executable} is {sys.version.split()[0]}; set PYTHON=python3.11")
PY

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip setuptools wheel
# pin the CPU build: a bare `torch` would pull a multi-GB CUDA build
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" --no-build-isolation \
    -e ".[test,llm]" \
    -e "backends/cpu[tbb]" \
    -e "backends/opencl[pocl]" \
    -e "backends/cuda[nvrtc]" \
    -e backends/mps \
    -e backends/domestic \
    -e "backends/triton[triton]" \
    "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*"
# NVRTC 13.0 exactly (above): newer NVRTCs emit PTX that the ptxas 13.0 here, which re-checks it, rejects
# the real model of the demo and the tests (SmolLM2-135M-Instruct, Q4_1 GGUF), fetched once into the cache
.venv/bin/python -m yirage.models.downloads
# numba compiles the cpu decode kernels once, here, instead of in the user's first generate (about 50 s on 2 cores)
.venv/bin/python scripts/prewarm.py || echo "warning: pre-compiling the cpu decode kernels failed (above); the first generate will compile them"
touch .venv/.installed
echo "yirage is set up in .venv"
