"""Random kernel graphs for the conformance kit, built from motifs that the fusion pass must handle.

Each graph has one dtype and grows a chain of motifs: pointwise ops (div, pow and sqrt on
positive operands), matmuls with a prologue and an epilogue, RMSNorm (times a weight) into a
matmul (the row-scale fusion), rotary, softmax / sum / RMSNorm rows, decode attention (its keys
RMS-normalized or not) and an embedding added to the chain. ``plan_features`` names the fusion
patterns a plan contains, so a test can assert that a run of generated graphs covered each of them.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from hypothesis import strategies as st

import yirage as yr
from yirage.compiler.fusion import live_nodes
from yirage.compiler.kernel_ir import Attention, Call, Embedding, Expr, Load, Matmul, Pointwise, Row, Var
from yirage.compiler.lower import build_plan

FLOATS = ("float32", "bfloat16", "float16", "float64")  # the first is what hypothesis shrinks towards
SIZES = (1, 2, 3, 4, 8, 16)
#: the starting shapes: one of each rank, few distinct shapes (each new plan is a compile on a real backend)
SHAPES = ((16,), (3, 8), (4, 16), (2, 4, 8), (1, 3, 4, 16))
T = TypeVar("T")


class Choices(Protocol):
    """Where a graph's random decisions come from: a seeded ``random.Random`` or hypothesis."""

    def pick(self, options: Sequence[T]) -> T: ...
    def coin(self) -> bool: ...
    def between(self, lo: int, hi: int) -> int: ...


class SeededChoices:
    """Decisions from ``random.Random(seed)``: the same seed builds the same graph on every machine."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def pick(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def coin(self) -> bool:
        return self.rng.random() < 0.5

    def between(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class DrawnChoices:
    """Decisions drawn by hypothesis (which then shrinks a failing graph)."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def pick(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(list(options)))

    def coin(self) -> bool:
        return self.draw(st.booleans())

    def between(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))


def _positive(g: yr.KernelGraph, t: yr.Tensor) -> yr.Tensor:
    """exp of a clamped value: in [0.135, 7.39], a safe denominator, base or sqrt operand."""
    return g.exp(g.clamp(t, -2.0, 2.0))


def _operand(c: Choices, g: yr.KernelGraph, x: yr.Tensor, tensors: Sequence[yr.Tensor]) -> yr.Tensor:
    """An existing tensor that broadcasts with ``x``, or a new input of a broadcastable shape."""
    others = [t for t in tensors if _broadcastable(t.dims, x.dims)]
    if others and c.coin():
        return c.pick(others)
    start = c.between(0, x.num_dims - 1)
    return g.new_input(tuple(d if c.coin() else 1 for d in x.dims[start:]), dtype=x.dtype)


