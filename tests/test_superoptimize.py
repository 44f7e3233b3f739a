"""g.superoptimize(): every candidate verified against a float64 oracle before it is timed; the winner cached.

Timing decides only among verified candidates, so the tests check what must hold whatever the machine's speed:
the candidates are the distinct fusion plans, a planted wrong candidate is rejected and never chosen, the result
matches torch, a second search (another process) reads the winner from the cache without compiling the others, a
damaged entry is searched again, ``YIRAGE_SUPEROPTIMIZE=0`` turns the search off, and the report names each
candidate.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import yirage as yr
from yirage import superopt
from yirage.compiler.fusion import DEFAULT_POLICY


def mlp_graph(backend: str = "cpu") -> yr.KernelGraph:
    """RMSNorm -> linear -> SiLU + residual: four fusion choices apply."""
    g = yr.new_kernel_graph(backend=backend)
    x, gamma, w, r = g.new_input((4, 64)), g.new_input((64,)), g.new_input((64, 32)), g.new_input((4, 32))
    g.mark_output(g.add(g.silu(g.matmul(g.mul(g.rms_norm(x, (64,)), gamma), w)), r))
    return g


def expected(x, gamma, w, r):  # noqa: ANN001, ANN201
    return F.silu((F.rms_norm(x.double(), (64,), eps=1e-6) * gamma.double()) @ w.double()) + r.double()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(superopt.ENV, raising=False)
    return tmp_path / "cache"


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(4, 64, generator=gen), torch.rand(64, generator=gen) + 0.5,
            torch.randn(64, 32, generator=gen) * 0.1, torch.randn(4, 32, generator=gen)]


def test_the_winner_is_a_verified_plan_and_matches_torch(cache) -> None:
    g = mlp_graph()
    best = g.superoptimize(profile_iters=3, rounds=2, warmup_iters=1)
    report = best.report
    assert len(report.trials) >= 4 and report.trials[0].policy == DEFAULT_POLICY.name
    assert len({t.policy for t in report.trials}) == len(report.trials)
    assert all(t.verified and t.median_us is not None for t in report.trials), str(report)
    assert report.winner in {t.policy for t in report.trials} and not report.from_cache
    x = _inputs()
    torch.testing.assert_close(best(inputs=x)[0].double(), expected(*x), rtol=1e-4, atol=1e-5)
    assert report.winner in str(report) and "kernel(s)" in str(report)


def test_a_wrong_candidate_is_rejected_before_timing_and_never_chosen(cache, monkeypatch) -> None:
    """A planted broken schedule: every plan but the default computes a slightly wrong answer."""
    real = superopt._compile

    def planted(graph, backend, policy, plan=None):  # noqa: ANN001, ANN202
        exe = real(graph, backend, policy, plan)
        if policy == DEFAULT_POLICY:
            return exe
        return lambda inputs: [o * 1.001 for o in exe(inputs)]

    monkeypatch.setattr(superopt, "_compile", planted)
    timed = []
    real_time = superopt._time
    monkeypatch.setattr(superopt, "_time", lambda verified, *a: timed.append([p.name for p, *_ in verified])
                        or real_time(verified, *a))
    best = mlp_graph().superoptimize(profile_iters=2, rounds=1, warmup_iters=0)
    rejected = [t for t in best.report.trials if not t.verified]
    assert len(rejected) == len(best.report.trials) - 1 and all("differ" in t.error for t in rejected)
    assert timed == [[DEFAULT_POLICY.name]] and best.report.winner == DEFAULT_POLICY.name


def test_a_second_process_reads_the_winner_from_the_cache_and_a_damaged_entry_is_searched_again(cache) -> None:
    first = mlp_graph().superoptimize(profile_iters=2, rounds=1, warmup_iters=0)
    (entry,) = (cache / "superopt").glob("*.json")
    assert json.loads(entry.read_text())["winner"] == first.report.winner and entry.stat().st_mode & 0o077 == 0
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from yirage import superopt
        from test_superoptimize import mlp_graph
        superopt._candidates = lambda *a: (_ for _ in ()).throw(AssertionError("searched again"))
        best = mlp_graph().superoptimize()
        print("cached", best.report.from_cache, best.report.winner)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "YIRAGE_CACHE_DIR": str(cache)})
    assert f"cached True {first.report.winner}" in done.stdout, done.stdout + done.stderr[-2000:]
    entry.write_text("{not json")
    again = mlp_graph().superoptimize(profile_iters=2, rounds=1, warmup_iters=0)
    assert not again.report.from_cache and json.loads(entry.read_text())["winner"] == again.report.winner


def test_the_search_can_be_turned_off_and_bad_arguments_are_named(cache, monkeypatch) -> None:
    monkeypatch.setenv(superopt.ENV, "0")
    best = mlp_graph().superoptimize()
    assert best.report.winner == DEFAULT_POLICY.name and "search off" in best.report.note
    assert not (cache / "superopt").exists()
    with pytest.raises(superopt.SuperoptimizeError, match="config='fast'"):
        mlp_graph().superoptimize(config="fast")
    with pytest.raises(superopt.SuperoptimizeError, match="profile_iters=0"):
        mlp_graph().superoptimize(profile_iters=0)


def test_every_fusion_policy_gives_a_plan_equal_to_the_oracle_on_the_reference_backend() -> None:
    """The policies only move buffers between kernels: each plan of the MLP graph computes the same function."""
    from yirage.compiler.fusion import FusionPolicy

    g = mlp_graph()
    x = _inputs()
    for policy in FusionPolicy.all():
        exe = superopt._compile(g.copy(), yr.backend.selection.registry().get("cpu"), policy)
        torch.testing.assert_close(exe(x)[0].double(), expected(*x), rtol=1e-4, atol=1e-5, msg=policy.name)
