"""The float64 oracle of a whole graph, with a per-element error scale for each output.

A backend computing in a narrower dtype makes rounding errors of about ``eps * |v|`` at every op,
and they propagate: ``a - b`` with ``a ~ b`` is only as exact as ``|a| + |b|``, ``exp(x)`` as
exact as ``|x|`` in relative terms. ``graph_oracle`` evaluates the graph in float64 and, beside
each value, a first-order magnitude ``s`` (the derivative-weighted sum of every rounded quantity
that reaches it), so that ``|out - v| <= atol + rtol * s`` is an honest per-element bound for
any graph. For a matmul ``s`` is ``|A| @ |B|``; for a single exact op ``s`` is ``|v|``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yirage.graph.kernel_graph import KernelGraph
from yirage.graph.ops import OPS

#: bounds of |f'(x)| for the smooth activations
_SILU_SLOPE, _GELU_SLOPE = 1.1, 1.13


def _rotate_abs(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def _clamp_scale(x: Any, sx: Any, out: Any, lo: float | None, hi: float | None) -> Any:
    """Well past a bound the output is the bound exactly; near or inside it, x's error passes through."""
    import torch

    beyond = torch.zeros_like(x, dtype=torch.bool)
    if lo is not None:
        beyond |= x < lo - 0.1 * sx
    if hi is not None:
        beyond |= x > hi + 0.1 * sx
    return out.abs() + torch.where(beyond, torch.zeros_like(sx), sx)


def _attention_scale(q: Any, k: Any, v: Any, sq: Any, sk: Any, sv: Any, lengths: Any, scale: float | None) -> Any:
    import math

    import torch

    group = q.shape[1] // k.shape[1]
    k, v, sk, sv = (t.repeat_interleave(group, dim=1) for t in (k, v, sk, sv))
    factor = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bhd,bhsd->bhs", q, k) * factor
    s_scores = torch.einsum("bhd,bhsd->bhs", sq, sk) * abs(factor)
    if lengths is not None:
        mask = torch.arange(k.shape[2])[None, :] >= lengths.to(torch.long)[:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
        s_scores = s_scores.masked_fill(mask[:, None, :], 0.0)
    p = torch.softmax(scores, dim=-1)
    sp = p * (s_scores + (p * s_scores).sum(-1, keepdim=True)) + p
    return torch.einsum("bhs,bhsd->bhd", p, sv) + torch.einsum("bhs,bhsd->bhd", sp, v.abs())


def _composite_scale(op: str, vals: list[Any], scales: list[Any]) -> Any:
    """A composite's magnitude from its definition in primitives (``yirage.compiler.decompose``), rule by rule:
    what a backend computes is that definition, so each of its roundings is counted."""
    import torch

    from yirage.compiler.decompose import arity, decompose
    from yirage.compiler.kernel_ir import Call, Const, Expr, Load

    def walk(e: Expr) -> tuple[Any, Any]:
        if isinstance(e, Load):
            i = int(e.buffer)
            return vals[i], scales[i]
        if isinstance(e, Const):
            return torch.full_like(vals[0], e.value), torch.zeros_like(vals[0])
        assert isinstance(e, Call), e
        (v, *more), (s, *more_s) = zip(*(walk(a) for a in e.args), strict=True)
        if e.fn == "neg":
            return -v, s
        if e.fn in ("max", "min"):  # the selected operand, with its magnitude (NaN-propagating, ties keep v)
            w, sw = more[0], more_s[0]
            take = ((w > v) if e.fn == "max" else (w < v)) | w.isnan()
            return torch.where(take, w, v), torch.where(take, sw, s)
        out = OPS[e.fn].reference(v, *more)
        return out, _scale(e.fn, {}, [v, *more], [s, *more_s], out)

    return walk(decompose(Call(op, tuple(Load(str(i)) for i in range(arity(op)))), keep=()))[1]


def _scale(op: str, a: dict[str, Any], vals: list[Any], scales: list[Any], out: Any) -> Any:
    """The magnitude of op's output (attributes ``a``) from its operands' values and magnitudes (see module doc)."""
    import torch

    from yirage.compiler.decompose import COMPOSITES

    x = vals[0]
    sx = scales[0]
    if op in ("add", "sub"):
        return scales[0] + scales[1]
    if op == "mul":
        return vals[0].abs() * scales[1] + vals[1].abs() * scales[0] + out.abs()
    if op == "div":
        b = vals[1].abs()
        return scales[0] / b + out.abs() * scales[1] / b + out.abs()
    if op == "pow":
        rel = vals[1].abs() * scales[0] / vals[0].abs() + vals[0].abs().log().abs() * scales[1]
        return out.abs() * (1.0 + rel)
    if op == "exp":
        return out * (1.0 + sx)
    if op in ("silu", "gelu"):
        return out.abs() + (_SILU_SLOPE if op == "silu" else _GELU_SLOPE) * sx
    if op == "relu":
        return sx
    if op == "square":
        return 2.0 * x.abs() * sx + out
    if op == "sqrt":
        return out + sx / (2.0 * out)
    if op == "clamp":
        return _clamp_scale(x, sx, out, a["min_val"], a["max_val"])
    if op == "rotary":
        return sx * scales[1] + _rotate_abs(sx) * scales[2]
    if op == "matmul":
        return torch.matmul(scales[0], scales[1])
    if op == "reduction":
        return sx.sum(dim=a["dim"], keepdim=True)
    if op == "softmax":
        return out * (sx + (out * sx).sum(dim=a["dim"], keepdim=True)) + out
    if op == "rms_norm":
        r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + a["eps"])
        return r * sx + x.abs() * r.pow(3) * (x.abs() * sx).mean(dim=-1, keepdim=True) + out.abs()
    if op == "embedding":
        return torch.nn.functional.embedding(vals[0].to(torch.long), scales[1])
    if op == "attention":
        lengths = vals[3] if len(vals) > 3 else None
        return _attention_scale(*vals[:3], *scales[:3], lengths, a["scale"])
    if op in COMPOSITES:
        return _composite_scale(op, vals, scales)
    raise NotImplementedError(f"no error-scale rule for op {op!r}: add one to yirage.reference.magnitude._scale")


def graph_oracle(graph: KernelGraph, inputs: Sequence[Any]) -> tuple[list[Any], list[Any | None]]:
    """Outputs of ``graph`` in float64 (torch op by op) and each float output's error scale (None for ints)."""
    import torch

    if len(inputs) != len(graph.inputs):
        raise ValueError(f"the graph has {len(graph.inputs)} inputs but {len(inputs)} tensors were passed")
    values: dict[int, Any] = {}
    scales: dict[int, Any] = {}
    for node, t in zip(graph.inputs, inputs, strict=True):
        if node.dtype.is_float:
            values[node.id] = t.to(torch.float64)
            scales[node.id] = values[node.id].abs()
        else:
            values[node.id], scales[node.id] = t, None
    for node in graph.nodes:
        if node.op == "input":
            continue
        args = [values[i] for i in node.inputs]
        values[node.id] = out = OPS[node.op].reference(*args, **node.attrs)
        if node.dtype.is_float:
            scales[node.id] = _scale(node.op, node.attrs, args, [scales[i] for i in node.inputs], out)
        else:
            scales[node.id] = None
    outs = [values[i].clone() for i in graph.outputs]
    return outs, [None if scales[i] is None else scales[i].contiguous() for i in graph.outputs]
