"""Extreme-value conformance cases: NaN, +-inf, +-1e30, +-100, a denormal and +-0.0 through every op.

Each case runs one graph per op family and dtype the backend claims, at four shape classes of the
innermost loop (a scalar tail, one vector, many vectors with a tail, and large enough to run in
parallel), and compares every output with TORCH'S OWN RESULT AT THE SAME DTYPE, not the float64
oracle: float32 ``exp(100)`` is inf, and a backend must say so. Each case writes that torch
expression itself (never through ``run_reference``, which is what the ``reference`` backend runs).
NaN must appear exactly where torch has NaN, infinities must match with their sign, finite values
must agree per element (see
``assert_same_floats``). The special values are tiled through whole tensors, so every vector lane
sees every one of them; row and matmul operands carry one special value per row (a sum of two huge
terms of opposite sign has no defined float result to compare), next to plain random values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.testing.oracle import TOLERANCE, UNARY, UNARY_TORCH, assert_same_floats, run_on_backend

__all__ = [  # the cases; conformance.py star-imports them, so plugin authors get them with the rest of the kit
    "test_extreme_attention", "test_extreme_binary", "test_extreme_embedding_values", "test_extreme_matmul",
    "test_extreme_rotary", "test_extreme_rows", "test_extreme_swiglu_with_residual", "test_extreme_unary",
]

FLOATS = ["float32", "float16", "bfloat16", "float64"]
DENORMAL = 1e-40  # a float32 (and bfloat16) denormal; float16 rounds it to 0.0
SPECIALS = (math.nan, math.inf, -math.inf, 1e30, -1e30, -100.0, 100.0, DENORMAL, 0.0, -0.0)
VALUES = SPECIALS + (1.0, -2.5, 0.5, 3.0)  # ordinary values too, e.g. as exponents of pow
# innermost length of each shape class; "parallel" sizes are chosen per family to exceed PARALLEL_MIN_WORK
SHAPES = ["tail", "vector", "vectors", "parallel"]
POINTWISE = {"tail": (1, 7), "vector": (1, 16), "vectors": (3, 67), "parallel": (8, 8192)}
ROW_LENGTH = {"tail": 7, "vector": 16, "vectors": 67, "parallel": 4096}  # x 16 rows
# float16 and bfloat16 run the float32 kernels (widened on the way in, narrowed on the way out): one shape
# class checks the narrowing; float32 runs every class; float64 has its own kernels but the same loop shapes
SHAPES_OF = {"float32": SHAPES, "float64": ["vectors", "parallel"], "float16": ["vectors"], "bfloat16": ["vectors"]}
CASES = [(dtype, shape) for dtype in FLOATS for shape in SHAPES_OF[dtype]]
IDS = [f"{dtype}-{shape}" for dtype, shape in CASES]


def _need(dtypes: frozenset[str], dtype: str) -> None:
    if dtype not in dtypes:
        pytest.skip(f"the backend does not claim {dtype}")


def tiled(dims: tuple[int, ...], dtype: str, shift: int = 0, stride: int = 1) -> torch.Tensor:
    """``VALUES`` repeated through a tensor: element i holds VALUES[(i + shift + (i // n) * (stride - 1)) % n].

    With ``stride=2`` element i and element i of ``tiled(..., stride=1)`` pair every value with every
    other within n * n elements.
    """
    n = len(VALUES)
    i = torch.arange(math.prod(dims))
    index = (i + shift + (i // n) * (stride - 1)) % n
    return torch.tensor(VALUES, dtype=torch.float64)[index].view(dims).to(getattr(torch, dtype))


def one_per_row(dims: tuple[int, ...], dtype: str, seed: int, shift: int = 0) -> torch.Tensor:
    """Seeded random normals with VALUES[(row + shift) % n] at one position of each innermost row."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(dims, generator=gen, dtype=torch.float64)
    rows = t.view(-1, dims[-1])
    for r in range(rows.shape[0]):
        rows[r, (r * 5) % dims[-1]] = VALUES[(r + shift) % len(VALUES)]
    return t.to(getattr(torch, dtype))


def tolerance(dtype: str) -> tuple[float, float]:
    """(rtol, atol): the kit's relative tolerance; below the smallest normal, a flushed result passes."""
    return TOLERANCE[dtype], float(torch.finfo(getattr(torch, dtype)).tiny)


Expect = Callable[..., Any]


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check(graph: yr.KernelGraph, inputs: list[Any], backend: str, dtype: str, expect: Expect,
          scales: Expect | None = None, alternatives: list[Any | None] | None = None) -> None:
    """Run ``graph`` on ``backend`` and compare each output with ``expect(*inputs)``: torch at ``dtype``.

    ``scales(*inputs)`` gets the inputs' absolute values in float64 and gives each output's error
    scale (the magnitude of its summed terms) or None. For float16 and bfloat16, torch rounds every
    intermediate of a chain of ops to the narrow dtype (``silu(a)`` of a denormal becomes 0.0, so
    ``silu(a) * inf`` is NaN); a backend that computes the fused chain in float32 and rounds once, as
    the narrow ops themselves do, passes too: ``expect`` in float32 on the same values, narrowed at
    the end, is accepted as an alternative.
    """
    outs = run_on_backend(graph, inputs, backend)
    wants = _listed(expect(*inputs))
    scale = _listed(scales(*[_abs64(t) for t in inputs])) if scales else [None] * len(wants)
    alts: list[list[Any]] = [[a] if a is not None else [] for a in (alternatives or [None] * len(wants))]
    if dtype in ("float16", "bfloat16"):
        wide = _listed(expect(*[t.float() if t.is_floating_point() else t for t in inputs]))
        for more, w in zip(alts, wide, strict=True):
            more.append(w.to(getattr(torch, dtype)))
    rtol, atol = tolerance(dtype)
    assert len(outs) == len(wants), f"{len(outs)} outputs, torch gives {len(wants)}"
    for index, (out, want) in enumerate(zip(outs, wants, strict=True)):
        assert out.dtype == want.dtype, f"output {index}: dtype {out.dtype}, torch gives {want.dtype}"
        assert_same_floats(out, want, rtol, atol, scale[index], alts[index],
                           what=f"output {index} of graph\n{graph}\non {backend} ({dtype})")


def _abs64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64).abs() if t.is_floating_point() else t


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm as written (not ``F.rms_norm``, which may widen internally): torch at x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


# -- pointwise --------------------------------------------------------------------------


EXTREME_UNARY: dict[str, Callable[[yr.KernelGraph, Any], Any]] = {
    **UNARY,
    "sqrt": lambda g, x: g.sqrt(x),  # negative inputs: NaN, as in torch
    "clamp_max": lambda g, x: g.clamp(x, max_val=-0.0),
}
EXTREME_UNARY_TORCH: dict[str, Callable[[Any], Any]] = {
    **UNARY_TORCH,
    "sqrt": torch.sqrt,
    "clamp_max": lambda x: torch.clamp(x, max=-0.0),
}


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=IDS)
def test_extreme_unary(yirage_backend, yirage_dtypes, dtype, shape) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input(POINTWISE[shape], dtype=dtype)
    for op in EXTREME_UNARY.values():
        g.mark_output(op(g, x))
    t = tiled(POINTWISE[shape], dtype)
    # torch's vectorized float32 gelu gives NaN for +inf while its scalar path (and float64, float16) give
    # +inf, the true limit: accept either there
    gelu_inf = torch.where(t == math.inf, torch.full_like(t, math.inf), torch.nn.functional.gelu(t))
    alternatives = [gelu_inf if name == "gelu" else None for name in EXTREME_UNARY]
    check(g, [t], yirage_backend, dtype, lambda x: [EXTREME_UNARY_TORCH[name](x) for name in EXTREME_UNARY],
          alternatives=alternatives)


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=IDS)
def test_extreme_binary(yirage_backend, yirage_dtypes, dtype, shape) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    a, b = (g.new_input(POINTWISE[shape], dtype=dtype) for _ in range(2))
    for op in ("add", "sub", "mul", "div", "pow"):
        g.mark_output(getattr(g, op)(a, b))
    check(g, [tiled(POINTWISE[shape], dtype), tiled(POINTWISE[shape], dtype, shift=3, stride=2)],
          yirage_backend, dtype, lambda a, b: [a + b, a - b, a * b, a / b, torch.pow(a, b)])


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=IDS)
def test_extreme_swiglu_with_residual(yirage_backend, yirage_dtypes, dtype, shape) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    a, b, r = (g.new_input(POINTWISE[shape], dtype=dtype) for _ in range(3))
    g.mark_output(g.add(g.mul(g.silu(a), b), r))
    dims = POINTWISE[shape]
    inputs = [tiled(dims, dtype), tiled(dims, dtype, shift=5, stride=2), tiled(dims, dtype, shift=9, stride=3)]
    check(g, inputs, yirage_backend, dtype, lambda a, b, r: F.silu(a) * b + r,
          scales=lambda a, b, r: F.silu(a) * b + r)  # on |inputs|; silu(|a|) >= |silu(a)|


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=IDS)
def test_extreme_rotary(yirage_backend, yirage_dtypes, dtype, shape) -> None:
    _need(yirage_dtypes, dtype)
    rows, length = POINTWISE[shape]
    dims = (rows, 2, length + length % 2)  # rotary needs an even last dim
    g = yr.new_kernel_graph()
    x = g.new_input(dims, dtype=dtype)
    cos, sin = (g.new_input((rows, 1, dims[-1]), dtype=dtype) for _ in range(2))
    g.mark_output(g.rotary(x, cos, sin))
    inputs = [tiled(dims, dtype), tiled(cos.dims, dtype, shift=4, stride=2), tiled(sin.dims, dtype, shift=7)]

    check(g, inputs, yirage_backend, dtype, lambda x, c, s: x * c + _rotate_half(x) * s,
          scales=lambda x, c, s: x * c + _rotate_half(x).abs() * s)


