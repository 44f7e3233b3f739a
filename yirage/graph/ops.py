"""The op table: for each kernel-graph op, how it checks its operands, what it
produces, and its torch definition (the reference semantics every backend
must reproduce).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from yirage.errors import YirageError
from yirage.graph.dtypes import DType, as_dtype


class GraphError(YirageError, ValueError):
    """An op applied to operands it cannot take; the message names both."""


Dims = tuple[int, ...]


@dataclass(frozen=True)
class Operand:
    """What validation sees of a tensor: its name, dims and dtype."""

    name: str
    dims: Dims
    dtype: DType

    def __str__(self) -> str:
        return f"{self.name} {self.dims} {self.dtype}"


@dataclass(frozen=True)
class OpSpec:
    name: str
    kind: str  # "pointwise", "matmul", "row", "embedding", "attention"
    arity: int  # fixed operand count; optional trailing operands are None
    infer: Callable[[list[Operand], dict[str, Any]], tuple[Dims, DType]]
    reference: Callable[..., Any]


def _fail(op: str, operands: Sequence[Operand], problem: str) -> GraphError:
    given = ", ".join(str(o) for o in operands)
    return GraphError(f"{op}({given}): {problem}")


def broadcast(op: str, a: Operand, b: Operand) -> Dims:
    """torch broadcasting: right-aligned dims must match or be 1."""
    rank = max(len(a.dims), len(b.dims))
    da = (1,) * (rank - len(a.dims)) + a.dims
    db = (1,) * (rank - len(b.dims)) + b.dims
    out = []
    for x, y in zip(da, db, strict=True):
        if x != y and 1 not in (x, y):
            raise _fail(op, [a, b], f"dims {a.dims} and {b.dims} do not broadcast (each pair must match or be 1)")
        out.append(max(x, y))
    return tuple(out)


def _need_float(op: str, operands: Sequence[Operand]) -> None:
    for o in operands:
        if not o.dtype.is_float:
            raise _fail(op, operands, f"needs floating-point tensors, but {o.name} is {o.dtype}; cast it first")


def _same_dtype(op: str, operands: Sequence[Operand]) -> DType:
    dtypes = {o.dtype for o in operands}
    if len(dtypes) != 1:
        raise _fail(op, operands, "operands must share one dtype (yirage does not promote types implicitly)")
    return operands[0].dtype


def _axis(op: str, operands: Sequence[Operand], dim: int) -> int:
    rank = len(operands[0].dims)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
        raise _fail(op, operands, f"dim={dim!r} is out of range for a tensor of rank {rank}")
    return dim % rank


def as_number(op: str, name: str, value: Any) -> float | None:
    """A float attribute as given by the user (None passes); strings and bools are refused, not parsed."""
    if value is None:
        return None
    if isinstance(value, (bool, str, bytes)):
        raise GraphError(f"{op}: {name} must be a number, got {value!r}; pass a float such as 1.0")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):  # RuntimeError: a many-element tensor
        raise GraphError(f"{op}: {name} must be a number, got {type(value).__name__} {value!r}") from None


def _real_attr(op: str, xs: Sequence[Operand], name: str, value: Any, *, finite: bool) -> float | None:
    """Attributes reach the shape rules from the builder methods or from JSON: check their type here."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(op, xs, f"{name}={value!r} must be a number (got {type(value).__name__})")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise _fail(op, xs, f"{name}={value} must be a finite number")
    return float(value)


# -- shape rules -------------------------------------------------------------

