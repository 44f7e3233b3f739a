"""The torch-device lowering: a ``KernelPlan`` executed kernel by kernel as torch ops on any torch device.

Correct everywhere torch runs (the fallback of backends whose vendor compiler is missing: Ascend "npu",
Cambricon "mlu", Moore Threads "musa", ...), unfused: each IR kernel becomes a handful of torch ops and
every intermediate value of an expression is a tensor. It runs the PLAN, not the graph (the reference
backend runs the graph op by op), so it checks lowering and fusion independently of the graph runner.

Semantics follow ``yirage.codegen.cstyle``: IEEE, max/min NaN-propagating and returning the first operand
on ties, ``rsqrt`` as ``1 / sqrt``, ``silu`` as ``x / (1 + exp(-x))``, ``gelu`` through ``erf``; float16
and bfloat16 graph tensors are widened to float32 as they load and rounded (to nearest even) as they store;
temporaries stay float32. Reductions, the matmul (``torch.matmul``) and attention compute in the compute
type (float32 for the narrow floats). Loads are broadcast views of the tensors themselves (never
``as_strided`` over the plan's strides), so no raw address is formed and a tensor whose size-1 dims carry
odd strides is still read right.

Host reads: none, except the status checks, one per checked kernel and call (an embedding's ids in range,
attention lengths in ``[1, S]``), which raise ``IndexError`` / ``ValueError`` with cstyle's messages. A plan
with a checked kernel is refused on the ``meta`` device, which has no data to check.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from yirage.codegen.exprs import UnsupportedExprError, check_primitive, compute_type
from yirage.compiler.kernel_ir import (
    FUNCTIONS,
    Attention,
    Buffer,
    Call,
    Const,
    Embedding,
    Expr,
    Kernel,
    KernelPlan,
    Load,
    Matmul,
    Pointwise,
    Row,
    Var,
)
from yirage.errors import NotSupportedError

Values = dict[str, Any]  # buffer name -> tensor, during one call; DEVICE -> the device the call runs on
DEVICE = ""  # never a buffer name
Env = dict[Any, Any]  # (buffer, rotate_half) -> loaded view, var name -> value, during one kernel
Step = Callable[[Values], None]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}


# -- IR functions -----------------------------------------------------------------------------------


def _pick(better: Callable[[Any, Any], Any], check_nan: bool) -> Callable[[Any, Any], Any]:
    """cstyle's ``(better(b, a) || b != b) ? b : a``: NaN-propagating, ties keep ``a``."""

    def pick(a: Any, b: Any) -> Any:
        if not isinstance(b, torch.Tensor):  # a constant second operand (clamp bounds, relu's 0)
            return torch.where(better(b, a), b, a) if b == b else torch.full_like(a, b)
        cond = better(b, a)
        if check_nan:
            cond = cond | torch.isnan(b)
        return torch.where(cond, b, a)

    return pick


def _functions(is_float: bool) -> dict[str, Callable[..., Any]]:
    """How each IR function is computed for a compute type (operands: tensors, or Python numbers for constants)."""
    table: dict[str, Callable[..., Any]] = {
        "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
        "max": _pick(operator.gt, is_float), "min": _pick(operator.lt, is_float),
        "relu": lambda a: _pick(operator.gt, False)(a, 0.0 if is_float else 0),
        "square": lambda a: a * a, "neg": operator.neg,
    }
    if is_float:
        table.update({
            "pow": torch.pow, "exp": torch.exp, "sqrt": torch.sqrt,
            "silu": lambda a: a / (1.0 + torch.exp(-a)),
            "gelu": lambda a: 0.5 * a * (1.0 + torch.erf(a * 0.7071067811865476)),
        })
    return table