def test_extreme_embedding_values(yirage_backend, yirage_dtypes) -> None:
    for dtype in FLOATS:
        if dtype not in yirage_dtypes:
            continue
        g = yr.new_kernel_graph()
        ids, table = g.new_input((3, 7), dtype=yr.int64), g.new_input((len(VALUES) + 3, 19), dtype=dtype)
        g.mark_output(g.embedding(ids, table))
        gen = torch.Generator().manual_seed(21)
        check(g, [torch.randint(0, table.dims[0], (3, 7), generator=gen), tiled(table.dims, dtype)],
              yirage_backend, dtype, lambda ids, table: table[ids])


# -- rows: sum, max (softmax), mean (rms_norm) --------------------------------------------------


def row_input(length: int, dtype: str) -> torch.Tensor:
    """16 rows: one special value each among random normals, a row of -inf, a row of tiled VALUES."""
    t = one_per_row((16, length), dtype, seed=31).to(torch.float64)
    t[len(VALUES)] = -math.inf  # torch's softmax of an all -inf row is NaN
    t[len(VALUES) + 1] = tiled((length,), "float64", shift=2)
    return t.to(getattr(torch, dtype))


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=IDS)
def test_extreme_rows(yirage_backend, yirage_dtypes, dtype, shape) -> None:
    _need(yirage_dtypes, dtype)
    length = ROW_LENGTH[shape]
    g = yr.new_kernel_graph()
    x = g.new_input((16, length), dtype=dtype)
    g.mark_output(g.reduction(x, -1))
    g.mark_output(g.softmax(x, -1))
    g.mark_output(g.rms_norm(x, (length,), eps=1e-5))
    check(g, [row_input(length, dtype)], yirage_backend, dtype,
          lambda x: [x.sum(-1, keepdim=True), torch.softmax(x, -1), x * torch.rsqrt(x.pow(2).mean(-1, True) + 1e-5)],
          scales=lambda x: [x.sum(-1, keepdim=True), None, None])


