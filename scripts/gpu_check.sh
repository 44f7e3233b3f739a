#!/usr/bin/env bash
# make gpu-check: the GPU state of yirage in one command (scripts/gpu_check.py says what it runs).
# Uses .venv where there is one (CI, a developer machine), else the python on PATH: a GPU machine image with torch
# (CUDA), Triton, numba, transformers and pytest preinstalled. Installs the project there in editable mode, without
# dependencies, without the network; downloads no model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if ! "$PY" -c "import yirage, yirage_backend_cuda, yirage_backend_triton, yirage_backend_cpu" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . -e backends/cpu -e backends/cuda \
        -e backends/triton -e backends/domestic -e backends/mps
fi
exec "$PY" scripts/gpu_check.py "$@"
