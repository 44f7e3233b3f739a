"""The C-family renderer's fast paths, checked on OpenCL (PoCL here) against float64 torch; no timings.

The speed work (blocked matmul shapes, contiguous pointwise kernels, an inline
vectorizable float32 exp, interruptible waits) must not change results beyond
summation order: every shape a path takes, edge sizes included (K tails, N
without a block divisor, batch broadcast, float16 storage), is compared with
torch in float64. The structure test pins that W1 and W2 of docs/benchmarks.md take
the fast shapes at all (the naive kernels were 13-73x slower on PoCL); the
interrupt test that a long call answers Ctrl-C while the device still works.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import yirage as yr
from yirage.backend.selection import registry
from yirage.codegen.cstyle import render
from yirage.codegen.dialects import dialect
from yirage.compiler.lower import build_plan

opencl = pytest.mark.skipif(not registry().get("opencl").availability().ok,
                            reason="no OpenCL device (pip install 'yirage-backend-opencl[pocl]')")
GEN = torch.Generator().manual_seed(9)


def _rms_linear_graph(batch: int, k: int, n: int, transposed: bool) -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    x, gamma = g.new_input((batch, k)), g.new_input((k,))
    w = g.new_input((k, n), strides=(1, k) if transposed else None)
    g.mark_output(g.matmul(g.mul(g.rms_norm(x, (k,), eps=1e-6), gamma), w))
    return g


def _swiglu_graph(shape: tuple[int, ...]) -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    a, b, r = (g.new_input(shape) for _ in range(3))
    g.mark_output(g.add(g.mul(g.silu(a), b), r))
    return g


def _body(source: str, name: str) -> str:
    start = source.index("{", re.search(rf"\b{name}\(", source).start())
    depth = 0
    for j in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[j], 0)
        if depth == 0:
            return source[start:j + 1]
    raise AssertionError(f"unbalanced braces in {name}")


@pytest.mark.parametrize("transposed", [True, False], ids=["W pre-transposed", "W row-major"])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_w1_and_w2_render_blocked_and_flat_kernels(batch: int, transposed: bool) -> None:
    """W1's product: several outputs per work-item; W2: no index arithmetic per element, exp inline."""
    plan = build_plan(_rms_linear_graph(batch, 4096, 4096, transposed))
    rendered = render(plan, dialect("opencl"))
    product = rendered.launches[-1]
    block = re.search(r"\bacc\[(\d+)\]\[(\d+)\]", _body(rendered.source, product.kernel))
    assert block and int(block.group(1)) * int(block.group(2)) >= 4, "a work-item owns a block of outputs"
    assert product.global_size < batch * 4096, "fewer work-items than outputs"

    plan = build_plan(_swiglu_graph((64, 11008)))
    rendered = render(plan, dialect("opencl"))
    body = _body(rendered.source, rendered.launches[0].kernel)
    assert "%" not in body and "/ 11008" not in body, f"per-element index decomposition in {body}"
    assert "y_exp_f32(" in rendered.source and not re.search(r"[^_\w]exp\(", rendered.source), \
        "float32 exp is the inline helper, not the library call"


