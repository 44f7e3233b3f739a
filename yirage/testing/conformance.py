"""Backend conformance cases: every op, broadcasting, layouts, fused patterns,
bad inputs and hypothesis-generated random graphs, each compared with the
float64 torch reference, plus the extreme-value cases of ``extremes`` (NaN,
infinities, overflow, denormals; compared with torch at the same dtype).
Run them on any backend with
``pytest --pyargs yirage.testing.conformance --yirage-backend NAME``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import yirage as yr
from yirage.testing.oracle import UNARY, assert_matches_reference, random_inputs
from yirage.testing.plugin import random_graph_examples

FLOATS = ["float32", "float16", "bfloat16", "float64"]


def _need(dtypes: frozenset[str], dtype: str) -> None:
    if dtype not in dtypes:
        pytest.skip(f"the backend does not claim {dtype}")




@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(yirage_backend, yirage_dtypes, op, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((3, 70), dtype=dtype)
    g.mark_output(UNARY[op](g, x))
    assert_matches_reference(g, random_inputs(g, seed=1), yirage_backend)


@pytest.mark.parametrize("dtype", FLOATS)
def test_sqrt_of_positive_values(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((5, 33), dtype=dtype)
    g.mark_output(g.sqrt(x))
    assert_matches_reference(g, [random_inputs(g, 2)[0].abs() + 0.1], yirage_backend)


BINARY = ["add", "sub", "mul", "div", "pow"]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", BINARY)
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
    assert_matches_reference(g, [xa, xb], yirage_backend)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_arithmetic(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    a, b = g.new_input((6, 5), dtype=dtype), g.new_input((5,), dtype=dtype)
    out = g.clamp(g.relu(g.sub(g.mul(a, b), g.square(b))), 0, 20)
    g.mark_output(out)
    g.mark_output(g.reduction(g.add(a, b), 0))
    assert_matches_reference(g, random_inputs(g, seed=4), yirage_backend)


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
    assert_matches_reference(g, random_inputs(g, seed=5), yirage_backend)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("dims", "dim"), [((4, 50), -1), ((4, 50), 0), ((3, 5, 7), 1), ((1, 300), 1)])
def test_reduction_and_softmax(yirage_backend, yirage_dtypes, dtype, dims, dim) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input(dims, dtype=dtype)
    g.mark_output(g.reduction(x, dim))
    g.mark_output(g.softmax(x, dim))
    assert_matches_reference(g, random_inputs(g, seed=6), yirage_backend)


@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((6, 96), dtype=dtype)
    g.mark_output(g.rms_norm(x, (96,), eps=1e-5))
    assert_matches_reference(g, random_inputs(g, seed=7), yirage_backend)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_weight", [False, True])
def test_rms_norm_then_matmul(yirage_backend, yirage_dtypes, dtype, with_weight) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((8, 128), dtype=dtype)
    w = g.new_input((128, 40), strides=(1, 128), dtype=dtype)
    d = g.rms_norm(x, (128,))
    if with_weight:
        d = g.mul(d, g.new_input((128,), dtype=dtype))
    g.mark_output(g.silu(g.matmul(d, w)))
    assert_matches_reference(g, random_inputs(g, seed=8), yirage_backend)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows", [1, 64])
def test_swiglu_with_residual(yirage_backend, yirage_dtypes, dtype, rows) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    a, b, r = (g.new_input((rows, 344), dtype=dtype) for _ in range(3))
    g.mark_output(g.add(g.mul(g.silu(a), b), r))
    assert_matches_reference(g, random_inputs(g, seed=9), yirage_backend)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_with_residual_epilogue(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x, w, r = g.new_input((3, 64), dtype=dtype), g.new_input((64, 32), dtype=dtype), g.new_input((3, 32), dtype=dtype)
    g.mark_output(g.add(g.matmul(x, w), r))
    assert_matches_reference(g, random_inputs(g, seed=10), yirage_backend)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_embedding(yirage_backend, yirage_dtypes, dtype, id_dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    ids, table = g.new_input((2, 5), dtype=id_dtype), g.new_input((50, 24), dtype=dtype)
    g.mark_output(g.embedding(ids, table))
    inputs = random_inputs(g, seed=11)
    inputs[0] = torch.randint(0, 50, (2, 5), dtype=getattr(torch, id_dtype))
    assert_matches_reference(g, inputs, yirage_backend)


def test_embedding_rejects_out_of_range_ids(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    ids, table = g.new_input((4,), dtype=yr.int64), g.new_input((10, 8))
    g.mark_output(g.embedding(ids, table))
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        g(inputs=[torch.tensor([1, 2, 10, 3]), torch.randn(10, 8)], backend=yirage_backend)
    with pytest.raises(IndexError):
        g(inputs=[torch.tensor([-1, 2, 1, 3]), torch.randn(10, 8)], backend=yirage_backend)


@pytest.mark.parametrize("dtype", FLOATS)
def test_rotary(yirage_backend, yirage_dtypes, dtype) -> None:
    _need(yirage_dtypes, dtype)
    g = yr.new_kernel_graph()
    x = g.new_input((2, 4, 16), dtype=dtype)
    cos, sin = g.new_input((2, 1, 16), dtype=dtype), g.new_input((2, 1, 16), dtype=dtype)
    g.mark_output(g.rotary(x, cos, sin))
    assert_matches_reference(g, random_inputs(g, seed=12), yirage_backend)


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
    assert_matches_reference(g, inputs, yirage_backend)


def test_attention_rejects_bad_lengths(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((1, 2, 8)), g.new_input((1, 2, 4, 8)), g.new_input((1, 2, 4, 8))
    g.mark_output(g.attention(q, k, v, g.new_input((1,), dtype=yr.int64)))
    for bad in (0, 5):
        with pytest.raises(ValueError, match=r"\[1, 4\]"):
            g(inputs=[torch.randn(1, 2, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.tensor([bad])],
              backend=yirage_backend)


@pytest.mark.parametrize("consumer", ["softmax", "reduction", "rms_norm", "matmul", "matmul_epilogue"])
def test_rotary_feeding_row_ops_and_matmuls(yirage_backend, consumer) -> None:
    g = yr.new_kernel_graph()
    x, cos, sin = (g.new_input((4, 16)) for _ in range(3))
    r = g.rotary(x, cos, sin)
    if consumer == "softmax":
        out = g.softmax(r, -1)
    elif consumer == "reduction":
        out = g.reduction(r, -1)
    elif consumer == "rms_norm":
        out = g.rms_norm(r, (16,))
    elif consumer == "matmul":
        out = g.matmul(r, g.new_input((16, 8)))
    else:
        y = g.matmul(g.new_input((4, 16)), g.new_input((16, 16)))
        out = g.rotary(y, cos, sin)
    g.mark_output(out)
    assert_matches_reference(g, random_inputs(g, seed=15), yirage_backend)


def test_exp_overflows_and_underflows_like_float32(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    g.mark_output(g.exp(g.new_input((8,))))
    x = torch.tensor([-float("inf"), -200.0, -50.0, 0.0, 50.0, 88.5, 100.0, float("inf")])
    (out,) = g(inputs=[x], backend=yirage_backend)
    torch.testing.assert_close(out, torch.exp(x), rtol=5e-6, atol=0.0)


def test_strided_pointwise_input(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((6, 10), strides=(1, 6))
    g.mark_output(g.exp(x))
    assert_matches_reference(g, random_inputs(g, seed=14), yirage_backend)


def test_input_marked_as_output_is_copied(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((3, 4))
    g.mark_output(x)
    g.mark_output(g.relu(x))
    t = torch.randn(3, 4)
    out, relu = g(inputs=[t], backend=yirage_backend)
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    assert torch.equal(relu, t.relu())


def test_outputs_are_fresh_tensors_each_call(yirage_backend) -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((4,))
    g.mark_output(g.square(x))
    first = g(inputs=[torch.full((4,), 2.0)], backend=yirage_backend)[0]
    second = g(inputs=[torch.full((4,), 3.0)], backend=yirage_backend)[0]
    assert torch.equal(first, torch.full((4,), 4.0)) and torch.equal(second, torch.full((4,), 9.0))


# -- bad inputs ------------------------------------------------------------------


def _small_graph() -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    g.mark_output(g.add(g.new_input((2, 3)), g.new_input((2, 3))))
    return g


@pytest.mark.parametrize(("inputs", "message"), [
    (lambda: [torch.randn(2, 3)], "2 input"),
    (lambda: [torch.randn(2, 3), torch.randn(3, 2)], "shape"),
    (lambda: [torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)], "dtype"),
    (lambda: [torch.randn(2, 3), torch.randn(3, 2).t()], "strides"),
    (lambda: [torch.randn(2, 3), [[0.0] * 3] * 2], "torch.Tensor"),
    (lambda: torch.randn(2, 3), "list"),
    (lambda: [torch.randn(2, 3), torch.randn(2, 3).to_sparse()], "layout"),
    (lambda: [torch.randn(2, 3), torch.randn(2, 3)._neg_view()], "resolve_neg"),
    (lambda: [torch.randn(2, 3), torch.randn(2, 3, device="meta")], "meta tensor"),
])
def test_bad_inputs_are_refused_with_the_fix(yirage_backend, inputs, message) -> None:
    from yirage.runtime.executable import InputError

    with pytest.raises(InputError, match=message):
        _small_graph()(inputs=inputs(), backend=yirage_backend)


# -- random graphs ----------------------------------------------------------------------

SIZES = st.sampled_from([1, 2, 3, 5, 8, 17])


@st.composite
def random_graph(draw: st.DrawFn) -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    dims = tuple(draw(st.lists(SIZES, min_size=1, max_size=3)))
    tensors = [g.new_input(dims)]
    for _ in range(draw(st.integers(2, 7))):
        x = draw(st.sampled_from(tensors))
        choice = draw(st.sampled_from(
            ["unary", "unary", "binary", "binary", "matmul", "reduction", "softmax", "rms_norm", "clamp", "rotary"]
        ))
        if choice == "unary":
            y = getattr(g, draw(st.sampled_from(["silu", "gelu", "relu", "square", "exp"])))(x)
            if y.node.op == "exp":
                y = g.clamp(y, max_val=50.0)
        elif choice == "binary":
            others = [t for t in tensors if _broadcastable(t.dims, x.dims)]
            if draw(st.booleans()) or not others:
                shape = tuple(d if draw(st.booleans()) else 1 for d in x.dims[draw(st.integers(0, x.num_dims - 1)):])
                other = g.new_input(shape)
            else:
                other = draw(st.sampled_from(others))
            op = draw(st.sampled_from(["add", "sub", "mul"]))
            y = getattr(g, op)(x, other) if draw(st.booleans()) else getattr(g, op)(other, x)
        elif choice == "matmul":
            n = draw(SIZES)
            k = x.dims[-1]
            if x.num_dims < 2:
                continue
            strides = (1, k) if draw(st.booleans()) else None
            y = g.matmul(x, g.new_input((k, n), strides=strides))
        elif choice == "clamp":
            y = g.clamp(x, -1.0, 1.5)
        elif choice == "rotary":
            if x.dims[-1] % 2:
                continue
            table = tuple(d if draw(st.booleans()) else 1 for d in x.dims[:-1]) + (x.dims[-1],)
            y = g.rotary(x, g.new_input(table), g.new_input(table))
        elif choice == "rms_norm":
            y = g.rms_norm(x, (x.dims[-1],))
        else:
            y = getattr(g, choice)(x, draw(st.integers(-x.num_dims, x.num_dims - 1)))
        tensors.append(y)
    g.mark_output(tensors[-1])
    extra = draw(st.sampled_from(tensors[1:-1])) if len(tensors) > 2 and draw(st.booleans()) else None
    if extra is not None and extra.node.op != "input":
        g.mark_output(extra)
    return g


def _broadcastable(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return all(x == y or 1 in (x, y) for x, y in zip(a[::-1], b[::-1], strict=False))


@given(graph=random_graph(), seed=st.integers(0, 2**16))
@settings(deadline=None, max_examples=random_graph_examples(),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_random_graphs_match_the_reference(yirage_backend, graph, seed) -> None:
    assert_matches_reference(graph, random_inputs(graph, seed=seed, scale=0.7), yirage_backend)


def test_random_graphs_round_trip_through_json() -> None:
    @given(graph=random_graph())
    @settings(deadline=None, max_examples=50)
    def check(graph: yr.KernelGraph) -> None:
        again = yr.KernelGraph.from_json(graph.to_json())
        assert again == graph and again.digest == graph.digest and str(again) == str(graph)

    check()


from yirage.testing.extremes import *  # noqa: E402, F403 - the extreme-value cases run with the rest of the kit
