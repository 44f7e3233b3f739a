"""Composites are decomposed once, after lowering: the definitions against torch, and renderers see primitives only.

Oracles: torch's own functions in float64 (``OPS[op].reference`` for graph ops, ``torch.rsqrt``
for the IR-only composite), evaluated independently of the decomposition; for the kept composites,
the outputs of today's helper spellings, which the decomposed form must reproduce bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

import yirage as yr
from yirage.codegen import torch_plan
from yirage.codegen.cstyle import _Renderer as CRenderer
from yirage.codegen.dialect import plan_functions
from yirage.codegen.dialects import dialect, names
from yirage.codegen.exprs import UnsupportedExprError
from yirage.codegen.triton.render import TL_TYPE
from yirage.codegen.triton.render import _Renderer as TritonRenderer
from yirage.compiler.decompose import COMPOSITES, DECOMPOSITIONS, KEPT, arity, decompose, decompose_plan
from yirage.compiler.kernel_ir import FUNCTIONS, Call, Const, Expr, KernelPlan, Load, Pointwise
from yirage.compiler.lower import build_plan
from yirage.graph.ops import OPS

SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-310, -1e-310, 1e300, -1e300, 745.0, -745.0, 710.0,
            -710.0, 88.7, -88.7, 40.0, -40.0, 1.0, -1.0, 0.5]
#: torch's definition of each composite that is no graph op
IR_ONLY_ORACLE = {"rsqrt": torch.rsqrt}


def _oracle(fn: str):  # noqa: ANN202 - a torch function
    return OPS[fn].reference if fn in OPS else IR_ONLY_ORACLE[fn]


def _evaluate(expr: Expr, x: torch.Tensor) -> torch.Tensor:
    """An expression over Load("x") with the primitives' IR semantics, written here with torch in float64."""
    if isinstance(expr, Load):
        return x
    if isinstance(expr, Const):
        return torch.full_like(x, expr.value)
    assert isinstance(expr, Call) and expr.fn in FUNCTIONS and expr.fn not in KEPT, f"{expr} is no primitive"
    a = [_evaluate(arg, x) for arg in expr.args]
    nan_or = {"max": torch.gt, "min": torch.lt}
    if expr.fn in nan_or:  # NaN-propagating; ties keep the first operand
        return torch.where(nan_or[expr.fn](a[1], a[0]) | a[1].isnan(), a[1], a[0])
    return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
            "neg": torch.neg, "exp": torch.exp, "sqrt": torch.sqrt}[expr.fn](*a)


def _functions(expr: Expr) -> set[str]:
    return {expr.fn} | {f for a in expr.args for f in _functions(a)} if isinstance(expr, Call) else set()


@pytest.mark.parametrize("fn", sorted(DECOMPOSITIONS))
def test_each_definition_is_torchs_function_in_float64(fn: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.tensor(SPECIALS, dtype=torch.float64),
                   torch.randn(4000, generator=gen, dtype=torch.float64) * torch.logspace(-3, 2.5, 4000)])
    expr = decompose(Call(fn, tuple(Load("x") for _ in range(arity(fn)))), keep=())
    assert _functions(expr) <= set(FUNCTIONS) - set(KEPT), f"{fn} = {expr} uses a non-primitive"
    got, want = _evaluate(expr, x), _oracle(fn)(x)
    assert torch.equal(got.isnan(), want.isnan()), f"{fn}: NaN where torch has none, or the reverse"
    finite = ~want.isnan()
    close = (got - want).abs() <= 4e-16 * want.abs() + torch.finfo(torch.float64).tiny
    bad = finite & ~(close | (got == want))  # got == want: infinities of the same sign
    assert not bad.any(), f"{fn}: {[(x[i].item(), got[i].item(), want[i].item()) for i in bad.nonzero()[:5, 0]]}"


def _all_composite_graph() -> yr.KernelGraph:
    """A graph whose plan lowers every composite graph op and the rms_norm row (rsqrt), fused and alone."""
    g = yr.new_kernel_graph()
    x = g.new_input((4, 33))
    for fn in sorted(set(DECOMPOSITIONS) & set(OPS)):
        g.mark_output(getattr(g, fn)(x))
    g.mark_output(g.rms_norm(g.sigmoid(x), (33,)))
    g.mark_output(g.matmul(g.rms_norm(x, (33,)), g.new_input((33, 5))))
    return g


def test_build_plan_leaves_no_composite_for_the_renderers() -> None:
    plan = build_plan(_all_composite_graph())
    assert set(plan_functions(plan)) <= set(FUNCTIONS)
    assert not set(plan_functions(plan)) & set(COMPOSITES)


