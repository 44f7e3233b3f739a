"""The workloads of multi_backend_benchmark.py (defined in bench_workloads.py) as pytest-benchmark
microbenchmarks: each yirage backend that compiles kernel graphs here, torch eager and torch.compile, one test per
(workload, impl), grouped by workload. Not collected by `make test` (testpaths is tests/):

    .venv/bin/python -m pytest benchmark/ --benchmark-only [--workload-shape 1,64,256] [--benchmark-json out.json]

Each impl is checked against torch (float32) before it is timed, so a wrong kernel fails instead of timing.
"""

from __future__ import annotations

import pytest
import torch
from bench_workloads import WORKLOADS, Shape, case_inputs, makers_for
from timing import COMPILED, EAGER, compiling_backends

BACKENDS = compiling_backends()
IMPLS = [f"yirage[{b}]" for b in BACKENDS] + [EAGER, COMPILED]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_workload(benchmark, workload: str, impl: str, workload_shape: Shape) -> None:
    inputs, ref = case_inputs(WORKLOADS[workload], workload_shape, "float32")
    make = makers_for(WORKLOADS[workload], workload_shape, "float32", BACKENDS, inputs, with_compile=True)[impl]
    call, compile_s = make()
    torch.testing.assert_close(call(0), ref, rtol=1e-3, atol=1e-3 * max(1.0, float(ref.abs().max())))
    benchmark.group = f"{workload} {workload_shape.label}"
    benchmark.extra_info.update(shape=workload_shape.label, compile_s=compile_s)
    benchmark(call, 0)
