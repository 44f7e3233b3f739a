"""Backend conformance cases: every op, broadcasting, layouts, fused patterns,
bad inputs and seeded random graphs, plus the extreme-value cases of ``extremes``
(NaN, infinities, overflow, denormals). Run them on any backend with
``pytest --pyargs yirage.testing.conformance --yirage-backend NAME``.

Every case has its own oracle, a torch expression in float64 written here (``torch.matmul``,
``torch.softmax``, ...), so it holds the ``reference`` backend to something independent too. The
random graphs have no such expression: their oracle is the graph evaluated op by op in float64
(``run_reference``'s table), independent of a compiled backend's code path but not of the
``reference`` backend, which therefore skips them. Tolerances are per element (``DTYPE_TOLERANCE``),
scaled by the magnitude of the summed terms where an output is a sum.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

import yirage as yr
from yirage.testing.oracle import (
    UNARY,
    UNARY_TORCH,
    assert_matches_reference,
    assert_matches_torch,
    backend_device,
    on_backend,
    random_inputs,
)
from yirage.testing.random_graphs import COVERAGE_PATTERNS, coverage, random_graph, seeded_graph

FLOATS = ["float32", "float16", "bfloat16", "float64"]


def _need(dtypes: frozenset[str], dtype: str) -> None:
    if dtype not in dtypes:
        pytest.skip(f"the backend does not claim {dtype}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(yirage_backend, yirage_dtypes, op, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((3, 70), dtype=dtype)
    g.mark_output(UNARY[op](g, x))
    assert_matches_torch(g, random_inputs(g, seed=1), yirage_backend, UNARY_TORCH[op])


@pytest.mark.parametrize("dtype", FLOATS)
def test_sqrt_of_positive_values(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((5, 33), dtype=dtype)
    g.mark_output(g.sqrt(x))
    assert_matches_torch(g, [random_inputs(g, 2)[0].abs() + 0.1], yirage_backend, torch.sqrt)


BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize(("da", "db"), [((4, 9), (4, 9)), ((4, 1, 9), (3, 1)), ((1,), (5, 7)), ((2, 3, 1), (3, 8))])
def test_binary_broadcasting(yirage_backend, yirage_dtypes, op, dtype, da, db) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    a, b = g.new_input(da, dtype=dtype), g.new_input(db, dtype=dtype)
    g.mark_output(getattr(g, op)(a, b))
    xa, xb = random_inputs(g, seed=3)
    if op == "pow":
        xa = xa.abs() + 0.5
    if op == "div":
        xb = xb.sign() * (xb.abs() + 0.5)
    assert_matches_torch(g, [xa, xb], yirage_backend, BINARY[op])


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_arithmetic(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    a, b = g.new_input((6, 5), dtype=dtype), g.new_input((5,), dtype=dtype)
    out = g.clamp(g.relu(g.sub(g.mul(a, b), g.square(b))), 0, 20)
    g.mark_output(out)
    g.mark_output(g.reduction(g.add(a, b), 0))
    assert_matches_torch(g, random_inputs(g, seed=4), yirage_backend,
                         lambda a, b: [(a * b - b * b).clamp(0, 20), (a + b).sum(0, keepdim=True)])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("da", "db"), [((1, 64), (64, 48)), ((5, 33), (33, 7)), ((40, 24), (24, 20)),
                                        ((2, 3, 16), (16, 8)), ((2, 4, 8), (2, 8, 6)), ((1, 2, 8), (3, 8, 5))])
@pytest.mark.parametrize("transposed", [False, True])
def test_matmul(yirage_backend, yirage_dtypes, dtype, da, db, transposed) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    a = g.new_input(da, dtype=dtype)
    strides = None
    if transposed:  # the weight is stored transposed: the last two dims swapped in memory
        k, n = db[-2:]
        strides = tuple(math.prod(db[i + 1:-2]) * k * n for i in range(len(db) - 2)) + (1, k)
    b = g.new_input(db, strides=strides, dtype=dtype)
    g.mark_output(g.matmul(a, b))
    assert_matches_torch(g, random_inputs(g, seed=5), yirage_backend, torch.matmul,
                         scale=lambda a, b: a.abs() @ b.abs())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("dims", "dim"), [((4, 50), -1), ((4, 50), 0), ((3, 5, 7), 1), ((1, 300), 1),
                                           ((2, 2500), -1)])  # a long row: C-family loops of several load rounds
def test_reduction_and_softmax(yirage_backend, yirage_dtypes, dtype, dims, dim) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input(dims, dtype=dtype)
    g.mark_output(g.reduction(x, dim))
    g.mark_output(g.softmax(x, dim))
    assert_matches_torch(g, random_inputs(g, seed=6), yirage_backend,
                         lambda x: [x.sum(dim, keepdim=True), torch.softmax(x, dim)],
                         scale=lambda x: [x.abs().sum(dim, keepdim=True), None])


@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((6, 96), dtype=dtype)
    g.mark_output(g.rms_norm(x, (96,), eps=1e-5))
    assert_matches_torch(g, random_inputs(g, seed=7), yirage_backend, lambda x: F.rms_norm(x, (96,), eps=1e-5))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("k", [128, 2500])  # 2500: a C-family prologue of several load rounds per thread
def test_rms_norm_then_matmul(yirage_backend, yirage_dtypes, dtype, with_weight, k) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((8, k), dtype=dtype)
    w = g.new_input((k, 40), strides=(1, k), dtype=dtype)
    d = g.rms_norm(x, (k,))
    if with_weight:
        d = g.mul(d, g.new_input((k,), dtype=dtype))
    g.mark_output(g.silu(g.matmul(d, w)))

    def normed(x: torch.Tensor, *gamma: torch.Tensor) -> torch.Tensor:
        return _rms(x) * gamma[0] if gamma else _rms(x)

    assert_matches_torch(g, random_inputs(g, seed=8), yirage_backend,
                         lambda x, w, *gamma: F.silu(normed(x, *gamma) @ w),
                         scale=lambda x, w, *gamma: 1.1 * normed(x, *gamma).abs() @ w.abs())  # silu' <= 1.1


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows", [1, 64])
def test_swiglu_with_residual(yirage_backend, yirage_dtypes, dtype, rows) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    a, b, r = (g.new_input((rows, 344), dtype=dtype) for _ in range(3))
    g.mark_output(g.add(g.mul(g.silu(a), b), r))
    assert_matches_torch(g, random_inputs(g, seed=9), yirage_backend, lambda a, b, r: F.silu(a) * b + r,
                         scale=lambda a, b, r: (F.silu(a) * b).abs() + r.abs())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_with_residual_epilogue(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x, w, r = g.new_input((3, 64), dtype=dtype), g.new_input((64, 32), dtype=dtype), g.new_input((3, 32), dtype=dtype)
    g.mark_output(g.add(g.matmul(x, w), r))
    assert_matches_torch(g, random_inputs(g, seed=10), yirage_backend, lambda x, w, r: x @ w + r,
                         scale=lambda x, w, r: x.abs() @ w.abs() + r.abs())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_embedding(yirage_backend, yirage_dtypes, dtype, id_dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    ids, table = g.new_input((2, 5), dtype=id_dtype), g.new_input((50, 24), dtype=dtype)
    g.mark_output(g.embedding(ids, table))
    inputs = random_inputs(g, seed=11)  # ids drawn in [0, 50)
    assert_matches_torch(g, inputs, yirage_backend, lambda ids, table: table[ids.long()])


def test_embedding_rejects_out_of_range_ids(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    ids, table = g.new_input((4,), dtype=yr.int64), g.new_input((10, 8))
    g.mark_output(g.embedding(ids, table))
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        g(inputs=on_backend([torch.tensor([1, 2, 10, 3]), torch.randn(10, 8)], yirage_backend), backend=yirage_backend)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        g(inputs=on_backend([torch.tensor([-1, 2, 1, 3]), torch.randn(10, 8)], yirage_backend), backend=yirage_backend)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotary_scale(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos).abs() + (_rotate_half(x) * sin).abs()


@pytest.mark.parametrize("dtype", FLOATS)
def test_rotary(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((2, 4, 16), dtype=dtype)
    cos, sin = g.new_input((2, 1, 16), dtype=dtype), g.new_input((2, 1, 16), dtype=dtype)
    g.mark_output(g.rotary(x, cos, sin))
    assert_matches_torch(g, random_inputs(g, seed=12), yirage_backend, _rotary, scale=_rotary_scale)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's scaled_dot_product_attention over the first lengths[b] cache rows, GQA by repeating
    the KV heads; and the error scale: sum_s p_s * |v_s| * (1 + |q| . |k_s| / sqrt(D))."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = None
    if lengths is not None:
        mask = (torch.arange(k.shape[2])[None, :] < lengths.long()[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask)[:, :, 0]
    scores = (q[:, :, None] * k).sum(-1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, 0], -math.inf)
    p = torch.softmax(scores, -1)
    spread = torch.einsum("bhd,bhsd->bhs", q.abs(), k.abs()) / math.sqrt(q.shape[-1])
    return out, torch.einsum("bhs,bhsd->bhd", p * (1.0 + spread), v.abs())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_decode_attention(yirage_backend, yirage_dtypes, dtype, heads, kv_heads, with_lengths) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    q = g.new_input((2, heads, 16), dtype=dtype)
    k, v = (g.new_input((2, kv_heads, 12, 16), dtype=dtype) for _ in range(2))
    lengths = g.new_input((2,), dtype=yr.int32) if with_lengths else None
    g.mark_output(g.attention(q, k, v, lengths))
    inputs = random_inputs(g, seed=13)
    if with_lengths:
        inputs[3] = torch.tensor([5, 12], dtype=torch.int32)
    assert_matches_torch(g, inputs, yirage_backend, lambda *t: _attention(*t)[0], scale=lambda *t: _attention(*t)[1])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("with_gain", [False, True])
def test_decode_attention_with_qk_norm(yirage_backend, yirage_dtypes, dtype, heads, kv_heads, with_lengths,
                                       with_gain) -> None:
    """QK-norm (a per-head RMSNorm of q and k, times a gain over the head dim in Qwen3 and Gemma 3): both norms
    fuse into the attention; the rows are scaled far from 1 (and one key row is all zeros) and the gains span
    0.1-3 and 2-0.5, so a missing, doubled or misplaced factor cannot pass."""
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    q = g.new_input((2, heads, 16), dtype=dtype)
    k, v = (g.new_input((2, kv_heads, 12, 16), dtype=dtype) for _ in range(2))
    lengths = g.new_input((2,), dtype=yr.int32) if with_lengths else None
    k_gain, q_gain = (g.new_input((16,), dtype=dtype) for _ in range(2)) if with_gain else (None, None)
    keys, query = g.rms_norm(k, (16,), eps=1e-3), g.rms_norm(q, (16,), eps=1e-5)
    if with_gain:
        keys, query = g.mul(k_gain, keys), g.mul(query, q_gain)  # either operand order
    g.mark_output(g.attention(query, keys, v, lengths))
    inputs = random_inputs(g, seed=14)
    inputs[0] = inputs[0] * torch.linspace(0.1, 20.0, heads).to(inputs[0].dtype)[None, :, None]
    inputs[1] = inputs[1] * torch.linspace(0.25, 8.0, 12).to(inputs[1].dtype)[None, None, :, None]
    inputs[1][0, 0, 3] = 0  # a zero key row: its norm is 1 / sqrt(eps), its scores 0
    if with_lengths:
        inputs[3] = torch.tensor([5, 12], dtype=torch.int32)
    if with_gain:
        inputs[-2] = torch.linspace(0.1, 3.0, 16).to(inputs[-2].dtype)
        inputs[-1] = torch.linspace(2.0, 0.5, 16).to(inputs[-1].dtype)

    def normed(q_, k_, v_, *rest):  # noqa: ANN001, ANN202
        gains = rest[-2:] if with_gain else (1.0, 1.0)
        return (_rms(q_, 1e-5) * gains[1], _rms(k_, 1e-3) * gains[0], v_, *(rest[:1] if with_lengths else ()))

    assert_matches_torch(g, inputs, yirage_backend, lambda *t: _attention(*normed(*t))[0],
                         scale=lambda *t: _attention(*normed(*t))[1])


def test_attention_rejects_bad_lengths(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((1, 2, 8)), g.new_input((1, 2, 4, 8)), g.new_input((1, 2, 4, 8))
    g.mark_output(g.attention(q, k, v, g.new_input((1,), dtype=yr.int64)))
    for bad in (0, 5):
        with pytest.raises(ValueError, match=r"\[1, 4\]"):
            g(inputs=on_backend([torch.randn(1, 2, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8),
                                 torch.tensor([bad])], yirage_backend), backend=yirage_backend)


ROTARY_CONSUMERS = {  # graph builder, torch oracle, error scale (None: the element's own magnitude)
    "softmax": (lambda g, r: g.softmax(r, -1), lambda r, *w: torch.softmax(r, -1), None),
    "reduction": (lambda g, r: g.reduction(r, -1), lambda r, *w: r.sum(-1, keepdim=True),
                  lambda r, *w: r.abs().sum(-1, keepdim=True)),
    "rms_norm": (lambda g, r: g.rms_norm(r, (16,)), lambda r, *w: _rms(r), None),
    "matmul": (lambda g, r: g.matmul(r, g.new_input((16, 8))), lambda r, w: r @ w, lambda r, w: r.abs() @ w.abs()),
}


@pytest.mark.parametrize("consumer", [*ROTARY_CONSUMERS, "matmul_epilogue"])
def test_rotary_feeding_row_ops_and_matmuls(yirage_backend, consumer) -> None:
    g = yr.new_kernel_graph()
    x, cos, sin = (g.new_input((4, 16)) for _ in range(3))
    if consumer == "matmul_epilogue":  # rotary(a @ w): the matmul's output is rotated
        a, w = g.new_input((4, 16)), g.new_input((16, 16))
        g.mark_output(g.rotary(g.matmul(a, w), cos, sin))

        def expect(x, cos, sin, a, w):
            return _rotary(a @ w, cos, sin)

        def scale(x, cos, sin, a, w):
            return _rotary_scale(a.abs() @ w.abs(), cos, sin)
    else:
        build, oracle, terms = ROTARY_CONSUMERS[consumer]
        g.mark_output(build(g, g.rotary(x, cos, sin)))

        def expect(x, cos, sin, *w):
            return oracle(_rotary(x, cos, sin), *w)

        def scale(x, cos, sin, *w):
            return None if terms is None else terms(_rotary_scale(x, cos, sin), *w)
    assert_matches_torch(g, random_inputs(g, seed=15), yirage_backend, expect, scale=scale)


def test_exp_overflows_and_underflows_like_float32(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    g.mark_output(g.exp(g.new_input((8,))))
    x = torch.tensor([-float("inf"), -200.0, -50.0, 0.0, 50.0, 88.5, 100.0, float("inf")])
    (out,) = g(inputs=on_backend([x], yirage_backend), backend=yirage_backend)
    torch.testing.assert_close(out.cpu(), torch.exp(x), rtol=5e-6, atol=0.0)


def test_strided_pointwise_input(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((6, 10), strides=(1, 6))
    g.mark_output(g.exp(x))
    inputs = random_inputs(g, seed=14)
    assert not inputs[0].is_contiguous()
    assert_matches_torch(g, inputs, yirage_backend, torch.exp)


def test_input_marked_as_output_is_copied(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((3, 4))
    g.mark_output(x)
    g.mark_output(g.relu(x))
    (t,) = on_backend([torch.randn(3, 4, generator=torch.Generator().manual_seed(16))], yirage_backend)
    out, relu = g(inputs=[t], backend=yirage_backend)
    assert out.device == t.device and torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    assert torch.equal(relu.cpu(), t.cpu().relu())


def test_outputs_are_fresh_tensors_each_call(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((4,))
    g.mark_output(g.square(x))
    first = g(inputs=on_backend([torch.full((4,), 2.0)], yirage_backend), backend=yirage_backend)[0]
    second = g(inputs=on_backend([torch.full((4,), 3.0)], yirage_backend), backend=yirage_backend)[0]
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first.cpu(), torch.full((4,), 4.0)) and torch.equal(second.cpu(), torch.full((4,), 9.0))


# -- bad inputs ------------------------------------------------------------------


def _small_graph() -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    g.mark_output(g.add(g.new_input((2, 3)), g.new_input((2, 3))))
    return g


@pytest.mark.parametrize(("inputs", "message"), [  # each made on the backend's device d, defect included
    (lambda d: [torch.randn(2, 3, device=d)], "2 input"),
    (lambda d: [torch.randn(2, 3, device=d), torch.randn(3, 2, device=d)], "shape"),
    (lambda d: [torch.randn(2, 3, device=d), torch.randn(2, 3, dtype=torch.float64, device=d)], "dtype"),
    (lambda d: [torch.randn(2, 3, device=d), torch.randn(3, 2, device=d).t()], "strides"),
    (lambda d: [torch.randn(2, 3, device=d), [[0.0] * 3] * 2], "torch.Tensor"),
    (lambda d: torch.randn(2, 3, device=d), "list"),
    (lambda d: [torch.randn(2, 3, device=d), torch.randn(2, 3, device=d).to_sparse()], "layout"),
    (lambda d: [torch.randn(2, 3, device=d), torch.randn(2, 3, device=d)._neg_view()], "resolve_neg"),
    (lambda d: [torch.randn(2, 3, device=d), torch.randn(2, 3, device="meta")], "meta tensor"),
])
def test_bad_inputs_are_refused_with_the_fix(yirage_backend, inputs, message) -> None:
    from yirage.runtime.executable import InputError

    with pytest.raises(InputError, match=message):
        _small_graph()(inputs=inputs(backend_device(yirage_backend)), backend=yirage_backend)


def test_inputs_on_another_device_are_refused(yirage_backend) -> None:
    """A tensor on another device than the backend's (the CPU for a GPU backend, else meta) is refused."""
    from yirage.runtime.executable import InputError

    device = backend_device(yirage_backend)
    other = "meta" if device.type == "cpu" else "cpu"
    with pytest.raises(InputError, match=rf"\b{other}\b"):
        _small_graph()(inputs=[torch.randn(2, 3, device=device), torch.randn(2, 3, device=other)],
                       backend=yirage_backend)


