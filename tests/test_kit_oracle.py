"""The conformance kit's oracle can fail: per-element tolerances, honest sum scales, seeded random graphs."""

from __future__ import annotations

import inspect

import pytest
import torch

import yirage as yr
from yirage.reference.magnitude import graph_oracle
from yirage.testing import conformance, extremes
from yirage.testing.oracle import (
    DTYPE_TOLERANCE,
    assert_close,
    assert_matches_reference,
    assert_matches_torch,
    random_inputs,
)
from yirage.testing.random_graphs import seeded_graph


def _big_entry_case() -> tuple[yr.KernelGraph, torch.Tensor, torch.Tensor]:
    """relu of 64 values, one of them 9e4; the "backend" output is right there and 15 off everywhere else."""
    g = yr.new_kernel_graph()
    g.mark_output(g.relu(g.new_input((64,))))
    x = torch.rand(64, generator=torch.Generator().manual_seed(0)) + 1.0
    x[17] = 9e4
    wrong = x.clone()
    wrong[torch.arange(64) != 17] += 15.0
    return g, x, wrong


def _pretend_backend(monkeypatch: pytest.MonkeyPatch, outputs: list[torch.Tensor]) -> None:
    """graph.run returns ``outputs``: a backend that computes exactly these."""
    monkeypatch.setattr(yr.KernelGraph, "run", lambda self, inputs, backend=None: [o.clone() for o in outputs])


def test_one_big_entry_does_not_hide_63_wrong_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    g, x, wrong = _big_entry_case()
    _pretend_backend(monkeypatch, [x.clone()])
    assert_matches_reference(g, [x], "reference")  # the right answer passes
    assert_matches_torch(g, [x], "reference", torch.relu)
    _pretend_backend(monkeypatch, [wrong])
    with pytest.raises(AssertionError, match="63 of 64 elements differ"):
        assert_matches_reference(g, [x], "reference")
    with pytest.raises(AssertionError, match="63 of 64 elements differ"):
        assert_matches_torch(g, [x], "reference", torch.relu)


def test_a_sum_is_as_exact_as_its_terms_not_more_not_less() -> None:
    """A dot product that cancels to ~0: float32 rounding of the terms passes, a wrong sum does not."""
    a = torch.tensor([[1e3, -1e3, 0.5]], dtype=torch.float64)
    b = torch.tensor([[1.0], [1.0], [2e-3]], dtype=torch.float64)
    exact, terms = a @ b, a.abs() @ b.abs()  # 1e-3, from terms of 2e3
    rounded = (a.float() @ b.float()) + torch.tensor([[3e-5]])  # a few float32 ulps of the terms
    assert_close(rounded, exact, "float32", scale=terms)
    with pytest.raises(AssertionError, match="1 of 1 elements differ"):
        assert_close(rounded, exact, "float32")  # without the scale, 3e-5 on 1e-3 is far too much
    with pytest.raises(AssertionError, match="1 of 1 elements differ"):
        assert_close(exact.float() + 0.5, exact, "float32", scale=terms)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_per_dtype_tolerance_is_per_element(dtype: str) -> None:
    rtol, atol = DTYPE_TOLERANCE[dtype]
    want = torch.tensor([1e-3, 1.0, 1e3], dtype=torch.float64)
    assert_close(want.to(getattr(torch, dtype)), want, dtype)  # rounding to the dtype passes
    for index in range(3):
        off = want.clone()
        off[index] += 4 * (atol + rtol * abs(float(want[index])))
        with pytest.raises(AssertionError, match=rf"1 of 3 elements differ .*\[{index}\]"):
            assert_close(off.to(getattr(torch, dtype)), want, dtype)


def test_the_error_scale_of_a_graph_follows_its_sums() -> None:
    """graph_oracle's scales against torch written here: |A| @ |B| for a matmul, |a| + |b| for a difference."""
    g = yr.new_kernel_graph()
    a, w, r = g.new_input((3, 8)), g.new_input((8, 5)), g.new_input((3, 5))
    g.mark_output(g.matmul(a, w))
    g.mark_output(g.sub(g.matmul(a, w), r))
    xs = random_inputs(g, seed=3)
    (mm, diff), (s_mm, s_diff) = graph_oracle(g, xs)
    a64, w64, r64 = (t.double() for t in xs)
    torch.testing.assert_close(mm, a64 @ w64, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(s_mm, a64.abs() @ w64.abs(), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(diff, a64 @ w64 - r64, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(s_diff, a64.abs() @ w64.abs() + r64.abs(), rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("seed", [1, 4, 7])
def test_random_graph_check_catches_a_one_element_error(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The random-graph comparison passes the float64 answer rounded to the graph's dtype and fails
    when one element of the last output is off by 5% of its error scale plus a unit."""
    graph = seeded_graph(seed)
    inputs = random_inputs(graph, seed=seed, scale=0.7)
    refs, scales = graph_oracle(graph, inputs)
    rounded = [r.to(node.dtype.torch) for r, node in zip(refs, graph.output_nodes, strict=True)]
    _pretend_backend(monkeypatch, rounded)
    assert_matches_reference(graph, inputs, "reference", what=f"seed {seed}")
    broken = [r.clone() for r in refs]
    flat = broken[0].view(-1)
    flat[flat.numel() // 2] += 0.05 * float(scales[0].view(-1)[flat.numel() // 2]) + 1.0
    _pretend_backend(monkeypatch, [b.to(node.dtype.torch) for b, node in zip(broken, graph.output_nodes, strict=True)])
    with pytest.raises(AssertionError, match=rf"1 of {flat.numel()} elements differ"):
        assert_matches_reference(graph, inputs, "reference", what=f"seed {seed}")


def test_the_kit_never_holds_reference_to_run_reference() -> None:
    """Only the random-graph case uses the op-table oracle, and it skips on the reference backend."""
    for module in (conformance, extremes):
        source = inspect.getsource(module)
        assert "run_reference(" not in source and "graph_oracle(" not in source, module.__name__
    callers = [name for name, fn in vars(conformance).items()
               if name.startswith("test_") and callable(fn) and "assert_matches_reference(" in inspect.getsource(fn)]
    assert callers == ["test_random_graphs_match_the_reference"]
    with pytest.raises(pytest.skip.Exception, match="only oracle of a random graph is run_reference"):
        conformance.test_random_graphs_match_the_reference("reference", frozenset({"float32"}), True, 0)
