"""Fusion decisions: which patterns become one kernel, and what the IR says."""

from __future__ import annotations

import yirage as yr
from yirage.compiler.fusion import FusionPolicy
from yirage.compiler.kernel_ir import Attention, Call, Load, Matmul, Pointwise, Row, Var
from yirage.compiler.lower import build_plan


def kinds(g: yr.KernelGraph) -> list[str]:
    return [type(k).__name__ for k in build_plan(g).kernels]


def test_rmsnorm_weight_matmul_silu_is_one_kernel_dividing_after_the_matmul() -> None:
    g = yr.new_kernel_graph()
    x, gw, w = g.new_input((4, 64)), g.new_input((64,)), g.new_input((64, 32), strides=(1, 64))
    g.mark_output(g.silu(g.matmul(g.mul(g.rms_norm(x, (64,)), gw), w)))
    (k,) = build_plan(g).kernels
    assert isinstance(k, Matmul)
    assert k.a == Call("mul", (Load("in0"), Load("in1")))  # the prologue no longer normalizes
    assert k.row_scale == Load("in0")  # sum of squares of x, taken in the same pass
    assert k.epilogue == Call("silu", (Call("mul", (Var("acc"), Var("scale"))),))


def test_swiglu_with_residual_is_one_pointwise_kernel() -> None:
    g = yr.new_kernel_graph()
    a, b, r = (g.new_input((2, 16)) for _ in range(3))
    g.mark_output(g.add(g.mul(g.silu(a), b), r))
    (k,) = build_plan(g).kernels
    assert isinstance(k, Pointwise)
    assert str(k.expr) == "add(mul(silu(in0), in1), in2)"


def test_matmul_residual_is_an_epilogue() -> None:
    g = yr.new_kernel_graph()
    x, w, r = g.new_input((2, 8)), g.new_input((8, 4)), g.new_input((2, 4))
    g.mark_output(g.add(g.matmul(x, w), r))
    (k,) = build_plan(g).kernels
    assert isinstance(k, Matmul) and k.epilogue == Call("add", (Var("acc"), Load("in2")))


def test_rmsnorm_does_not_fuse_through_a_non_multiplicative_op() -> None:
    g = yr.new_kernel_graph()
    x, c, w = g.new_input((4, 64)), g.new_input((64,)), g.new_input((64, 8))
    g.mark_output(g.matmul(g.add(g.rms_norm(x, (64,)), c), w))
    assert kinds(g) == ["Row", "Matmul"]


def test_a_shared_intermediate_is_materialized_once() -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((4, 64))
    n = g.rms_norm(x, (64,))
    g.mark_output(g.exp(n))
    g.mark_output(g.relu(n))
    plan = build_plan(g)
    assert [type(k).__name__ for k in plan.kernels] == ["Row", "Pointwise", "Pointwise"]
    assert sum(1 for b in plan.buffers.values() if b.role == "temp") == 1


def test_softmax_fuses_its_prologue_and_epilogue() -> None:
    g = yr.new_kernel_graph()
    x, y = g.new_input((4, 10)), g.new_input((4, 10))
    g.mark_output(g.mul(g.softmax(g.add(x, y), -1), y))
    (k,) = build_plan(g).kernels
    assert isinstance(k, Row) and [r.combine for r in k.reductions] == ["max", "sum"]


def test_two_matmuls_into_one_add_use_one_epilogue() -> None:
    g = yr.new_kernel_graph()
    x, w1, w2 = g.new_input((2, 8)), g.new_input((8, 4)), g.new_input((8, 4))
    g.mark_output(g.add(g.matmul(x, w1), g.matmul(x, w2)))
    assert kinds(g) == ["Matmul", "Matmul"]


def test_rotary_reads_its_rotated_operand_from_memory() -> None:
    g = yr.new_kernel_graph()
    x, cos, sin = g.new_input((2, 8)), g.new_input((2, 8)), g.new_input((2, 8))
    g.mark_output(g.rotary(g.exp(x), cos, sin))
    assert kinds(g) == ["Pointwise", "Pointwise"]


def test_dead_code_is_not_computed() -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((3,))
    g.exp(x)
    g.mark_output(g.relu(x))
    assert kinds(g) == ["Pointwise"]


def test_an_output_in_the_middle_of_a_chain_is_stored() -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((3,))
    y = g.exp(x)
    g.mark_output(y)
    g.mark_output(g.relu(y))
    plan = build_plan(g)
    assert len(plan.kernels) == 2 and plan.outputs == ["out0", "out1"]


def test_the_plan_prints_its_kernel_ir() -> None:
    g = yr.new_kernel_graph()
    x, w = g.new_input((4, 64)), g.new_input((64, 32), strides=(1, 64))
    g.mark_output(g.matmul(g.rms_norm(x, (64,)), w))
    text = str(build_plan(g))
    assert "kernel k0 (matmul) -> out0" in text
    assert "$scale[b, m] = rsqrt(sum_k square(in0) / 64 + 1e-06)" in text
    assert "out0[b, m, n] = mul($acc, $scale)" in text
    assert "buffer in1: input (64, 32) float32 strides=(1, 64)" in text