# -- random graphs ----------------------------------------------------------------------


def test_random_graphs_match_the_reference(yirage_backend, yirage_dtypes, yirage_is_oracle, yirage_graph_seed) -> None:
    """Graph ``seeded_graph(seed)`` on inputs ``random_inputs(graph, seed)`` against float64, op by op.

    40 seeds (400 with ``--yirage-slow``); the seed is in the test id and the failure message.
    """
    if yirage_is_oracle:
        pytest.skip("the only oracle of a random graph is run_reference, which is what this backend runs")
    seed = yirage_graph_seed
    graph = seeded_graph(seed)
    _need(yirage_dtypes, graph.inputs[0].dtype.name)
    inputs = random_inputs(graph, seed=seed, scale=0.7)
    assert_matches_reference(graph, inputs, yirage_backend,
                             what=f"seeded_graph({seed}) on random_inputs(graph, seed={seed}, scale=0.7)")


#: each pattern of ``COVERAGE_PATTERNS`` appears in at least this many of the default run's plans
COVERAGE_MIN = 3


def test_random_graphs_cover_every_fusion_pattern(request: pytest.FixtureRequest) -> None:
    """The seeded graphs the kit runs fuse matmul prologues/epilogues, RMSNorm into matmuls, rotary,
    GQA attention, embeddings, div/pow/sqrt/softmax, and come in float16 and bfloat16 too."""
    from yirage.testing.plugin import RANDOM_GRAPHS, RANDOM_GRAPHS_SLOW

    slow = request.config.getoption("--yirage-slow", default=False)
    seen = coverage(seeded_graph(seed) for seed in range(RANDOM_GRAPHS_SLOW if slow else RANDOM_GRAPHS))
    missing = {p: seen[p] for p in COVERAGE_PATTERNS if seen[p] < COVERAGE_MIN}
    assert not missing, f"patterns seen fewer than {COVERAGE_MIN} times: {missing}; all counts: {dict(seen)}"


def test_random_graphs_round_trip_through_json() -> None:
    @given(graph=random_graph())
    @settings(deadline=None, max_examples=50, derandomize=True, database=None)
    def check(graph: yr.KernelGraph) -> None:
        again = yr.KernelGraph.from_json(graph.to_json())
        assert again == graph and again.digest == graph.digest and str(again) == str(graph)

    check()


from yirage.testing.extremes import *  # noqa: E402, F403 - the extreme-value cases run with the rest of the kit