def _compile_expr(expr: Expr, ct: str, table: dict[str, Callable[..., Any]]) -> Callable[[Env], Any]:
    """``expr`` as a closure over a kernel's environment; calls on constants only are folded here."""
    if isinstance(expr, Load):
        key = (expr.buffer, expr.rotate_half)
        return lambda env: env[key]
    if isinstance(expr, Var):
        name = expr.name
        return lambda env: env[name]
    if isinstance(expr, Const):
        value = int(expr.value) if ct.startswith("int") else float(expr.value)
        return lambda env: value
    fn = table.get(expr.fn)
    if fn is None:
        check_primitive(expr.fn, "torch-device lowering")
    if fn is None or FUNCTIONS.get(expr.fn) != len(expr.args):
        raise UnsupportedExprError(
            f"the torch-device lowering has no {ct} definition of the IR function {expr.fn!r} with "
            f"{len(expr.args)} argument(s) (it computes {', '.join(sorted(table))}); add it to "
            "yirage/codegen/torch_plan.py, or compile with backend='reference'")
    args = [_compile_expr(a, ct, table) for a in expr.args]  # checks every function below this one too
    if not _all_loads([expr]) and not _uses_vars(expr):  # constants only: fold once, in the compute type
        folded = _fold(expr, _TORCH_DTYPES[ct], table).item()
        return lambda env: folded
    if len(args) == 1:
        (f0,) = args
        return lambda env: fn(f0(env))
    f0, f1 = args
    return lambda env: fn(f0(env), f1(env))


def _fold(expr: Expr, dtype: torch.dtype, table: dict[str, Callable[..., Any]]) -> Any:
    """A constant expression evaluated on the host as a 0-dim tensor of ``dtype`` (checked by the caller)."""
    if isinstance(expr, Const):
        return torch.tensor(float(expr.value) if dtype.is_floating_point else int(expr.value), dtype=dtype)
    assert isinstance(expr, Call)
    return table[expr.fn](*(_fold(a, dtype, table) for a in expr.args))


def _uses_vars(expr: Expr) -> bool:
    return isinstance(expr, Var) or (isinstance(expr, Call) and any(_uses_vars(a) for a in expr.args))


def _all_loads(exprs: Sequence[Expr | None]) -> list[Load]:
    seen: list[Load] = []

    def walk(e: Expr | None) -> None:
        if isinstance(e, Load):
            if e not in seen:
                seen.append(e)
        elif isinstance(e, Call):
            for a in e.args:
                walk(a)

    for e in exprs:
        walk(e)
    return seen


# -- per-kernel steps --------------------------------------------------------------------------------