# -- matmul: dot tiles over a (N, K) B, split-K over a (K, N) B, BLAS GEMM; prologue and epilogue -----

MATMUL_K = {"tail": 7, "vector": 16, "vectors": 67}
MATMUL = {  # strategy: (M, N, K of the parallel class, B stored transposed)
    "dot": (3, 20, 1536, True),
    "split_k": (1, 20, 4096, False),
    "gemm": (20, 20, 256, False),
}
MATMUL_CASES = [(dtype, shape, s) for dtype, shape in CASES for s in MATMUL]


@pytest.mark.parametrize(("dtype", "shape", "strategy"), MATMUL_CASES,
                         ids=[f"{d}-{s}-{m}" for d, s, m in MATMUL_CASES])
def test_extreme_matmul(yirage_backend, yirage_dtypes, dtype, shape, strategy) -> None:
    """silu(rms_norm(x) * g @ W) + r (fused RMS scale, epilogue) and (x * y) @ W (materialized prologue)."""
    _need(yirage_dtypes, dtype)
    m, n, k_parallel, transposed = MATMUL[strategy]
    k = MATMUL_K.get(shape, k_parallel)
    g = yr.new_kernel_graph()
    x, y = g.new_input((m, k), dtype=dtype), g.new_input((m, k), dtype=dtype)
    gamma = g.new_input((k,), dtype=dtype)
    w = g.new_input((k, n), strides=(1, k) if transposed else None, dtype=dtype)
    r = g.new_input((m, n), dtype=dtype)
    g.mark_output(g.add(g.silu(g.matmul(g.mul(g.rms_norm(x, (k,)), gamma), w)), r))
    g.mark_output(g.matmul(g.mul(x, y), w))
    wt = one_per_row((n, k), dtype, seed=41).t()  # one special value per column of W
    w_in = wt if transposed else wt.contiguous()
    gen = torch.Generator().manual_seed(42)
    inputs = [one_per_row((m, k), dtype, seed=43, shift=6),
              torch.randn(m, k, generator=gen, dtype=torch.float64).to(getattr(torch, dtype)),
              (torch.rand(k, generator=gen, dtype=torch.float64) + 0.5).to(getattr(torch, dtype)),
              w_in, tiled((m, n), dtype, shift=1)]

    def expect(x: Any, y: Any, gamma: Any, w: Any, r: Any) -> list[Any]:
        return [F.silu((_rms(x) * gamma) @ w) + r, (x * y) @ w]

    check(g, inputs, yirage_backend, dtype, expect, scales=expect)  # on |inputs|: the terms' magnitude