def infer_unary_float(op: str) -> Callable[[list[Operand], dict[str, Any]], tuple[Dims, DType]]:
    def infer(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
        _need_float(op, xs)
        return xs[0].dims, xs[0].dtype

    return infer


def infer_unary_any(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    return xs[0].dims, xs[0].dtype


_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def infer_clamp(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    lo, hi = attrs["min_val"], attrs["max_val"]
    if lo is None and hi is None:
        raise _fail("clamp", xs, "give min_val, max_val or both")
    for name, v in (("min_val", lo), ("max_val", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v)):
            raise _fail("clamp", xs, f"bounds must be numbers, got {name}={v!r}; pass floats (inf is allowed)")
    limits = _INT_RANGE.get(xs[0].dtype.name)
    if limits and any(v is not None and not limits[0] <= v <= limits[1] for v in (lo, hi)):
        raise _fail("clamp", xs, f"bounds must fit {xs[0].dtype}, got min_val={lo}, max_val={hi}")
    if lo is not None and hi is not None and lo > hi:
        raise _fail("clamp", xs, f"min_val {lo} is greater than max_val {hi}")
    if not xs[0].dtype.is_float and any(v is not None and v != int(v) for v in (lo, hi)):
        raise _fail("clamp", xs, f"bounds of an integer tensor must be integers, got min_val={lo}, max_val={hi}")
    return xs[0].dims, xs[0].dtype


def infer_binary(op: str, float_only: bool = False) -> Callable[[list[Operand], dict[str, Any]], tuple[Dims, DType]]:
    def infer(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
        dtype = _same_dtype(op, xs)
        if float_only:
            _need_float(op, xs)
        return broadcast(op, xs[0], xs[1]), dtype

    return infer


def infer_matmul(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    a, b = xs
    dtype = _same_dtype("matmul", xs)
    _need_float("matmul", xs)
    if len(a.dims) < 2 or len(b.dims) < 2:
        raise _fail("matmul", xs, "both operands need at least 2 dims (..., M, K) @ (..., K, N)")
    if a.dims[-1] != b.dims[-2]:
        raise _fail("matmul", xs, f"inner dims differ: {a.name} has K={a.dims[-1]}, {b.name} has K={b.dims[-2]}")
    batch = broadcast("matmul", Operand(a.name, a.dims[:-2], dtype), Operand(b.name, b.dims[:-2], dtype))
    return batch + (a.dims[-2], b.dims[-1]), dtype


def infer_reduction(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    axis = _axis("reduction", xs, attrs["dim"])
    dims = list(xs[0].dims)
    dims[axis] = 1
    return tuple(dims), xs[0].dtype


def infer_softmax(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    _need_float("softmax", xs)
    _axis("softmax", xs, attrs["dim"])
    return xs[0].dims, xs[0].dtype


def infer_rms_norm(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    _need_float("rms_norm", xs)
    shape = check_dims(attrs["normalized_shape"], "rms_norm normalized_shape")
    if shape != xs[0].dims[-1:]:
        raise _fail(
            "rms_norm", xs,
            f"normalized_shape={shape} must be the last dim, ({xs[0].dims[-1]},); yirage normalizes over one dim",
        )
    eps = _real_attr("rms_norm", xs, "eps", attrs["eps"], finite=True)
    if eps is None or not eps >= 0:
        raise _fail("rms_norm", xs, f"eps={attrs['eps']} must be >= 0 (and finite); the usual value is 1e-6")
    return xs[0].dims, xs[0].dtype


def infer_embedding(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    ids, table = xs
    if ids.dtype.is_float:
        raise _fail("embedding", xs, f"ids must be int32 or int64, not {ids.dtype}")
    if len(table.dims) != 2:
        raise _fail("embedding", xs, f"table must be 2-D (vocab, dim), got dims {table.dims}")
    _need_float("embedding", [table])
    return ids.dims + (table.dims[1],), table.dtype


def infer_rotary(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    x, cos, sin = xs
    _need_float("rotary", xs)
    _same_dtype("rotary", xs)
    if x.dims[-1] % 2:
        raise _fail("rotary", xs, f"the last dim of {x.name} must be even (pairs of halves), got {x.dims[-1]}")
    for table in (cos, sin):
        if table.dims[-1:] != x.dims[-1:]:
            raise _fail("rotary", xs, f"{table.name} must end in the head dim {x.dims[-1]}, got dims {table.dims}")
        if broadcast("rotary", x, table) != x.dims:
            raise _fail("rotary", xs, f"{table.name} dims {table.dims} must broadcast to {x.name} dims {x.dims}")
    return x.dims, x.dtype


def infer_attention(xs: list[Operand], attrs: dict[str, Any]) -> tuple[Dims, DType]:
    q, k, v = xs[:3]
    lengths = xs[3] if len(xs) > 3 else None
    _need_float("attention", [q, k, v])
    _same_dtype("attention", [q, k, v])
    if len(q.dims) != 3 or len(k.dims) != 4 or k.dims != v.dims:
        raise _fail(
            "attention", xs,
            "expects q (B, H, D), k_cache and v_cache (B, H_kv, S, D) with equal dims",
        )
    _real_attr("attention", xs, "scale", attrs["scale"], finite=True)  # None: 1/sqrt(D)
    b, h, d = q.dims
    kb, hkv, _, kd = k.dims
    if kb != b or kd != d:
        raise _fail("attention", xs, f"batch and head dim must agree: q has (B={b}, D={d}), k has (B={kb}, D={kd})")
    if h % hkv:
        raise _fail("attention", xs, f"H={h} query heads must be a multiple of H_kv={hkv} key/value heads (GQA)")
    if lengths is not None and (lengths.dtype.is_float or lengths.dims != (b,)):
        raise _fail("attention", xs, f"lengths must be an int tensor of dims ({b},), got {lengths}")
    return q.dims, q.dtype


# -- reference semantics (torch) ---------------------------------------------

def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_attention(q: Any, k: Any, v: Any, lengths: Any = None, *, scale: float | None = None) -> Any:
    import torch

    b, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    group = h // hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q, k) * (scale if scale is not None else 1.0 / math.sqrt(d))
    if lengths is not None:
        if int(lengths.min()) < 1 or int(lengths.max()) > s:
            raise ValueError(f"attention lengths must lie in [1, {s}], got {lengths.tolist()}")
        mask = torch.arange(s, device=q.device)[None, :] >= lengths.to(torch.long)[:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, dim=-1), v)


def _ref_embedding(ids: Any, table: Any) -> Any:
    import torch

    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
        raise IndexError(
            f"embedding ids must lie in [0, {table.shape[0]}), got min {int(ids.min())}, max {int(ids.max())}"
        )
    return torch.nn.functional.embedding(ids.to(torch.long), table)


def _t() -> Any:
    import torch

    return torch


OPS: dict[str, OpSpec] = {}


def _register(spec: OpSpec) -> None:
    OPS[spec.name] = spec


for _name, _fn in {
    "exp": lambda x: _t().exp(x),
    "silu": lambda x: _t().nn.functional.silu(x),
    "gelu": lambda x: _t().nn.functional.gelu(x),
    "sqrt": lambda x: _t().sqrt(x),
    "sigmoid": lambda x: _t().sigmoid(x),
}.items():
    _register(OpSpec(_name, "pointwise", 1, infer_unary_float(_name), _fn))
_register(OpSpec("relu", "pointwise", 1, infer_unary_any, lambda x: _t().relu(x)))
_register(OpSpec("square", "pointwise", 1, infer_unary_any, lambda x: x * x))
def _ref_clamp(x: Any, *, min_val: float | None, max_val: float | None) -> Any:
    if not x.is_floating_point():  # integer bounds keep an integer tensor integer
        min_val = None if min_val is None else int(min_val)
        max_val = None if max_val is None else int(max_val)
    return _t().clamp(x, min=min_val, max=max_val)


_register(OpSpec("clamp", "pointwise", 1, infer_clamp, _ref_clamp))
_register(OpSpec("add", "pointwise", 2, infer_binary("add"), lambda a, b: a + b))
_register(OpSpec("sub", "pointwise", 2, infer_binary("sub"), lambda a, b: a - b))
_register(OpSpec("mul", "pointwise", 2, infer_binary("mul"), lambda a, b: a * b))
_register(OpSpec("div", "pointwise", 2, infer_binary("div", float_only=True), lambda a, b: a / b))
_register(OpSpec("pow", "pointwise", 2, infer_binary("pow", float_only=True), lambda a, b: _t().pow(a, b)))
_register(OpSpec("rotary", "pointwise", 3, infer_rotary, lambda x, cos, sin: x * cos + _rotate_half(x) * sin))
_register(OpSpec("matmul", "matmul", 2, infer_matmul, lambda a, b: _t().matmul(a, b)))
_register(OpSpec("reduction", "row", 1, infer_reduction, lambda x, *, dim: x.sum(dim=dim, keepdim=True, dtype=x.dtype)))
_register(OpSpec("softmax", "row", 1, infer_softmax, lambda x, *, dim: _t().softmax(x, dim=dim)))
_register(OpSpec(
    "rms_norm", "row", 1, infer_rms_norm,
    lambda x, *, normalized_shape, eps: x * _t().rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps),
))
_register(OpSpec("embedding", "embedding", 2, infer_embedding, _ref_embedding))
_register(OpSpec("attention", "attention", 4, infer_attention, ref_attention))


#: The most elements one tensor may hold: byte offsets of 8-byte elements must fit a signed 64-bit int.
MAX_NUMEL = 2**60


def check_numel(dims: Dims, what: str) -> None:
    """Refuse tensors too large to index, at build time rather than as a compiler overflow later."""
    numel = math.prod(dims)
    if numel > MAX_NUMEL:
        raise GraphError(
            f"{what} has dims {dims}: {numel} elements, more than yirage can index "
            f"(at most 2**60 elements, so that byte offsets fit a signed 64-bit integer); use smaller dims"
        )


def check_dims(dims: Any, what: str = "dims") -> Dims:
    """Dims must be a non-empty sequence of positive ints."""
    if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__"):
        raise GraphError(f"{what} must be a sequence of positive ints, got {dims!r}")
    try:
        if any(isinstance(d, bool) or not hasattr(d, "__index__") for d in dims):
            raise TypeError
        out = tuple(int(d) for d in dims)
    except TypeError:
        raise GraphError(f"{what} must be a sequence of positive ints, got {dims!r}") from None
    if not out or any(d < 1 for d in out) or any(not isinstance(d, int) and not hasattr(d, "__index__") for d in dims):
        raise GraphError(f"{what} must be a non-empty sequence of positive ints, got {tuple(dims)!r}")
    return out


__all__ = ["MAX_NUMEL", "OPS", "GraphError", "Operand", "OpSpec", "as_dtype", "as_number", "broadcast", "check_dims",
           "check_numel"]