def test_rotary_never_fuses_into_row_ops_or_matmuls() -> None:
    g = yr.new_kernel_graph()
    x, cos, sin = (g.new_input((2, 8)) for _ in range(3))
    g.mark_output(g.softmax(g.rotary(x, cos, sin), -1))
    assert kinds(g) == ["Pointwise", "Row"]
    g = yr.new_kernel_graph()
    x, cos, sin, w = g.new_input((2, 8)), g.new_input((2, 8)), g.new_input((2, 8)), g.new_input((8, 8))
    g.mark_output(g.rotary(g.matmul(x, w), cos, sin))
    assert kinds(g) == ["Matmul", "Pointwise"]


def _qk_norm(keys_also_output: bool = False, key_prologue: bool = False, gain: tuple[int, ...] | None = None,
             gain_first: bool = False) -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((2, 8, 16)), g.new_input((2, 2, 5, 16)), g.new_input((2, 2, 5, 16))
    normed = g.rms_norm(g.mul(k, k) if key_prologue else k, (16,), eps=1e-5)
    keys = normed
    if gain is not None:
        w = g.new_input(gain)
        keys = g.mul(w, normed) if gain_first else g.mul(normed, w)
    g.mark_output(g.attention(g.rms_norm(q, (16,)), keys, v))
    if keys_also_output:
        g.mark_output(normed)
    return g


def test_the_query_and_key_rmsnorms_fuse_into_attention() -> None:
    (att,) = build_plan(_qk_norm()).kernels
    assert isinstance(att, Attention)
    assert (att.q, att.k, att.v, att.q_eps, att.k_eps) == ("in0", "in1", "in2", 1e-6, 1e-5)  # read as they are


def test_the_keys_rmsnorm_stays_apart_where_it_is_also_an_output_or_the_policy_says_so() -> None:
    kernels = build_plan(_qk_norm(keys_also_output=True)).kernels
    assert [type(k).__name__ for k in kernels] == ["Row", "Attention"]
    assert (kernels[-1].k_eps, kernels[-1].q_eps) == (None, 1e-6)
    kernels = build_plan(_qk_norm(), FusionPolicy(rms_scale=False)).kernels
    assert [type(k).__name__ for k in kernels] == ["Row", "Row", "Attention"]
    assert (kernels[-1].k_eps, kernels[-1].q_eps) == (None, None)


def test_a_norm_read_as_both_keys_and_values_is_kept_in_memory() -> None:
    g = yr.new_kernel_graph()
    q, k = g.new_input((2, 2, 16)), g.new_input((2, 2, 3, 16))
    n = g.rms_norm(k, (16,))
    g.mark_output(g.attention(q, n, n))
    row, att = build_plan(g).kernels
    assert isinstance(row, Row) and (att.k, att.v, att.k_eps) == (row.out, row.out, None)


def test_what_feeds_a_fused_key_norm_is_materialized_not_inlined_into_attention() -> None:
    kernels = build_plan(_qk_norm(key_prologue=True)).kernels
    assert [type(k).__name__ for k in kernels] == ["Pointwise", "Attention"]
    assert kernels[-1].k == kernels[0].out and kernels[-1].k_eps == 1e-5


def test_a_gain_over_the_head_dim_after_the_keys_norm_fuses_too_in_either_operand_order() -> None:
    for gain, first in (((16,), False), ((16,), True), ((1, 1, 1, 16), False)):
        (att,) = build_plan(_qk_norm(gain=gain, gain_first=first)).kernels
        assert isinstance(att, Attention)
        assert (att.k, att.k_eps, att.k_gain, att.q_gain) == ("in1", 1e-5, "in3", None)


def test_a_gain_is_not_fused_where_it_is_not_over_the_head_dim_alone_or_the_norm_is_read_elsewhere() -> None:
    kernels = build_plan(_qk_norm(gain=(2, 2, 5, 16))).kernels  # a per-element factor: the norm's epilogue
    assert [type(k).__name__ for k in kernels] == ["Row", "Attention"]
    assert kernels[-1].k_eps is None and kernels[-1].k_gain is None
    kernels = build_plan(_qk_norm(gain=(16,), keys_also_output=True)).kernels
    assert [type(k).__name__ for k in kernels] == ["Row", "Pointwise", "Attention"]
    assert kernels[-1].k_eps is None and kernels[-1].k_gain is None
    kernels = build_plan(_qk_norm(gain=(16,)), FusionPolicy(rms_scale=False)).kernels
    assert kernels[-1].k_eps is None and kernels[-1].k_gain is None


def test_the_querys_norm_and_its_gain_fuse_beside_the_keys() -> None:
    g = yr.new_kernel_graph()
    q, k, v, wq, wk = (g.new_input(d) for d in ((2, 8, 16), (2, 2, 5, 16), (2, 2, 5, 16), (16,), (1, 16)))
    g.mark_output(g.attention(g.mul(wq, g.rms_norm(q, (16,), eps=1e-4)), g.mul(g.rms_norm(k, (16,)), wk), v))
    (att,) = build_plan(g).kernels
    assert (att.q, att.q_eps, att.q_gain, att.k, att.k_gain) == ("in0", 1e-4, "in3", "in1", "in4")