def _spelling_tables() -> dict[str, set[str]]:
    """Every renderer's table of IR functions, each compute type (the renderers' own internals, on purpose)."""
    from yirage_backend_cpu.codegen import _spellings

    plan = build_plan(_all_composite_graph())
    tables: dict[str, set[str]] = {}
    for name in names():
        for ct in dialect(name).types:
            tables[f"cstyle-{name}-{ct}"] = set(CRenderer(plan, dialect(name)).table(ct))
    for ct in TL_TYPE:
        tables[f"triton-{ct}"] = set(TritonRenderer(plan).table(ct))
        tables[f"numba-{ct}"] = set(_spellings(ct))
    for is_float in (True, False):
        tables[f"torch_plan-{'float' if is_float else 'int'}"] = set(torch_plan._functions(is_float))
    return tables


def test_renderers_spell_primitives_only() -> None:
    for renderer, table in _spelling_tables().items():
        assert table <= set(FUNCTIONS), f"{renderer} spells {sorted(table - set(FUNCTIONS))}, which are no IR functions"
        spelled = sorted(table & set(COMPOSITES))
        assert not spelled, (f"{renderer} spells the composite(s) {spelled} itself; define them in "
                             "yirage/compiler/decompose.py only (DECOMPOSITIONS)")


def test_a_composite_reaching_a_renderer_is_named_with_the_pass_to_run() -> None:
    g = yr.new_kernel_graph()
    g.mark_output(g.sigmoid(g.new_input((4,))))
    plan = build_plan(g)
    raw = KernelPlan(plan.digest, plan.buffers, [Pointwise("k0", "out0", (4,), Call("sigmoid", (Load("in0"),)))],
                     plan.inputs, plan.outputs)
    with pytest.raises(UnsupportedExprError, match="composite IR function 'sigmoid'.*decompose_plan"):
        torch_plan.run_plan(raw, [torch.zeros(4)])
    with pytest.raises(UnsupportedExprError, match="composite IR function 'sigmoid'.*decompose_plan"):
        CRenderer(raw, dialect("opencl")).render()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return bool(((a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("backend", ["torch_plan", "cpu", "opencl"])
def test_kept_composites_decomposed_give_the_same_bits_as_their_helpers(backend: str) -> None:
    """What moving a KEPT composite to the decomposed side changes: the generated text, never a result bit."""
    g = yr.new_kernel_graph()
    inputs = []
    for dtype in (torch.float32, torch.float64):
        x = g.new_input((2, 67), dtype=str(dtype).removeprefix("torch."))
        inputs.append(torch.tensor((SPECIALS * 7)[:134], dtype=dtype).view(2, 67))
        for fn in sorted(set(KEPT) & set(DECOMPOSITIONS)):
            g.mark_output(getattr(g, fn)(g.add(x, x)))  # fused behind an add: no helper sees a plain load
    plan = build_plan(g)
    full = decompose_plan(plan, keep=())
    assert set(plan_functions(plan)) & set(KEPT) and not set(plan_functions(full)) & set(DECOMPOSITIONS)
    if backend == "torch_plan":
        kept, whole = torch_plan.run_plan(plan, inputs), torch_plan.run_plan(full, inputs)
    else:
        from yirage.backend.selection import resolve

        try:
            chosen = resolve(backend, need="kernel_graphs", dtypes={"float32", "float64"})
        except yr.YirageError as exc:
            pytest.skip(f"{backend} is not usable here: {exc}")
        kept, whole = chosen.compile(plan, g)(inputs), chosen.compile(full, g)(inputs)
    for index, (a, b) in enumerate(zip(kept, whole, strict=True)):
        assert _same_bits(a, b), f"output {index} on {backend}: {a} != {b}"


def test_a_composites_error_scale_comes_from_its_definition() -> None:
    """The float64 oracle's error scale of a composite graph op needs no rule of its own (magnitude.py)."""
    from yirage.reference.magnitude import graph_oracle
    from yirage.testing.oracle import assert_matches_reference

    g = yr.new_kernel_graph()
    x = g.new_input((3, 40))
    g.mark_output(g.mul(g.sigmoid(g.mul(x, x)), x))
    t = torch.linspace(-12, 12, 120, dtype=torch.float32).view(3, 40)
    (want,), (scale,) = graph_oracle(g, [t])
    x64 = t.double()
    assert torch.equal(want, torch.sigmoid(x64 * x64) * x64)
    assert bool((scale >= want.abs()).all()) and bool(scale.isfinite().all())
    assert_matches_reference(g, [t], "cpu")
