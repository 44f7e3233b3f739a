"""Walking the kernel IR's expression trees: spelling, cost and properties.

``spell_expr`` does the recursion every renderer needs and leaves the words to
the caller's table of IR functions; a function missing from the table is a
clear ``UnsupportedExprError`` naming the renderer and the function, never a
``KeyError`` from deep inside rendering.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from yirage.compiler.decompose import COMPOSITES
from yirage.compiler.kernel_ir import Buffer, Call, Const, Expr, Load, Var
from yirage.errors import NotSupportedError

#: how one IR function is spelled, given its already-spelled arguments
Spelling = Callable[[Sequence[str]], str]


class UnsupportedExprError(NotSupportedError):
    """A renderer met an IR function its spelling table does not cover."""


def compute_type(buffer: Buffer) -> str:
    """Floats narrower than 32 bits are widened to float32 at the boundary."""
    name = buffer.dtype.name
    return "float32" if name in ("float16", "bfloat16") else name


def check_primitive(fn: str, renderer: str) -> None:
    """Refuse a composite IR function with the pass that removes it: renderers spell primitives only."""
    if fn in COMPOSITES:
        raise UnsupportedExprError(
            f"the {renderer} renderer met the composite IR function {fn!r}: renderers spell primitives only; "
            "rewrite the plan with yirage.compiler.decompose.decompose_plan first (build_plan does)")


def spell_expr(expr: Expr, *, load: Callable[[Load], str], var: Callable[[Var], str],
               const: Callable[[Const], str], table: Mapping[str, Spelling], renderer: str) -> str:
    """Spell ``expr`` bottom-up: leaves through ``load``/``var``/``const``, calls through ``table``."""
    if isinstance(expr, Load):
        return load(expr)
    if isinstance(expr, Var):
        return var(expr)
    if isinstance(expr, Const):
        return const(expr)
    spell = table.get(expr.fn)
    if spell is None:
        check_primitive(expr.fn, renderer)
        raise UnsupportedExprError(
            f"the {renderer} renderer has no spelling for the IR function {expr.fn!r} (it spells "
            f"{', '.join(sorted(table))}); add it to the renderer's table, or compile with a backend "
            "that supports it (e.g. backend='reference')")
    return spell([spell_expr(a, load=load, var=var, const=const, table=table, renderer=renderer)
                  for a in expr.args])


_COSTLY = {"exp": 8, "silu": 8, "gelu": 12, "pow": 12, "sqrt": 2, "div": 2}


def expr_cost(expr: Expr) -> int:
    """Rough scalar-op count of one evaluation: transcendental calls weigh more."""
    if isinstance(expr, Call):
        return _COSTLY.get(expr.fn, 1) + sum(expr_cost(a) for a in expr.args)
    return 1


def has_rotate(expr: Expr) -> bool:
    """Whether any load in ``expr`` reads through rotate_half (the rotary-embedding pairing)."""
    if isinstance(expr, Load):
        return expr.rotate_half
    if isinstance(expr, Call):
        return any(has_rotate(a) for a in expr.args)
    return False


STASH = "stash"  # the Var a row kernel's output expression reads a stashed value through


def replace_subtree(expr: Expr, target: Expr, by: Expr) -> Expr:
    """``expr`` with every occurrence of ``target`` replaced by ``by``."""
    if expr == target:
        return by
    if isinstance(expr, Call):
        return Call(expr.fn, tuple(replace_subtree(a, target, by) for a in expr.args))
    return expr


def row_stash(reductions: Sequence[Any], out_expr: Expr, per_row: bool, exact: bool) -> tuple[Expr | None, Expr]:
    """(what the last reduction stores into the output row, the output expression reading it as ``Var(STASH)``).

    Softmax sums ``exp(x - max)`` and then writes ``exp(x - max) / sum``: computing the exponential once, storing
    it in the output row during the sum and reading it back, halves the transcendental work. It is exact only when
    the output holds the compute type (``exact``: a narrow output would round the stored value); the value the
    output pass reads is then bit-identical to the one it would compute. (None, out_expr) where nothing repeats:
    the last reduction is not a sum of a computed value that the output expression contains."""
    if per_row or not exact or not reductions:
        return None, out_expr
    last = reductions[-1]
    if last.combine != "sum" or not isinstance(last.expr, Call):
        return None, out_expr
    replaced = replace_subtree(out_expr, last.expr, Var(STASH))
    return (last.expr, replaced) if replaced != out_expr else (None, out_expr)
