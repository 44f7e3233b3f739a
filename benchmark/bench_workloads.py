"""The workloads of multi_backend_benchmark.py, one place for the script and the pytest-benchmark tests
(test_bench_workloads.py): each is a yirage kernel graph, the torch code a user would write for the same math, and
the inputs both take, for one (batch, seq, hidden) point of the size grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timing import COMPILED, EAGER, Maker, same, torch_maker, yirage_makers

import yirage as yr

HEAD_DIM = 64
EPS = 1e-6
DTYPES = {"float32": (torch.float32, yr.float32), "float16": (torch.float16, yr.float16),
          "bfloat16": (torch.bfloat16, yr.bfloat16)}
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 4e-2}  # rtol, and atol as a share of max |ref|


@dataclass(frozen=True)
class Shape:
    """One point of the size grid."""

    batch: int
    seq: int
    hidden: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM

    @property
    def inter(self) -> int:  # Llama's SwiGLU width: 8/3 H rounded up to a multiple of 64 (512 -> 1408)
        return -(-8 * self.hidden // (3 * 64)) * 64

    @property
    def label(self) -> str:
        return f"B={self.batch} S={self.seq} H={self.hidden}"


@dataclass(frozen=True)
class Workload:
    """A yirage graph builder, the torch function it is measured against, and the inputs both take."""

    title: str
    build: Callable[[yr.KernelGraph, Shape, Any], None]  # (graph, shape, yirage dtype)
    torch_fn: Callable[..., torch.Tensor]
    inputs: Callable[[Shape], list[torch.Tensor]]  # float32 tensors in the order build declares them


def _randn(*dims: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*dims) * scale


def _matmul_graph(g: yr.KernelGraph, s: Shape, dt: Any) -> None:
    g.mark_output(g.matmul(g.new_input((s.tokens, s.hidden), dtype=dt), g.new_input((s.hidden, s.hidden), dtype=dt)))


def _rms_linear_graph(g: yr.KernelGraph, s: Shape, dt: Any) -> None:
    x, gain = g.new_input((s.tokens, s.hidden), dtype=dt), g.new_input((s.hidden,), dtype=dt)
    w = g.new_input((s.hidden, s.hidden), strides=(1, s.hidden), dtype=dt)  # W (out, in) read as (in, out)
    g.mark_output(g.matmul(g.mul(g.rms_norm(x, (s.hidden,), eps=EPS), gain), w))


def _gated_mlp_graph(g: yr.KernelGraph, s: Shape, dt: Any) -> None:
    h, i = s.hidden, s.inter
    x = g.new_input((s.tokens, h), dtype=dt)
    wg, wu = (g.new_input((h, i), strides=(1, h), dtype=dt) for _ in range(2))
    wd = g.new_input((i, h), strides=(1, i), dtype=dt)
    g.mark_output(g.matmul(g.mul(g.silu(g.matmul(x, wg)), g.matmul(x, wu)), wd))


def _attention_graph(g: yr.KernelGraph, s: Shape, dt: Any) -> None:
    b, n, t, d = s.batch, s.heads, s.seq, HEAD_DIM
    q = g.new_input((b, n, t, d), dtype=dt)
    k_t = g.new_input((b, n, d, t), strides=(n * t * d, t * d, 1, d), dtype=dt)  # K (b, n, t, d) read as K^T
    v = g.new_input((b, n, t, d), dtype=dt)
    scale, mask = g.new_input((1,), dtype=dt), g.new_input((t, t), dtype=dt)
    g.mark_output(g.matmul(g.softmax(g.add(g.mul(g.matmul(q, k_t), scale), mask), -1), v))


def _elementwise_graph(g: yr.KernelGraph, s: Shape, dt: Any) -> None:
    a, bias = g.new_input((s.tokens, s.hidden), dtype=dt), g.new_input((s.hidden,), dtype=dt)
    b, r = (g.new_input((s.tokens, s.hidden), dtype=dt) for _ in range(2))
    g.mark_output(g.add(g.mul(g.gelu(g.add(a, bias)), b), r))


def _torch_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k_t.transpose(-1, -2), v, is_causal=True)


def _attention_inputs(s: Shape) -> list[torch.Tensor]:
    q, k, v = (_randn(s.batch, s.heads, s.seq, HEAD_DIM) for _ in range(3))
    mask = torch.full((s.seq, s.seq), float("-inf")).triu(1)
    return [q, k.transpose(-1, -2), v, torch.tensor([HEAD_DIM**-0.5]), mask]


WORKLOADS: dict[str, Workload] = {
    "matmul": Workload(
        "matmul X @ W", _matmul_graph, lambda x, w: x @ w,
        lambda s: [_randn(s.tokens, s.hidden), _randn(s.hidden, s.hidden, scale=s.hidden**-0.5)]),
    "rmsnorm_linear": Workload(
        "RMSNorm + Linear", _rms_linear_graph,
        lambda x, gain, w: F.linear(F.rms_norm(x, (x.shape[-1],), gain, eps=EPS), w.t()),
        lambda s: [_randn(s.tokens, s.hidden), 1 + _randn(s.hidden, scale=0.1),
                   _randn(s.hidden, s.hidden, scale=s.hidden**-0.5).t()]),
    "gated_mlp": Workload(
        "gated MLP (SwiGLU)", _gated_mlp_graph,
        lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg.t())) * F.linear(x, wu.t()), wd.t()),
        lambda s: [_randn(s.tokens, s.hidden), _randn(s.inter, s.hidden, scale=s.hidden**-0.5).t(),
                   _randn(s.inter, s.hidden, scale=s.hidden**-0.5).t(),
                   _randn(s.hidden, s.inter, scale=s.inter**-0.5).t()]),
    "attention": Workload("causal attention", _attention_graph, _torch_attention, _attention_inputs),
    "elementwise": Workload(
        "elementwise gelu(a+bias)*b+r", _elementwise_graph, lambda a, bias, b, r: F.gelu(a + bias) * b + r,
        lambda s: [_randn(s.tokens, s.hidden), _randn(s.hidden), _randn(s.tokens, s.hidden),
                   _randn(s.tokens, s.hidden)]),
}


def case_inputs(workload: Workload, shape: Shape, dtype: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The inputs in `dtype` (layouts kept) and the oracle: torch in float32 on those very values, rounded once."""
    tdt = DTYPES[dtype][0]
    inputs = [t if t.dtype == tdt else t.to(tdt) for t in workload.inputs(shape)]  # .to keeps a transposed view
    ref = workload.torch_fn(*[t.float() for t in inputs]).to(tdt)
    return inputs, ref


def makers_for(workload: Workload, shape: Shape, dtype: str, backends: list[str], inputs: list[torch.Tensor],
               with_compile: bool) -> dict[str, Maker]:
    """yirage[<backend>] for each backend, then torch eager and (unless skipped) torch.compile."""
    ydt = DTYPES[dtype][1]
    args = same(inputs)
    makers = yirage_makers(backends, lambda g: workload.build(g, shape, ydt), args)
    makers[EAGER] = torch_maker(workload.torch_fn, args, compiled=False)
    if with_compile:
        makers[COMPILED] = torch_maker(workload.torch_fn, args, compiled=True)
    return makers
