"""HIP compile-only checks: every conformance plan's HIP source compiles with hipcc for one gfx target.

Runs where a HIP toolchain is installed (hipcc on PATH or $HIPCC); elsewhere
the compiling tests skip with the reason. No GPU is needed. The oracles are
the compiler itself (an error or warning fails), the clang offload-bundle
format of its output, and, for the batching, the sources' own kernel lists.
"""

from __future__ import annotations

import re

import pytest
from yirage_backend_domestic.hip_build import (
    BF16_HEADER,
    DEFAULT_ARCH,
    HipCompileError,
    HipToolchainError,
    batch_source,
    check_arch,
    check_conformance,
    check_sources,
    compile_hip,
    conformance_plans,
    toolchain,
)

from yirage.codegen.cstyle import render_plan
from yirage.codegen.dialects import dialect
from yirage.compiler.lower import build_plan
from yirage.testing.random_graphs import seeded_graph

try:
    TOOLS = toolchain()
    WHY = ""
except HipToolchainError as exc:
    TOOLS, WHY = None, str(exc)
needs_hip = pytest.mark.skipif(TOOLS is None, reason=f"no HIP toolchain here: {WHY}")

SMALL = """#include <hip/hip_runtime.h>
extern "C" __global__ void scale(float* __restrict__ out, const float* __restrict__ x) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = x[i] * 2.0f;
}
"""


def test_archs_are_checked_before_anything_runs() -> None:
    assert check_arch("gfx90a") == "gfx90a"
    for bad in ("sm_80", "gfx", "GFX906", "gfx906 -O0"):
        with pytest.raises(ValueError, match="gfx906"):
            check_arch(bad)


def test_a_batch_keeps_every_kernel_once_under_a_name_of_its_own() -> None:
    hip = dialect("hip")
    sources = {f"seed{s}": render_plan(build_plan(seeded_graph(s)), hip) for s in range(6)}
    kernel = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(')
    batch = batch_source(sources)
    want = [f"b{i}_{k}" for i, s in enumerate(sources.values()) for k in kernel.findall(s)]
    assert kernel.findall(batch) == want and len(set(want)) == len(want)
    assert batch.count("#include <hip/hip_runtime.h>") == 1


@needs_hip
def test_output_is_an_offload_bundle_for_the_arch() -> None:
    code = compile_hip(SMALL, "gfx90a")
    assert code.startswith(b"__CLANG_OFFLOAD_BUNDLE__")  # clang-offload-bundler's magic
    assert b"hipv4-amdgcn-amd-amdhsa--gfx90a" in code


@needs_hip
def test_an_error_names_the_source_and_line() -> None:
    with pytest.raises(HipCompileError, match=r"bad\.hip:4:\d+: error"):
        compile_hip(SMALL.replace("2.0f;", "2.0f"), name="bad.hip")


@needs_hip
def test_a_warning_fails_and_a_failing_batch_names_its_source() -> None:
    warns = SMALL.replace("out[i] =", "int unused = 0; out[i] =")
    report = check_sources({"good": SMALL, "warns": warns, "good_too": SMALL.replace("2.0f", "3.0f")})
    assert report.compiled == 2 and [name for name, _ in report.failures] == ["warns"]
    assert "unused" in report.failures[0][1] and not report.ok


@needs_hip
def test_every_conformance_plan_compiles_for_one_gfx_target() -> None:
    plans = conformance_plans()
    report = check_conformance(DEFAULT_ARCH)
    print(report.summary())
    assert report.ok, report.summary()
    assert report.compiled + len(report.not_compiled) == len(plans)
    hip = dialect("hip")
    bf16 = {name for name, plan in plans.items() if "bfloat16" in str(plan) and BF16_HEADER in render_plan(plan, hip)}
    assert {name for name, _ in report.not_compiled} == (set() if TOOLS.has_bf16 else bf16)
    assert report.compiled >= 200


@needs_hip
def test_a_batch_that_fails_where_its_sources_compile_alone_is_reported() -> None:
    leaks = SMALL + "#define x 3\n"  # compiles alone; in a batch, the macro breaks the next source's parameter x
    report = check_sources({"leaks": leaks, "victim": SMALL})
    assert report.compiled == 2 and not report.ok
    assert [name for name, _ in report.failures] == ["batch of leaks, victim"]
