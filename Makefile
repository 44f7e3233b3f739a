# The two commands of the README: `make demo` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
SETUP_INPUTS := scripts/setup.sh pyproject.toml $(wildcard backends/*/pyproject.toml)

.PHONY: setup demo test lint triton-interpret gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: $(SETUP_INPUTS)
	bash scripts/setup.sh

demo: setup
	$(PY) tools/yirage_backend_manager.py info
	$(PY) demo/generate.py --backend auto

lint: setup
	$(PY) -m ruff check yirage backends tools tests examples benchmark demo

# The conformance kit is independent case by case and bound by compiling (numba, PoCL): two workers on the
# two cores (pytest-xdist), case by case. The other files run on two workers too, a file at a time (their
# module fixtures compile a model once), except the files whose tests time a deadline against a loaded
# machine (Ctrl-C latency, collective timeouts of a few seconds, CPU hogs): those run alone, after.
SERIAL_TESTS := $(wildcard tests/test_pk_safety.py tests/test_cpu_backoff.py tests/test_distributed.py \
	tests/test_tp_decode.py)
test: lint
	$(PY) -m pytest -n 2 tests/test_conformance.py
	$(PY) -m pytest -n 2 --dist loadfile --ignore=tests/test_conformance.py $(addprefix --ignore=,$(SERIAL_TESTS))
	$(PY) -m pytest $(SERIAL_TESTS)
	$(MAKE) triton-interpret
	$(MAKE) gpu-check

# The conformance kit on the triton backend in Triton's interpreter (numpy on CPU tensors; TRITON_INTERPRET=1
# must be set before triton is imported), into a fresh compile cache; then the Triton tests that need the
# interpreter, and every plan of that cache compiled ahead of time for sm_90 and gfx942 (no GPU needed), on two
# workers a file at a time (5 min 26 s alone on an Intel Cascade Lake pair of cores, 2 min 46 s on two).
TRITON_KIT_CACHE := build/triton-kit-cache
triton-interpret: setup
	rm -rf $(TRITON_KIT_CACHE)
	TRITON_INTERPRET=1 YIRAGE_CACHE_DIR=$(abspath $(TRITON_KIT_CACHE)) $(PY) -m pytest -q -n 2 --yirage-backend triton \
		tests/test_conformance.py tests/test_kit_oracle.py tests/test_kit_random_graphs.py
	TRITON_INTERPRET=1 YIRAGE_TRITON_AOT_CACHE=$(abspath $(TRITON_KIT_CACHE)) $(PY) -m pytest -q -rs -n 2 \
		--dist loadfile tests/test_triton_render.py tests/test_triton_aot.py tests/test_launched_runtime.py

# The whole GPU state in one command, for a person with one NVIDIA GPU (budget: 8 minutes on one H100; not
# measured yet): the kit on cuda and triton, the GPU-only and LLM tests, decode beside HF eager, kernel graphs beside
# torch; a summary table, JSON and logs in build/gpu-check (YIRAGE_GPU_CHECK_DIR). Without a GPU: the compile-only
# part (every kit plan and PersistentKernel source through NVRTC + ptxas for sm_80/sm_90), as CI runs it. Exit 1 on a
# wrong result or a failed part, never on speed.
gpu-check:
	bash scripts/gpu_check.sh