class _Builder:
    """Turns each kernel of a plan into a closure ``step(values)`` that reads and writes buffers."""

    def __init__(self, plan: KernelPlan) -> None:
        self.plan, self.buffers = plan, plan.buffers

    def ct(self, name: str) -> str:
        return compute_type(self.buffers[name])

    def loader(self, loads: list[Load], space: Sequence[int], ct: str) -> Callable[[Values], Env]:
        """Fill an environment with each load as a view over ``space``'s rank, in the compute type."""
        dtype = _TORCH_DTYPES[ct]
        rank, space = len(space), tuple(space)
        specs = []
        for ld in loads:
            buf = self.buffers[ld.buffer]
            pad = rank - len(buf.dims)
            if pad < 0:
                raise NotSupportedError(f"kernel plan {self.plan.digest[:12]}: buffer {buf.name} {buf.dims} has "
                                        f"more dims than the space {space} that loads it; a lowering bug")
            specs.append(((ld.buffer, ld.rotate_half), ld.buffer, (None,) * pad if pad else None, ld.rotate_half))
        half = space[-1] // 2 if space else 0

        def load(values: Values) -> Env:
            env: Env = {}
            for key, name, pad, rotate in specs:
                t = values[name]
                if t.dtype != dtype:
                    t = t.to(dtype)
                if pad is not None:
                    t = t[pad]
                if rotate:  # rotate_half: (-x[..., half:], x[..., :half]) along the space's last dim
                    t = t.expand(space)
                    t = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
                env[key] = t
            return env

        return load

    def store(self, out: str, space: Sequence[int], fresh: bool) -> Callable[[Values, Any], None]:
        """Write a kernel's value: outputs contiguous in their dtype (narrow floats rounded), temps in compute type.

        ``fresh`` False: the value may be a view of another buffer (a bare load), so an output copies it.
        """
        buf = self.buffers[out]
        space = tuple(space)
        dtype = _TORCH_DTYPES[buf.dtype.name if buf.role != "temp" else compute_type(buf)]
        output = buf.role == "output"

        def store(values: Values, value: Any) -> None:
            if not isinstance(value, torch.Tensor):
                value = torch.full(space, value, dtype=dtype, device=values[DEVICE])
            elif tuple(value.shape) != space:
                value = value.expand(space)
            if output:
                if value.dtype != dtype:
                    value = value.to(dtype)
                elif not fresh:
                    value = value.clone(memory_format=torch.contiguous_format)
                if not value.is_contiguous():  # an input's layout (a transposed weight) or a broadcast
                    value = value.contiguous()
            elif value.dtype != dtype:
                value = value.to(dtype)
            values[out] = value

        return store

    # -- kernels --------------------------------------------------------------------------------------
    def pointwise(self, k: Pointwise) -> Step:
        ct = self.ct(k.out)
        load, f = self.loader(_all_loads([k.expr]), k.space, ct), _compile_expr(k.expr, ct, self.table(ct))
        store = self.store(k.out, k.space, fresh=isinstance(k.expr, Call))

        def step(values: Values) -> None:
            store(values, f(load(values)))

        return step

    def row(self, k: Row) -> Step:
        ct = self.ct(k.out)
        table, axis, space = self.table(ct), k.axis, tuple(k.space)
        load = self.loader(_all_loads([r.expr for r in k.reductions] + [k.out_expr]), space, ct)
        dtype = _TORCH_DTYPES[ct]
        reductions = []
        for red in k.reductions:
            f = _compile_expr(red.expr, ct, table)
            if red.combine == "sum":
                def combine(t: Any) -> Any:
                    return torch.sum(t, dim=axis, keepdim=True, dtype=dtype)
            elif red.combine == "max":
                def combine(t: Any) -> Any:
                    return torch.amax(t, dim=axis, keepdim=True)  # NaN-propagating, like y_max
            else:
                raise NotSupportedError(f"kernel {k.name}: the torch-device lowering has no {red.combine!r} "
                                        "reduction (it does sum and max); add it to yirage/codegen/torch_plan.py")
            reductions.append((red.var, f, combine))
        out_f = _compile_expr(k.out_expr, ct, table)
        out_dims = tuple(1 if i == axis else d for i, d in enumerate(space)) if k.per_row else space
        store = self.store(k.out, out_dims, fresh=isinstance(k.out_expr, (Call, Var)))
        per_row = k.per_row

        def step(values: Values) -> None:
            env = load(values)
            for var, f, combine in reductions:
                value = f(env)
                if not isinstance(value, torch.Tensor):
                    value = torch.full((), value, dtype=dtype, device=values[DEVICE])
                env[var] = combine(value.expand(space))
            if per_row:  # the output expression reads each load at index 0 of the reduced axis
                env = {key: (v.narrow(axis, 0, 1) if isinstance(key, tuple) and v.shape[axis] > 1 else v)
                       for key, v in env.items()}
            store(values, out_f(env))

        return step

    def matmul(self, k: Matmul) -> Step:
        ct = self.ct(k.out)
        table, dtype = self.table(ct), _TORCH_DTYPES[ct]
        load_a = self.loader(_all_loads([k.a, k.row_scale]), k.a_space, ct)
        a_f = _compile_expr(k.a, ct, table)
        rs_f = _compile_expr(k.row_scale, ct, table) if k.row_scale is not None else None
        load_e = self.loader(_all_loads([k.epilogue]), k.space, ct)
        epi_f = _compile_expr(k.epilogue, ct, table)
        store = self.store(k.out, k.space, fresh=not isinstance(k.epilogue, Load))
        a_space, b_name, kk, eps = tuple(k.a_space), k.b, float(k.k), float(k.eps)

        def tensor(value: Any, values: Values) -> Any:
            if isinstance(value, torch.Tensor):
                mk = a_space[-2:]
                return value if tuple(value.shape[-2:]) == mk else value.expand(value.shape[:-2] + mk)
            return torch.full(a_space, value, dtype=dtype, device=values[DEVICE])

        def step(values: Values) -> None:
            env_a = load_a(values)
            b = values[b_name]
            if b.dtype != dtype:
                b = b.to(dtype)
            a = tensor(a_f(env_a), values)
            env = load_e(values)
            if rs_f is not None:
                # $scale = rsqrt(sum_k x^2 / K + eps) per row of A, applied to A's rows before the product as
                # cstyle does (and torch's rms_norm then matmul): where x^2 overflows the scale is 0 and the row
                # of A is 0, so the product is 0, where (x @ w) * 0 would be inf * 0 = NaN
                x = tensor(rs_f(env_a), values)
                a = a * (1.0 / torch.sqrt(torch.sum(x * x, dim=-1, keepdim=True) / kk + eps))
                env["scale"] = 1.0
            env["acc"] = torch.matmul(a, b)
            store(values, epi_f(env))

        return step

    def embedding(self, k: Embedding) -> Step:
        out_buf = self.buffers[k.out]
        dims = tuple(out_buf.dims)
        store = self.store(k.out, dims, fresh=True)
        vocab, ids_name, table_name = k.vocab, k.ids, k.table
        message = (f"embedding ids must lie in [0, {vocab}); the id at flat position {{pos}} of input {ids_name} "
                   "is out of range")

        def step(values: Values) -> None:
            flat = values[ids_name].reshape(-1)
            bad = (flat < 0) | (flat >= vocab)
            if bad.any():  # the one host read of this kernel
                raise IndexError(message.format(pos=int(bad.nonzero()[0, 0])))
            rows = values[table_name].index_select(0, flat.to(torch.int64))
            store(values, rows.view(dims))

        return step

    def attention(self, k: Attention) -> Step:
        ct = self.ct(k.out)
        dtype = _TORCH_DTYPES[ct]
        store = self.store(k.out, (k.batch, k.heads, k.head_dim), fresh=True)
        b_, hkv, group, d, seq, scale = k.batch, k.kv_heads, k.heads // k.kv_heads, k.head_dim, k.seq, k.scale
        names, lengths = (k.q, k.k, k.v), k.lengths
        norms = ((0, k.q_eps, k.q_gain), (1, k.k_eps, k.k_gain))  # (q or k, eps, gain): QK-norm fused
        message = f"attention lengths must lie in [1, {seq}]; batch {{pos}} has length {{value}}"

        def step(values: Values) -> None:
            qkv = [values[n] if values[n].dtype == dtype else values[n].to(dtype) for n in names]
            for at, eps, gain in norms:  # the fused RMSNorm of the query or key rows, as the row kernel computes it
                if eps is not None:
                    x = qkv[at]
                    qkv[at] = x * (1.0 / torch.sqrt(torch.sum(x * x, dim=-1, keepdim=True) / d + eps))
                if gain is not None:  # times the gain over the head dim that follows the norm
                    qkv[at] = qkv[at] * values[gain].to(dtype).reshape(d)
            q, kc, vc = qkv
            scores = torch.matmul(q.reshape(b_, hkv, group, d), kc.transpose(-1, -2)) * scale  # (B, Hkv, G, S)
            if lengths is not None:
                n = values[lengths]
                bad = (n < 1) | (n > seq)
                if bad.any():  # the one host read of this kernel
                    pos = int(bad.nonzero()[0, 0])
                    raise ValueError(message.format(pos=pos, value=int(n[pos])))
                past = torch.arange(seq, device=n.device)[None, :] >= n.to(torch.int64)[:, None]  # (B, S)
                scores = scores.masked_fill(past[:, None, None, :], -math.inf)
                vc = vc.masked_fill(past[:, None, :, None], 0.0)  # rows past the length are never read
            e = torch.exp(scores - torch.amax(scores, dim=-1, keepdim=True))
            p = e / torch.sum(e, dim=-1, keepdim=True)
            store(values, torch.matmul(p, vc).reshape(b_, group * hkv, d))

        return step

    def table(self, ct: str) -> dict[str, Callable[..., Any]]:
        return _functions(ct.startswith("float"))

    KERNELS: dict[type, Callable[[_Builder, Any], Step]] = {}  # filled below


