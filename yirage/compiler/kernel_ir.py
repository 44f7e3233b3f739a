"""The kernel IR: fused kernels as a renderer sees them, backend-neutral.

A kernel says what each parallel iteration owns (an element, a row, an
output element of a matmul, a (batch, head) of attention), the reduction it
loops over, and expressions for its prologue and epilogue. Expressions are a
tiny tree (Load, Const, Var, Call) that the numba renderer and the C-family
renderers spell in their own dialects. ``print(plan)`` shows it all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yirage.graph.dtypes import DType

Dims = tuple[int, ...]

# -- expressions ---------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """Read ``buffer`` at the current index, broadcast to the iteration space.

    ``rotate_half`` reads the element half a row away along the last dim,
    negated in the first half: RoPE's ``rotate_half(x)``.
    """

    buffer: str
    rotate_half: bool = False

    def __str__(self) -> str:
        return f"rotate_half({self.buffer})" if self.rotate_half else self.buffer


@dataclass(frozen=True)
class Const:
    value: float

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Var:
    """A value the kernel template defines: ``acc``, ``scale`` or a row reduction."""

    name: str

    def __str__(self) -> str:
        return f"${self.name}"


@dataclass(frozen=True)
class Call:
    fn: str  # one of FUNCTIONS, or before ``decompose_plan`` a composite of yirage.compiler.decompose
    args: tuple[Expr, ...]

    def __str__(self) -> str:
        return f"{self.fn}({', '.join(str(a) for a in self.args)})"


Expr = Load | Const | Var | Call

#: fn -> arity: the primitives, all a renderer spells. Composites (rsqrt, sigmoid, ...) are defined in
#: primitives in yirage.compiler.decompose and rewritten after lowering; silu, gelu, relu and square are
#: composites still spelled whole, each for the reason in decompose.KEPT.
FUNCTIONS = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "pow": 2, "max": 2, "min": 2,
    "exp": 1, "sqrt": 1, "neg": 1, "silu": 1, "gelu": 1, "relu": 1, "square": 1,
}


def loads(expr: Expr) -> list[str]:
    """Buffers an expression reads, in first-use order."""
    if isinstance(expr, Load):
        return [expr.buffer]
    if isinstance(expr, Call):
        seen: list[str] = []
        for arg in expr.args:
            seen += [b for b in loads(arg) if b not in seen]
        return seen
    return []


def uses_var(expr: Expr, name: str) -> bool:
    if isinstance(expr, Var):
        return expr.name == name
    if isinstance(expr, Call):
        return any(uses_var(a, name) for a in expr.args)
    return False


# -- buffers and kernels -------------------------------------------------------


@dataclass(frozen=True)
class Buffer:
    """A tensor in memory: a graph input, a graph output or a temporary.

    ``strides`` are in elements; only inputs may be non-contiguous (dense
    permutations, e.g. a weight stored transposed).
    """

    name: str
    dims: Dims
    dtype: DType
    strides: Dims
    role: str  # "input", "output", "temp"
    index: int = -1  # position among the graph's inputs or outputs

    def __str__(self) -> str:
        layout = f" strides={self.strides}" if self.role == "input" else ""
        return f"{self.name}: {self.role} {self.dims} {self.dtype}{layout}"


@dataclass(frozen=True)
class Pointwise:
    """out[i] = expr, one iteration per element of ``space`` (= out dims)."""

    name: str
    out: str
    space: Dims
    expr: Expr

    def reads(self) -> list[str]:
        return loads(self.expr)

    def lines(self) -> list[str]:
        return [f"grid: one element of {self.space} each", f"{self.out}[i] = {self.expr}"]


@dataclass(frozen=True)
class Reduction:
    var: str
    combine: str  # "sum" or "max"
    expr: Expr


@dataclass(frozen=True)
class Row:
    """Row-wise kernel: reductions along ``axis`` of ``space``, then the output.

    Reductions run in order (a later one may use an earlier one's Var). With
    ``per_row`` the output has size 1 along ``axis`` (``reduction``);
    otherwise one value per element (``rms_norm``, ``softmax``).
    """

    name: str
    out: str
    space: Dims
    axis: int
    reductions: tuple[Reduction, ...]
    out_expr: Expr
    per_row: bool

    def reads(self) -> list[str]:
        seen: list[str] = []
        for e in [r.expr for r in self.reductions] + [self.out_expr]:
            seen += [b for b in loads(e) if b not in seen]
        return seen

    def lines(self) -> list[str]:
        rows = [d for i, d in enumerate(self.space) if i != self.axis]
        out = [f"grid: one row of {self.space} along axis {self.axis} each ({rows} rows)"]
        out += [f"${r.var} = {r.combine} over the row of {r.expr}" for r in self.reductions]
        where = "[row]" if self.per_row else "[i]"
        return out + [f"{self.out}{where} = {self.out_expr}"]


@dataclass(frozen=True)
class Matmul:
    """out[b, m, n] = epilogue(acc = sum_k a[b, m, k] * B[b, k, n], scale).

    ``a`` is the prologue expression over ``batch + (M, K)``; ``b`` a buffer
    of dims ``b_dims`` (broadcast over batch). With ``row_scale`` (an
    RMSNorm fused in front), ``$scale = rsqrt(sum_k x^2 / K + eps)`` per row,
    applied in the epilogue: Mirage's "divide after the matmul".
    """

    name: str
    out: str
    batch: Dims
    m: int
    n: int
    k: int
    a: Expr
    b: str
    epilogue: Expr
    row_scale: Expr | None = None
    eps: float = 0.0

    @property
    def space(self) -> Dims:
        return self.batch + (self.m, self.n)

    @property
    def a_space(self) -> Dims:
        return self.batch + (self.m, self.k)

    def reads(self) -> list[str]:
        seen = loads(self.a) + [self.b]
        for e in (self.row_scale, self.epilogue):
            if e is not None:
                seen += [x for x in loads(e) if x not in seen]
        return seen

    def lines(self) -> list[str]:
        out = [f"grid: one output element of {self.space} each, reduction loop over K={self.k}"]
        out.append(f"a[b, m, k] = {self.a}   over {self.a_space}")
        if self.row_scale is not None:
            out.append(f"$scale[b, m] = rsqrt(sum_k square({self.row_scale}) / {self.k} + {self.eps})")
        out.append(f"$acc = sum_k a[b, m, k] * {self.b}[b, k, n]")
        out.append(f"{self.out}[b, m, n] = {self.epilogue}")
        return out


@dataclass(frozen=True)
class Embedding:
    name: str
    out: str
    ids: str
    table: str
    tokens: int
    vocab: int
    dim: int

    def reads(self) -> list[str]:
        return [self.ids, self.table]

    def lines(self) -> list[str]:
        return [f"grid: one of {self.tokens} tokens each",
                f"{self.out}[t, :] = {self.table}[{self.ids}[t], :]  (ids checked in [0, {self.vocab}))"]


@dataclass(frozen=True)
class Attention:
    """Decode attention: one query per (batch, head) over its KV-cache rows. ``k_eps``: the key rows are
    RMS-normalized first (an ``rms_norm`` fused in: QK-norm), each row ``k * (1 / sqrt(sum(k * k) / head_dim +
    k_eps))`` as the row kernel computes it, then times ``k_gain[d]`` where a gain over the head dim follows the
    norm (Qwen3's, Gemma 3's), in the compute type, inside the pass that reads K once (an unfused plan writes the
    normalized keys out and reads them back: three passes over K). ``q_eps`` / ``q_gain``: the same for the query
    rows (one kernel launch fewer)."""

    name: str
    out: str
    q: str
    k: str
    v: str
    lengths: str | None
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    scale: float
    k_eps: float | None = None
    k_gain: str | None = None  # a buffer of head_dim values (its other dims 1), only with k_eps
    q_eps: float | None = None
    q_gain: str | None = None  # as k_gain, only with q_eps

    def reads(self) -> list[str]:
        return [self.q, self.k, self.v] + [b for b in (self.lengths, self.k_gain, self.q_gain) if b]

    def gains(self) -> list[str]:
        """The gain buffers the kernel reads after q, k, v and the lengths (the renderers' argument order)."""
        return [b for b in (self.k_gain, self.q_gain) if b]

    def lines(self) -> list[str]:
        span = f"s < {self.lengths}[b]" if self.lengths else f"s < {self.seq}"
        key = f"{self.k}[b, kvh, s]"
        query = f"{self.q}[b, h]"
        norms = []
        for name, row, eps, gain in (("qn", query, self.q_eps, self.q_gain), ("kn[s]", key, self.k_eps, self.k_gain)):
            if eps is not None:
                times = f" * {gain}[:]" if gain else ""
                norms.append(f"{name} = {row} * (1 / sqrt(sum({row}^2) / {self.head_dim} + {eps:.6g})){times}  "
                             "(rms_norm fused)")
        q_row = "qn" if self.q_eps is not None else query
        k_row = "kn[s]" if self.k_eps is not None else key
        return [
            f"grid: one (batch, head) of ({self.batch}, {self.heads}) each; "
            f"kv head = h // {self.heads // self.kv_heads}",
            *norms,
            f"p[s] = softmax_s({self.scale:.6g} * dot({q_row}, {k_row}))  for {span}",
            f"{self.out}[b, h, :] = sum_s p[s] * {self.v}[b, kvh, s, :]",
        ]


Kernel = Pointwise | Row | Matmul | Embedding | Attention


@dataclass
class KernelPlan:
    """The compiled form of a graph: buffers and kernels in execution order."""

    digest: str
    buffers: dict[str, Buffer]
    kernels: list[Kernel]
    inputs: list[str]
    outputs: list[str]
    #: kernel -> knob -> value: the schedule choices a backend declared and a search picked
    #: (``yirage.compiler.schedule``); empty: every renderer picks by itself
    schedule: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"KernelPlan {self.digest[:12]}: {len(self.kernels)} kernel(s)"]
        if self.schedule:
            from yirage.compiler.schedule import describe

            lines.append(f"  schedule {describe(self.schedule)}")
        lines += [f"  buffer {b}" for b in self.buffers.values()]
        for k in self.kernels:
            lines.append(f"  kernel {k.name} ({type(k).__name__.lower()}) -> {k.out}")
            lines += [f"    {line}" for line in k.lines()]
        return "\n".join(lines)