# -- decode attention ----------------------------------------------------------------------------

ATTENTION = {"tail": (4, 2, 12, 7), "vector": (4, 2, 12, 16), "vectors": (4, 2, 12, 67),
             "parallel": (8, 2, 64, 64)}  # heads, kv heads, sequence, head dim


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=IDS)
def test_extreme_attention(yirage_backend, yirage_dtypes, dtype, shape) -> None:
    _need(yirage_dtypes, dtype)
    heads, kv_heads, seq, d = ATTENTION[shape]
    g = yr.new_kernel_graph()
    q = g.new_input((2, heads, d), dtype=dtype)
    k, v = (g.new_input((2, kv_heads, seq, d), dtype=dtype) for _ in range(2))
    lengths = g.new_input((2,), dtype=yr.int32)
    g.mark_output(g.attention(q, k, v, lengths))
    gen = torch.Generator().manual_seed(51)
    keys = torch.randn(k.dims, generator=gen, dtype=torch.float64).to(getattr(torch, dtype))
    values = one_per_row(v.dims, dtype, seed=53, shift=3)
    # positions past a sequence's length are unused cache slots that a kernel must not read; torch's
    # masked reference still multiplies them by 0 (0 * inf is NaN), so they hold plain numbers here
    values[0, :, 5:] = keys[0, :, 5:]
    inputs = [one_per_row(q.dims, dtype, seed=52), keys, values, torch.tensor([5, seq], dtype=torch.int32)]

    signed = [t.to(torch.float64) for t in inputs[:2]]
    check(g, inputs, yirage_backend, dtype, _attention,
          scales=lambda q, k, v, n: _attention(*signed, v, n))  # softmax weights are >= 0: sum of p * |v|


def _attention(q: Any, k: Any, v: Any, lengths: Any) -> Any:
    """Decode attention in torch at q's dtype: the first lengths[b] cache rows, KV heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q, k) * (1.0 / math.sqrt(q.shape[-1]))
    unused = torch.arange(k.shape[2])[None, :] >= lengths.long()[:, None]
    scores = scores.masked_fill(unused[:, None, :], -math.inf)
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, dim=-1), v)
