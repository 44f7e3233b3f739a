"""The kit's random graphs: reproducible from their seed, valid inputs, and the coverage counter is right."""

from __future__ import annotations

import torch

import yirage as yr
from yirage.testing.oracle import random_inputs
from yirage.testing.random_graphs import plan_features, seeded_graph


def test_a_seed_always_builds_the_same_graph_and_inputs() -> None:
    for seed in (0, 5, 39):
        first, again = seeded_graph(seed), seeded_graph(seed)
        assert first.digest == again.digest and str(first) == str(again)
        for a, b in zip(random_inputs(first, seed=seed), random_inputs(again, seed=seed), strict=True):
            assert torch.equal(a, b)
    assert len({seeded_graph(seed).digest for seed in range(20)}) == 20


def test_integer_inputs_are_valid_ids_and_lengths() -> None:
    g = yr.new_kernel_graph()
    ids, table = g.new_input((3, 40), dtype=yr.int64), g.new_input((5, 8))
    q, k, v = g.new_input((3, 2, 8)), g.new_input((3, 1, 6, 8)), g.new_input((3, 1, 6, 8))
    lengths = g.new_input((3,), dtype=yr.int32)
    g.mark_output(g.embedding(ids, table))
    g.mark_output(g.attention(q, k, v, lengths))
    for seed in range(5):
        xs = random_inputs(g, seed=seed)
        assert 0 <= int(xs[0].min()) and int(xs[0].max()) < 5, f"seed {seed}: ids {xs[0].unique().tolist()}"
        assert 1 <= int(xs[5].min()) and int(xs[5].max()) <= 6, f"seed {seed}: lengths {xs[5].tolist()}"
        g.run(xs, backend="reference")  # accepted


def test_plan_features_counts_what_the_plan_fused() -> None:
    g = yr.new_kernel_graph()
    x, gamma, w = g.new_input((4, 16), dtype=yr.bfloat16), g.new_input((16,), dtype=yr.bfloat16), \
        g.new_input((16, 8), dtype=yr.bfloat16)
    r = g.new_input((4, 8), dtype=yr.bfloat16)
    g.mark_output(g.add(g.matmul(g.mul(g.rms_norm(x, (16,)), gamma), w), r))  # row scale, prologue, epilogue
    cos, sin = g.new_input((4, 8), dtype=yr.bfloat16), g.new_input((4, 8), dtype=yr.bfloat16)
    g.mark_output(g.rotary(g.sqrt(g.exp(r)), cos, sin))
    seen = plan_features(g)
    assert seen["rms_norm -> matmul row scale"] == 1 and seen["matmul prologue"] == 1
    assert seen["matmul epilogue"] == 1 and seen["rotary"] == 1 and seen["sqrt"] == 1 and seen["bfloat16"] == 1
    plain = yr.new_kernel_graph()
    plain.mark_output(plain.matmul(plain.new_input((2, 4)), plain.new_input((4, 3))))
    plain.exp(plain.new_input((3,)))  # dead: not computed, not counted
    assert plan_features(plain) == {"matmul": 1, "float32": 1}