def _broadcastable(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return all(x == y or 1 in (x, y) for x, y in zip(a[::-1], b[::-1], strict=False))


def _unary(c: Choices, g: yr.KernelGraph, x: yr.Tensor) -> yr.Tensor:
    op = c.pick(["silu", "gelu", "relu", "square", "exp", "clamp"])
    if op == "exp":
        return g.exp(g.clamp(x, -8.0, 4.0))
    if op == "clamp":
        return g.clamp(x, -1.0, 1.5) if c.coin() else g.clamp(x, min_val=0.1)
    return getattr(g, op)(x)


def _binary(c: Choices, g: yr.KernelGraph, x: yr.Tensor, tensors: Sequence[yr.Tensor]) -> yr.Tensor:
    other = _operand(c, g, x, tensors)
    op = c.pick(["add", "sub", "mul", "div"])
    if op == "div":
        return g.div(x, _positive(g, other)) if c.coin() else g.div(other, _positive(g, x))
    return getattr(g, op)(x, other) if c.coin() else getattr(g, op)(other, x)


def _positive_ops(c: Choices, g: yr.KernelGraph, x: yr.Tensor, tensors: Sequence[yr.Tensor]) -> yr.Tensor:
    """sqrt, pow and div, whose operands must stay away from zero (or be positive)."""
    other = _operand(c, g, x, tensors)
    op = c.pick(["sqrt", "pow", "div"])
    if op == "sqrt":
        return g.sqrt(_positive(g, x))
    if op == "pow":
        return g.pow(_positive(g, x), g.clamp(other, -2.0, 2.0))
    return g.div(x, _positive(g, other)) if c.coin() else g.div(other, _positive(g, x))


def _matmul(c: Choices, g: yr.KernelGraph, x: yr.Tensor, rms: bool) -> yr.Tensor | None:
    """[prologue or RMSNorm * weight] @ W [epilogue]; W may be stored transposed."""
    if x.num_dims < 2:
        return None
    k, n = x.dims[-1], c.pick(SIZES)
    if rms:
        a = g.rms_norm(x, (k,))
        if c.coin():
            a = g.mul(a, g.new_input((k,), dtype=x.dtype))
    else:
        prologue = c.pick(["none", "silu", "scale", "square"])
        a = {"none": lambda: x, "silu": lambda: g.silu(x), "square": lambda: g.square(x),
             "scale": lambda: g.mul(x, g.new_input((k,), dtype=x.dtype))}[prologue]()
    y = g.matmul(a, g.new_input((k, n), strides=(1, k) if c.coin() else None, dtype=x.dtype))
    epilogue = c.pick(["none", "residual", "silu", "bias"])
    if epilogue == "residual":
        y = g.add(y, g.new_input(y.dims, dtype=x.dtype))
    elif epilogue == "silu":
        y = g.silu(y)
    elif epilogue == "bias":
        y = g.add(y, g.new_input((n,), dtype=x.dtype))
    return y


def _rotary(c: Choices, g: yr.KernelGraph, x: yr.Tensor) -> yr.Tensor | None:
    if x.dims[-1] % 2:
        return None
    table = tuple(d if c.coin() else 1 for d in x.dims[:-1]) + (x.dims[-1],)
    return g.rotary(x, g.new_input(table, dtype=x.dtype), g.new_input(table, dtype=x.dtype))


def _row(c: Choices, g: yr.KernelGraph, x: yr.Tensor) -> yr.Tensor:
    op = c.pick(["softmax", "reduction", "rms_norm"])
    if op == "rms_norm":
        return g.rms_norm(x, (x.dims[-1],))
    return getattr(g, op)(x, c.between(-x.num_dims, x.num_dims - 1))


def _attention(c: Choices, g: yr.KernelGraph, x: yr.Tensor) -> yr.Tensor | None:
    """Decode attention with ``x`` as the query (B, H, D), or broadcast to one; GQA where H allows it."""
    if x.num_dims > 3:
        return None
    if x.num_dims < 3:
        x = g.add(x, g.new_input((2, 4)[:3 - x.num_dims] + x.dims, dtype=x.dtype))
    b, h, d = x.dims
    kv_heads = c.pick([k for k in (1, 2, h) if h % k == 0])
    seq = c.pick([1, 5, 8])
    k, v = (g.new_input((b, kv_heads, seq, d), dtype=x.dtype) for _ in range(2))
    lengths = g.new_input((b,), dtype=c.pick(["int32", "int64"])) if c.coin() else None
    if c.coin():  # QK-norm: the RMSNorms (times a gain, as Qwen3's) fuse into the attention
        k = g.rms_norm(k, (d,))
        if c.coin():
            k = g.mul(k, g.new_input((d,), dtype=x.dtype))
        if c.coin():
            x = g.rms_norm(x, (d,))
    return g.attention(x, k, v, lengths)


def _embedding(c: Choices, g: yr.KernelGraph, x: yr.Tensor) -> yr.Tensor:
    """x + table[ids], the ids shaped like x's rows."""
    ids = g.new_input(x.dims[:-1] or (1,), dtype=c.pick(["int32", "int64"]))
    table = g.new_input((c.pick([5, 16]), x.dims[-1]), dtype=x.dtype)
    return g.add(x, g.embedding(ids, table))


def _motif(motif: str, c: Choices, g: yr.KernelGraph, x: yr.Tensor, tensors: Sequence[yr.Tensor]) -> yr.Tensor | None:
    """Apply ``motif`` to ``x``; None where it does not fit x's shape."""
    if motif == "unary":
        return _unary(c, g, x)
    if motif == "binary":
        return _binary(c, g, x, tensors)
    if motif == "positive":
        return _positive_ops(c, g, x, tensors)
    if motif in ("matmul", "rms_matmul"):
        return _matmul(c, g, x, rms=motif == "rms_matmul")
    builders: dict[str, Callable[[Choices, yr.KernelGraph, yr.Tensor], yr.Tensor | None]] = {
        "rotary": _rotary, "row": _row, "attention": _attention, "embedding": _embedding}
    return builders[motif](c, g, x)


MOTIFS = ["unary", "binary", "positive", "matmul", "rms_matmul", "rotary", "row", "attention", "embedding"]


def build_graph(c: Choices, dtypes: Sequence[str] = FLOATS) -> yr.KernelGraph:
    """A graph of 2-5 motifs over one float dtype picked from ``dtypes``, decided by ``c``."""
    dtype = c.pick([d for d in FLOATS if d in dtypes])
    g = yr.new_kernel_graph()
    tensors = [g.new_input(c.pick(SHAPES), dtype=dtype)]
    for _ in range(c.between(2, 5)):
        x = tensors[-1] if c.between(0, 3) else c.pick(tensors)
        motif = c.pick(MOTIFS)
        y = _motif(motif, c, g, x, tensors)
        if y is not None:
            tensors.append(y)
    g.mark_output(tensors[-1])
    if len(tensors) > 2 and c.coin():
        extra = c.pick(tensors[1:-1])
        if extra.node.op != "input":
            g.mark_output(extra)
    return g


def seeded_graph(seed: int, dtypes: Sequence[str] = FLOATS) -> yr.KernelGraph:
    """The random graph of ``seed``: reproduce a failing case with ``seeded_graph(seed)``."""
    return build_graph(SeededChoices(seed), dtypes)


@st.composite
def random_graph(draw: st.DrawFn, dtypes: Sequence[str] = FLOATS) -> yr.KernelGraph:
    """The same graphs as a hypothesis strategy."""
    return build_graph(DrawnChoices(draw), dtypes)


# -- coverage ---------------------------------------------------------------------------------

_PLAIN_EPILOGUES = (Var("acc"), Call("mul", (Var("acc"), Var("scale"))))


def _rotates(expr: Expr) -> bool:
    if isinstance(expr, Load):
        return expr.rotate_half
    return isinstance(expr, Call) and any(_rotates(a) for a in expr.args)


def plan_features(graph: yr.KernelGraph) -> Counter[str]:
    """Fusion patterns in ``graph``'s plan, and the ops and dtypes it computes (dead nodes excluded)."""
    seen: Counter[str] = Counter()
    for k in build_plan(graph).kernels:
        if isinstance(k, Matmul):
            seen["matmul"] += 1
            seen["matmul prologue"] += not isinstance(k.a, Load)
            seen["matmul epilogue"] += k.epilogue not in _PLAIN_EPILOGUES
            seen["rms_norm -> matmul row scale"] += k.row_scale is not None
        elif isinstance(k, Row):
            seen["row prologue"] += any(not isinstance(r.expr, Load) for r in k.reductions[:1])
        elif isinstance(k, Pointwise):
            seen["pointwise"] += 1
            seen["rotary"] += _rotates(k.expr)
        elif isinstance(k, Attention):
            seen["attention"] += 1
            seen["attention gqa"] += k.heads != k.kv_heads
            seen["rms_norm -> attention keys"] += k.k_eps is not None
            seen["rms_norm * gain -> attention keys"] += k.k_gain is not None
            seen["rms_norm -> attention query"] += k.q_eps is not None
        elif isinstance(k, Embedding):
            seen["embedding"] += 1
    live = live_nodes(graph)
    for node in graph.nodes:
        if node.id in live and node.op in ("div", "pow", "sqrt", "softmax"):
            seen[node.op] += 1
    seen[str(graph.inputs[0].dtype)] += 1
    return +seen


def coverage(graphs: Iterable[yr.KernelGraph]) -> Counter[str]:
    """``plan_features`` summed over ``graphs``."""
    total: Counter[str] = Counter()
    for g in graphs:
        total += plan_features(g)
    return total


#: what a run of the kit's random graphs must have exercised, each at least ``COVERAGE_MIN`` times
COVERAGE_PATTERNS = ("matmul prologue", "matmul epilogue", "rms_norm -> matmul row scale", "rotary", "attention",
                     "attention gqa", "rms_norm -> attention keys", "rms_norm * gain -> attention keys",
                     "rms_norm -> attention query", "embedding", "div", "pow", "sqrt", "softmax", "float16",
                     "bfloat16")