def _oracle_matmul(x: torch.Tensor, gamma: torch.Tensor | None, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x64 = x.double()
    if gamma is not None:
        x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()
    return x64 @ w.double()


# (batch, K, N): K tails (37 = 2 x 16 + 5), N with block divisors 4 and 2 and none (7), K = 1, N = 1
SHAPES = [(3, 37, 10), (5, 64, 12), (8, 50, 7), (2, 1, 8), (4, 33, 1), (1, 256, 48)]


@opencl
@pytest.mark.parametrize("transposed", [True, False], ids=["K-contiguous", "N-contiguous"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{b}x{k}x{n}" for b, k, n in SHAPES])
def test_matmul_shapes_match_float64(shape: tuple[int, int, int], transposed: bool) -> None:
    batch, k, n = shape
    x, gamma = torch.randn(batch, k, generator=GEN), torch.randn(k, generator=GEN)
    w = torch.randn(n, k, generator=GEN).t() if transposed else torch.randn(k, n, generator=GEN)
    (out,) = _rms_linear_graph(batch, k, n, transposed).compile(backend="opencl")([x, gamma, w])
    torch.testing.assert_close(out.double(), _oracle_matmul(x, gamma, w), rtol=2e-5, atol=2e-5)


@opencl
def test_batched_broadcast_matmul_with_epilogue_and_float16_storage() -> None:
    g = yr.new_kernel_graph()
    a = g.new_input((2, 3, 5, 40), dtype=yr.float16)
    b = g.new_input((3, 40, 8), dtype=yr.float16)  # broadcast over the leading batch dim
    bias = g.new_input((8,), dtype=yr.float16)
    g.mark_output(g.silu(g.add(g.matmul(a, b), bias)))
    ta = torch.randn(2, 3, 5, 40, generator=GEN).half()
    tb = torch.randn(3, 40, 8, generator=GEN).half()
    tbias = torch.randn(8, generator=GEN).half()
    (out,) = g.compile(backend="opencl")([ta, tb, tbias])
    want = torch.nn.functional.silu(ta.double() @ tb.double() + tbias.double())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)


@opencl
def test_transposed_batched_weights_take_the_dot_shape_correctly() -> None:
    g = yr.new_kernel_graph()
    a = g.new_input((3, 6, 20))
    b = g.new_input((3, 20, 12), strides=(240, 1, 20))  # each batch's (K, N) stored as (N, K)
    g.mark_output(g.matmul(a, b))
    ta = torch.randn(3, 6, 20, generator=GEN)
    tb = torch.randn(3, 12, 20, generator=GEN).transpose(1, 2)
    (out,) = g.compile(backend="opencl")([ta, tb])
    torch.testing.assert_close(out.double(), ta.double() @ tb.double(), rtol=2e-5, atol=2e-5)


@opencl
def test_inline_exp_is_within_one_ulp_and_exact_on_special_values() -> None:
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 88.72283, 88.7229, 89.0, -87.33, -100.0, -103.97, -104.0, -200.0,
                            float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30])
    xs = torch.cat([special, torch.linspace(-104.0, 88.7, 200_000)])
    g = yr.new_kernel_graph()
    g.mark_output(g.exp(g.new_input(tuple(xs.shape))))
    (out,) = g.compile(backend="opencl")([xs])
    want = torch.exp(xs.double()).float()
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan), "NaN in, NaN out, and nowhere else"
    assert torch.equal(out[want.isinf()], want[want.isinf()]) and torch.equal(out[want == 0], want[want == 0])
    ulps = (out[~nan].view(torch.int32).long() - want[~nan].view(torch.int32).long()).abs()
    assert int(ulps.max()) <= 1, f"{int(ulps.max())} ulp at x = {float(xs[~nan][ulps.argmax()])}"


@opencl
@pytest.mark.parametrize("shape", [(64, 11008), (3, 7), (1, 4096)])
def test_swiglu_contiguous_and_broadcast(shape: tuple[int, int]) -> None:
    a, b, r = (torch.randn(shape, generator=GEN) * 8 for _ in range(3))
    (out,) = _swiglu_graph(shape).compile(backend="opencl")([a, b, r])
    want = torch.nn.functional.silu(a.double()) * b.double() + r.double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    g = yr.new_kernel_graph()  # a broadcast operand takes the decomposing path
    x, row = g.new_input(shape), g.new_input((shape[-1],))
    g.mark_output(g.mul(g.silu(x), row))
    (out,) = g.compile(backend="opencl")([a, r[0]])
    torch.testing.assert_close(out.double(), torch.nn.functional.silu(a.double()) * r[0].double(),
                               rtol=1e-5, atol=1e-5)


@opencl
def test_a_long_call_answers_ctrl_c_while_the_device_still_works() -> None:
    """queue.finish() blocks in C; the call must wait in Python slices so KeyboardInterrupt comes promptly.

    The proof is not a timing: after the KeyboardInterrupt, a marker enqueued behind the call is still pending,
    i.e. the interrupt arrived before the device finished (a finish()-based wait raises it only afterwards).
    """
    code = """
        import os, signal, sys, threading, torch, pyopencl as cl, yirage as yr
        from yirage_backend_opencl.compile import context
        g = yr.new_kernel_graph()
        g.mark_output(g.matmul(g.new_input((4096, 4096)), g.new_input((4096, 4096))))  # 137 GFLOP
        exe = g.compile(backend="opencl")
        x, w = torch.randn(4096, 4096), torch.randn(4096, 4096)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            exe([x, w])
            print("completed")
        except KeyboardInterrupt:
            queue = context()[1]
            marker = cl.enqueue_marker(queue)
            queue.flush()
            print("interrupted", "busy" if marker.command_execution_status > 0 else "idle")
        sys.stdout.flush()
        os._exit(0)  # do not wait for the abandoned work
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "YIRAGE_OPENCL_HOST_GEMM": "0"})  # the OpenCL wait
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["interrupted", "busy"], proc.stdout + proc.stderr[-2000:]


@opencl
def test_scratch_is_reset_between_calls_of_one_program() -> None:
    """Scratch buffers live with the program now: a bad call's status must not leak into the next call."""
    g = yr.new_kernel_graph()
    g.mark_output(g.embedding(g.new_input((4,), dtype=yr.int64), g.new_input((10, 3))))
    exe = g.compile(backend="opencl")
    table = torch.randn(10, 3, generator=GEN)
    with pytest.raises(IndexError, match="out of range"):
        exe([torch.tensor([1, 2, 10, 3]), table])
    ids = torch.tensor([9, 0, 4, 4])
    (out,) = exe([ids, table])
    assert torch.equal(out, table[ids])
