"""The split-K GEMV of the C-family renderer (``Dialect.gemv_split_k``, CPU OpenCL devices), against float64 torch.

A GEMV (M = 1) over a row-major B used to be one work-group of 64 work-items
on PoCL (one core, 256 B of each row at a time). With the flag, S groups of
one work-item each stream whole rows of their K slice into partial rows, and
a second kernel sums the partials in a fixed order. These tests render the
plan with the flag on and run the launches with a minimal pyopencl launcher
written here (independent of the backend's launcher, which may or may not
set the flag for the device), with every scratch buffer poisoned with NaN
before each call: the kernels must write partials before reading them. The
structural tests pin that the flag changes nothing but M = 1 row-major
products big enough to matter. No timings.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import pytest
import torch

import yirage as yr
from yirage.backend.selection import registry
from yirage.codegen.cstyle import Rendered, render
from yirage.codegen.cstyle_matmul import SPLIT_K_MIN_KN, Gemm, split_k_groups
from yirage.codegen.dialect import Dialect
from yirage.codegen.dialects import dialect
from yirage.compiler.lower import build_plan

opencl = pytest.mark.skipif(not registry().get("opencl").availability().ok,
                            reason="no OpenCL device (pip install 'yirage-backend-opencl[pocl]')")
PLAIN = dialect("opencl")
SPLIT = replace(PLAIN, gemv_split_k=True)
TORCH = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _linear(k: int, n: int, *, rms: bool = False, residual: bool = False, dtype: Any = yr.float32,
            b_dtype: Any = None, transposed: bool = False, m: int = 1) -> yr.KernelGraph:
    """(m, K) @ (K, N), optionally RMSNorm(x) * gamma first and + residual after."""
    g = yr.new_kernel_graph()
    x = g.new_input((m, k), dtype=dtype)
    a = g.mul(g.rms_norm(x, (k,), eps=1e-6), g.new_input((k,), dtype=dtype)) if rms else x
    w = g.new_input((k, n), dtype=b_dtype or dtype, strides=(1, k) if transposed else None)
    out = g.matmul(a, w)
    g.mark_output(g.add(out, g.new_input((m, n), dtype=dtype)) if residual else out)
    return g


def _oracle(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor | None = None,
            res: torch.Tensor | None = None) -> torch.Tensor:
    a = x.double()
    if gamma is not None:
        a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.double()
    out = a @ w.double()
    return out if res is None else out + res.double()


def _split_kernels(rendered: Rendered) -> list[str]:
    return [x.kernel for x in rendered.launches if x.kernel.endswith("_part")]


class _Launcher:
    """Allocate every plan buffer and scratch, run ``rendered.steps`` in order with pyopencl, read outputs back."""

    def __init__(self, g: yr.KernelGraph, d: Dialect = SPLIT) -> None:
        import pyopencl as cl

        self.cl = cl
        self.plan = plan = build_plan(g)
        self.rendered = render(plan, d)
        # a Gemm step runs as its fallback kernels (those outside the steps), its epilogue kernel skipped
        fallback = [x for x in self.rendered.launches if x not in self.rendered.steps]
        gemms = [x for x in self.rendered.steps if isinstance(x, Gemm)]
        self.order = [y for x in self.rendered.steps for y in (fallback if isinstance(x, Gemm) else [x])
                      if isinstance(x, Gemm) or x.kernel not in {gm.epilogue for gm in gemms}]
        dev = cl.get_platforms()[0].get_devices()[0]
        self.ctx = cl.Context([dev])
        self.queue = cl.CommandQueue(self.ctx)
        program = cl.Program(self.ctx, self.rendered.source).build(options=["-cl-std=CL1.2"])
        self.kernels = {x.kernel: getattr(program, x.kernel) for x in self.rendered.launches}
        self.owned = {b.name: torch.zeros(max(1, math.prod(b.dims)), dtype=torch.float64 if b.dtype.name ==
                                          "float64" else torch.float32)
                      for b in plan.buffers.values() if b.role == "temp"}
        self.owned.update({s.name: torch.zeros(s.count, dtype=TORCH[s.dtype]) for s in self.rendered.scratch})

    def _buffer(self, t: torch.Tensor) -> Any:
        if not t.is_contiguous():  # the storage span, as the backends pass strided inputs
            extent = 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True) if d > 1)
            t = torch.as_strided(t, (extent,), (1,))
        flat = (t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t).numpy()
        mf = self.cl.mem_flags
        return self.cl.Buffer(self.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=flat)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        cl, plan = self.cl, self.plan
        for s in self.rendered.scratch:
            self.owned[s.name].fill_(math.nan)  # partials must be written before they are read
        bufs = {name: self._buffer(t) for name, t in self.owned.items()}
        bufs.update({name: self._buffer(inputs[plan.buffers[name].index]) for name in plan.inputs})
        outs = {name: torch.empty(plan.buffers[name].dims, dtype=TORCH[plan.buffers[name].dtype.name])
                for name in plan.outputs}
        bufs.update({name: self._buffer(t) for name, t in outs.items()})
        for step in self.order:
            kernel = self.kernels[step.kernel]
            kernel.set_args(*[bufs[a] for a in step.args])
            cl.enqueue_nd_range_kernel(self.queue, kernel, (step.global_size,), (step.local,))
        for name, t in outs.items():
            cl.enqueue_copy(self.queue, (t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16)
                                         else t).numpy(), bufs[name])
        self.queue.finish()
        return [outs[name] for name in plan.outputs]


def test_split_k_groups_cover_k_with_enough_rows_each() -> None:
    for kdim in (16, 17, 20, 64, 100, 1031, 4096, 4100, 9973, 11008, 1 << 17):
        groups, kc = split_k_groups(kdim)
        assert 2 <= groups <= 32 and kc >= 8, (kdim, groups, kc)
        assert (groups - 1) * kc < kdim <= groups * kc, f"every group owns at least one row of K = {kdim}"
    assert split_k_groups(4096) == (32, 128)


@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "pre-transposed"])
def test_the_flag_splits_only_big_row_major_gemvs(transposed: bool) -> None:
    w1 = build_plan(_linear(4096, 4096, rms=True, transposed=transposed))
    plain, split = render(w1, PLAIN), render(w1, SPLIT)
    assert not _split_kernels(plain), "without the flag no dialect renders the split shape"
    if transposed:
        assert split.source == plain.source, "the dot shape (B contiguous along K) is not split"
        return
    (part,) = [x for x in split.launches if x.kernel == "k0_part"]
    assert (part.groups, part.local) == (32, 1), "32 groups of one work-item each stream whole rows of B"
    assert [x.kernel for x in split.steps] == ["k0_pro", "k0_part", "k0"], "prologue, partials, sum + epilogue"
    for g in (_linear(4096, 4096, m=8), _linear(64, 64), _linear(8, 8192)):  # M > 1, small K * N, K < 16
        plan = build_plan(g)
        assert render(plan, SPLIT).source == render(plan, PLAIN).source


@pytest.mark.parametrize("dialect_name", ["opencl", "cuda", "hip", "metal"])
def test_every_dialect_renders_the_split_shape_with_its_own_spellings(dialect_name: str) -> None:
    d = replace(dialect(dialect_name), gemv_split_k=True, host_gemm=False)
    rendered = render(build_plan(_linear(4096, 1000, residual=True)), d)
    assert [x.kernel for x in rendered.steps] == ["k0_part", "k0"], rendered.steps
    for name in ("k0_part", "k0"):
        assert f"{d.kernel} {d.launch_bounds(1)}{name}(" in rendered.source, f"no kernel {name} of one work-item"
    assert dialect_name == "opencl" or "get_global_id" not in rendered.source, "OpenCL spelling leaked"


def test_a_host_gemm_fallback_keeps_its_name_and_stays_out_of_the_steps() -> None:
    d = replace(dialect("cuda"), gemv_split_k=True, host_gemm=True, host_gemm_min_m=1)
    rendered = render(build_plan(_linear(1024, 512, residual=True)), d)
    names = [x.kernel for x in rendered.launches]
    assert "k0_full_part" in names and "k0_full" in names, names
    steps = [getattr(x, "kernel", "gemm") for x in rendered.steps]
    assert "k0_full_part" not in steps and "k0_full" not in steps, steps
    assert re.search(r"\bk0_full_part\(", rendered.source)


GEN = torch.Generator().manual_seed(11)
# (K, N): W1, the smallest K split (16), N = 7 and 1, K with a tail in the last group, odd everything
SHAPES = [(4096, 4096), (16, 4096), (9973, 7), (4100, 17), (1031, 67), (65536, 1)]


@opencl
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_row_major_gemv_matches_float64(shape: tuple[int, int]) -> None:
    kdim, n = shape
    run = _Launcher(_linear(kdim, n))
    assert bool(_split_kernels(run.rendered)) == (n > 1 and kdim * n >= SPLIT_K_MIN_KN), run.rendered.launches
    x, w = torch.randn(1, kdim, generator=GEN), torch.randn(kdim, n, generator=GEN)
    (out,) = run([x, w])
    torch.testing.assert_close(out.double(), _oracle(x, w), rtol=1e-5, atol=1e-5 * math.sqrt(kdim))


@opencl
def test_fused_rms_norm_prologue_and_residual_epilogue() -> None:
    kdim, n = 2048, 96
    run = _Launcher(_linear(kdim, n, rms=True, residual=True))
    assert _split_kernels(run.rendered)
    x, gamma = torch.randn(1, kdim, generator=GEN), torch.randn(kdim, generator=GEN)
    w, res = torch.randn(kdim, n, generator=GEN), torch.randn(1, n, generator=GEN)
    (out,) = run([x, gamma, w, res])
    torch.testing.assert_close(out.double(), _oracle(x, w, gamma, res), rtol=2e-5, atol=2e-4)


@opencl
def test_batch_dims_with_b_broadcast_over_the_leading_one() -> None:
    kdim, n = 300, 250
    g = yr.new_kernel_graph()
    a, b = g.new_input((2, 3, 1, kdim)), g.new_input((3, kdim, n))
    bias = g.new_input((n,))
    g.mark_output(g.add(g.matmul(a, b), bias))
    run = _Launcher(g)
    (part,) = [x for x in run.rendered.launches if x.kernel.endswith("_part")]
    assert part.global_size == 6 * split_k_groups(kdim)[0], "S groups per batch item"
    ta, tb = torch.randn(2, 3, 1, kdim, generator=GEN), torch.randn(3, kdim, n, generator=GEN)
    tbias = torch.randn(n, generator=GEN)
    (out,) = run([ta, tb, tbias])
    torch.testing.assert_close(out.double(), ta.double() @ tb.double() + tbias.double(), rtol=1e-5, atol=1e-4)


@opencl
def test_float64() -> None:
    kdim, n = 1500, 70
    run = _Launcher(_linear(kdim, n, dtype=yr.float64))
    assert _split_kernels(run.rendered)
    x = torch.randn(1, kdim, generator=GEN, dtype=torch.float64)
    w = torch.randn(kdim, n, generator=GEN, dtype=torch.float64)
    (out,) = run([x, w])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x @ w, rtol=1e-12, atol=1e-12)


@opencl
@pytest.mark.parametrize("b_dtype", ["bfloat16", "float16"])
def test_narrow_weights_and_output(b_dtype: str) -> None:
    kdim, n = 1024, 80
    narrow = getattr(yr, b_dtype)
    run = _Launcher(_linear(kdim, n, dtype=narrow))
    assert _split_kernels(run.rendered)
    x = torch.randn(1, kdim, generator=GEN).to(TORCH[b_dtype])
    w = torch.randn(kdim, n, generator=GEN).to(TORCH[b_dtype])
    (out,) = run([x, w])
    assert out.dtype == TORCH[b_dtype]
    torch.testing.assert_close(out.double(), _oracle(x, w), rtol=1e-2, atol=1e-2 * math.sqrt(kdim))


@opencl
def test_through_the_opencl_backend() -> None:
    """The backend's own launcher (split or not, as it decides for its device) gives the same answer."""
    kdim, n = 2048, 96
    x, gamma = torch.randn(1, kdim, generator=GEN), torch.randn(kdim, generator=GEN)
    w, res = torch.randn(kdim, n, generator=GEN), torch.randn(1, n, generator=GEN)
    (out,) = _linear(kdim, n, rms=True, residual=True).compile(backend="opencl")([x, gamma, w, res])
    torch.testing.assert_close(out.double(), _oracle(x, w, gamma, res), rtol=2e-5, atol=2e-4)


@opencl
def test_the_fallback_of_a_host_gemm_step_computes_the_product() -> None:
    """A host_gemm dialect keeps the whole product as the Gemm's fallback: split, named apart, and right."""
    kdim, n = 1024, 300
    run = _Launcher(_linear(kdim, n, residual=True), replace(SPLIT, host_gemm=True, host_gemm_min_m=1))
    assert [x.kernel for x in run.order] == ["k0_full_part", "k0_full"], run.order
    x, w = torch.randn(1, kdim, generator=GEN), torch.randn(kdim, n, generator=GEN)
    res = torch.randn(1, n, generator=GEN)
    (out,) = run([x, w, res])
    torch.testing.assert_close(out.double(), _oracle(x, w, res=res), rtol=1e-5, atol=1e-4)
