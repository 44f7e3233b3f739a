"""Composite IR functions rewritten into primitives, once, after lowering: the one home of their formulas.

Why: a pointwise op used to need a spelling in every renderer (the C-family table and its helpers, the
Triton table and helpers, the numba table and kernel library, the torch lowering). A composite defined
here in primitives needs none of them: ``build_plan`` runs ``decompose_plan`` on every plan, so a
renderer meets only the functions of ``yirage.compiler.kernel_ir.FUNCTIONS``.

Each definition is the IEEE form the renderers computed before, operation for operation (``rsqrt`` is
``1 / sqrt``, never a hardware reciprocal square root), so results stay bit-identical, and where a
renderer spelled the composite inline its text is unchanged too. Like torch, no identity that holds only
in exact arithmetic is used: ``sigmoid`` is ``1 / (1 + exp(-x))``, which is 0 for x below about -88.7
in float32 (exp overflows to inf), 1 above about 17, NaN for NaN.

``KEPT`` lists the composites that still reach the renderers whole, each with why; they are in
``FUNCTIONS`` and their definitions here are what their helpers compute (tests/test_decompose.py holds the
two to the same bits on the cpu, opencl and torch backends), so one can move to the decomposed side by
deleting its ``KEPT`` entry and its spellings (and re-baselining the render hashes: the text changes).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import replace

from yirage.compiler.kernel_ir import (
    FUNCTIONS,
    Call,
    Const,
    Expr,
    Kernel,
    KernelPlan,
    Matmul,
    Pointwise,
    Reduction,
    Row,
)


def _fn(name: str) -> Callable[..., Call]:
    """A builder of ``Call(name, ...)``; number arguments become constants."""

    def build(*args: Expr | float) -> Call:
        return Call(name, tuple(Const(float(a)) if isinstance(a, (int, float)) else a for a in args))

    return build


add, mul, div, neg, maximum, exp, sqrt = (_fn(n) for n in ("add", "mul", "div", "neg", "max", "exp", "sqrt"))

#: composite -> its definition in primitives, at any compute type the composite accepts
DECOMPOSITIONS: dict[str, Callable[..., Expr]] = {
    "rsqrt": lambda x: div(1.0, sqrt(x)),
    "sigmoid": lambda x: div(1.0, add(1.0, exp(neg(x)))),
    "silu": lambda x: div(x, add(1.0, exp(neg(x)))),
    "relu": lambda x: maximum(x, 0.0),
    "square": lambda x: mul(x, x),
}

#: composites the renderers still spell whole (they are in FUNCTIONS), and why
KEPT: dict[str, str] = {
    "silu": "every renderer calls a helper (C y_silu_*, Triton y_silu32/64, numba fsilu/dsilu) that computes "
            "exactly DECOMPOSITIONS['silu']; inlining it changes the generated text of every SwiGLU kernel "
            "(the render-hash baseline), not one result bit",
    "relu": "Triton spells it as one tl.where (y_relu); DECOMPOSITIONS['relu'] as y_max(x, 0.0) gives the same "
            "bits but new text. C-family and numba already spell it as max(x, 0)",
    "square": "the expression IR is a tree: mul(x, x) repeats the whole subtree x (twice the text, and twice the "
              "work where the compiler does not merge them, e.g. numba's); the helpers evaluate x once",
    "gelu": "it needs erf, which is no primitive: Metal has none, and numba's vectorizable erf (ferf) is reached "
            "only through fgelu; decompose it once erf is a primitive every renderer spells",
}

#: what the pass removes from every plan, so no renderer spells it
COMPOSITES = frozenset(DECOMPOSITIONS) - frozenset(KEPT)


def arity(fn: str) -> int:
    """How many arguments the composite ``fn`` takes."""
    return len(inspect.signature(DECOMPOSITIONS[fn]).parameters)


def clamp(x: Expr, min_val: float | None, max_val: float | None) -> Expr:
    """clamp as max then min with constant bounds (an absent bound is no call): torch.clamp's NaN and ties.

    Lowering calls this directly because clamp's bounds are attributes of the graph op, not operands.
    """
    out = x
    if min_val is not None:
        out = Call("max", (out, Const(min_val)))
    if max_val is not None:
        out = Call("min", (out, Const(max_val)))
    return out


def decompose(expr: Expr, keep: Collection[str] = frozenset(KEPT)) -> Expr:
    """``expr`` with every composite not in ``keep`` replaced by its definition, bottom-up."""
    if not isinstance(expr, Call):
        return expr
    args = tuple(decompose(a, keep) for a in expr.args)
    rule = DECOMPOSITIONS.get(expr.fn)
    if rule is None or expr.fn in keep:
        return expr if args == expr.args else Call(expr.fn, args)
    if len(args) != arity(expr.fn):
        raise ValueError(f"the IR function {expr.fn!r} takes {arity(expr.fn)} argument(s), got {len(args)} in "
                         f"{expr}; this is a lowering bug")
    return decompose(rule(*args), keep)  # a definition may use another composite


def decompose_kernel(kernel: Kernel, keep: Collection[str] = frozenset(KEPT)) -> Kernel:
    """``kernel`` with ``decompose`` applied to each of its expressions (other kernel kinds have none)."""
    if isinstance(kernel, Pointwise):
        return replace(kernel, expr=decompose(kernel.expr, keep))
    if isinstance(kernel, Row):
        reductions = tuple(Reduction(r.var, r.combine, decompose(r.expr, keep)) for r in kernel.reductions)
        return replace(kernel, reductions=reductions, out_expr=decompose(kernel.out_expr, keep))
    if isinstance(kernel, Matmul):
        row_scale = None if kernel.row_scale is None else decompose(kernel.row_scale, keep)
        return replace(kernel, a=decompose(kernel.a, keep), epilogue=decompose(kernel.epilogue, keep),
                       row_scale=row_scale)
    return kernel


def decompose_plan(plan: KernelPlan, keep: Collection[str] = frozenset(KEPT)) -> KernelPlan:
    """The pass ``build_plan`` runs after lowering: every kernel of ``plan`` in primitives (and ``keep``)."""
    return replace(plan, kernels=[decompose_kernel(k, keep) for k in plan.kernels])


assert not COMPOSITES & set(FUNCTIONS), f"decomposed composites must not be IR primitives: {COMPOSITES}"
assert set(KEPT) <= set(FUNCTIONS), "a kept composite reaches the renderers: it must be in FUNCTIONS"