_Builder.KERNELS.update({Pointwise: _Builder.pointwise, Row: _Builder.row, Matmul: _Builder.matmul,
                         Embedding: _Builder.embedding, Attention: _Builder.attention})


def checked_kernels(plan: KernelPlan) -> list[Kernel]:
    """Kernels whose status check reads the device on the host once per call."""
    return [k for k in plan.kernels if isinstance(k, Embedding) or (isinstance(k, Attention) and k.lengths)]


class TorchPlan:
    """A plan compiled once into per-kernel closures: ``TorchPlan(plan, device)(inputs) -> outputs``.

    ``device``: a torch device (``"cpu"``, ``"cuda"``, ``"npu"``, ``"meta"``, ...). Inputs must be torch
    tensors on a device of that type with the declared shapes and dtypes; outputs are fresh contiguous
    tensors on the inputs' device. A plan with a status check is refused on ``"meta"``.
    """

    def __init__(self, plan: KernelPlan, device: str | torch.device = "cpu") -> None:
        self.plan = plan
        self.device = torch.device(device)
        if self.device.type == "meta" and checked_kernels(plan):
            names = ", ".join(f"{k.name} ({type(k).__name__.lower()})" for k in checked_kernels(plan))
            raise NotSupportedError(
                f"kernel plan {plan.digest[:12]} cannot run on the meta device: kernel(s) {names} check their "
                "input (embedding ids, attention lengths) with a host read, and meta tensors have no data; run it "
                "on a device with storage (e.g. 'cpu')")
        builder = _Builder(plan)
        self.steps: list[Step] = []
        for k in plan.kernels:
            make = _Builder.KERNELS.get(type(k))
            if make is None:
                raise NotSupportedError(f"the torch-device lowering has no {type(k).__name__} kernels; add one to "
                                        "yirage/codegen/torch_plan.py, or compile with backend='reference'")
            self.steps.append(make(builder, k))
        self.inputs: list[tuple[str, Buffer, torch.dtype]] = [
            (n, plan.buffers[n], _TORCH_DTYPES[plan.buffers[n].dtype.name]) for n in plan.inputs]
        self.outputs = list(plan.outputs)
        self.repeated = {i for i, n in enumerate(self.outputs) if n in self.outputs[:i]}  # returned twice: copy

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        if len(inputs) != len(self.inputs):
            raise ValueError(f"kernel plan {self.plan.digest[:12]} has {len(self.inputs)} input(s) but "
                             f"{len(inputs)} tensor(s) were passed; pass one per graph input, in order")
        device = inputs[0].device if inputs and isinstance(inputs[0], torch.Tensor) else self.device
        if device.type != self.device.type or (self.device.index is not None and device != self.device):
            device = self.device  # refused below, with the input named
        values: Values = {DEVICE: device}
        for (name, buf, dtype), t in zip(self.inputs, inputs, strict=True):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != buf.dims or t.device != device:
                got = (f"{type(t).__name__} {tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"input {buf.index} ({name}) of kernel plan {self.plan.digest[:12]} is {got}; pass "
                                 f"a torch.Tensor {buf.dims} {buf.dtype} on {device} (all inputs on one device "
                                 f"of type {self.device.type!r})")
            values[name] = t
        with torch.no_grad():  # compiled graphs do not propagate autograd
            for step in self.steps:
                step(values)
        out = [values[n] for n in self.outputs]
        for i in self.repeated:
            out[i] = out[i].clone()
        return out


def run_plan(plan: KernelPlan, inputs: Sequence[Any], device: str | torch.device = "cpu") -> list[Any]:
    """Run ``plan`` once on ``device`` (compile with ``TorchPlan`` to run it many times)."""
    return TorchPlan(plan, device)(inputs)
