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
    """A planted broken schedule: every plan but the default (fusion and schedule) computes a slightly wrong answer."""
    real = superopt._compile

    def planted(graph, backend, policy, plan=None):  # noqa: ANN001, ANN202
        exe = real(graph, backend, policy, plan)
        if policy == DEFAULT_POLICY and (plan is None or not plan.schedule):
            return exe
        return lambda inputs: [o * 1.001 for o in exe(inputs)]

    monkeypatch.setattr(superopt, "_compile", planted)
    timed = []
    real_time = superopt._time
    monkeypatch.setattr(superopt, "_time", lambda verified, *a: timed.append([c.trial.policy for c in verified])
                        or real_time(verified, *a))
    best = mlp_graph().superoptimize(profile_iters=2, rounds=1, warmup_iters=0)
    rejected = [t for t in best.report.trials if not t.verified]
    assert len(rejected) == len(best.report.trials) - 1 and all("differ" in t.error for t in rejected)
    assert timed[0] == [DEFAULT_POLICY.name] and best.report.winner == DEFAULT_POLICY.name


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


def test_a_planted_wrong_knob_value_is_rejected_and_the_knobs_winner_is_cached_with_its_schedule(cache,
                                                                                                 monkeypatch) -> None:
    """A backend declares a knob whose one value computes a wrong answer: it is never timed or chosen; the legal
    knobs are searched, and the cache entry holds the winning schedule (re-searched once it is no longer legal)."""
    from yirage.backend.selection import registry
    from yirage.compiler.schedule import Knob, choice

    cpu = registry().get("cpu")
    real_knobs, real_compile = type(cpu).schedule_knobs, type(cpu).compile
    monkeypatch.setattr(type(cpu), "schedule_knobs",
                        lambda self, plan: [*real_knobs(self, plan), Knob(plan.kernels[0].name, "planted", (0, 1))])

    def compile_(self, plan, graph):  # noqa: ANN001, ANN202
        run = real_compile(self, plan, graph)
        broken = choice(plan, plan.kernels[0].name, "planted", 0) == 1
        return (lambda inputs: [o * 1.01 + 0.01 for o in run(inputs)]) if broken else run

    monkeypatch.setattr(type(cpu), "compile", compile_)
    best = mlp_graph().superoptimize(profile_iters=2, rounds=1, warmup_iters=0)
    planted = [t for t in best.report.trials if "planted=1" in t.policy]
    assert len(planted) == 1 and not planted[0].verified and "differ" in planted[0].error, str(best.report)
    assert planted[0].median_us is None and "planted" not in best.report.winner
    strategy = [t for t in best.report.trials if "strategy=" in t.policy and "planted=1" not in t.policy]
    assert strategy and all(t.verified and t.median_us is not None for t in strategy), str(best.report)
    x = _inputs()
    torch.testing.assert_close(best(x)[0].double(), expected(*x), rtol=1e-4, atol=1e-5)
    (entry,) = (cache / "superopt").glob("*.json")
    doc = json.loads(entry.read_text())
    assert doc["winner"] == best.report.winner and doc["schedule"] == best.report.schedule
    doc["schedule"] = {"k0": {"strategy": "no-such-strategy"}}
    entry.write_text(json.dumps(doc))
    again = mlp_graph().superoptimize(profile_iters=2, rounds=1, warmup_iters=0)
    assert not again.report.from_cache


def test_knobs_a_backend_gets_wrong_are_named() -> None:
    from yirage.compiler.lower import build_plan
    from yirage.compiler.schedule import Knob, ScheduleError, check_knobs, with_schedule

    plan = build_plan(mlp_graph())
    name = plan.kernels[0].name
    with pytest.raises(ScheduleError, match="no kernel 'k9'"):
        check_knobs([Knob("k9", "x", (1, 2))], plan, "fake")
    with pytest.raises(ScheduleError, match="two or more"):
        check_knobs([Knob(name, "x", (1,))], plan, "fake")
    with pytest.raises(ScheduleError, match="distinct str, int or bool"):
        check_knobs([Knob(name, "x", (1.5, 2.5))], plan, "fake")
    with pytest.raises(ScheduleError, match="declared twice"):
        check_knobs([Knob(name, "x", (1, 2)), Knob(name, "x", (1, 2))], plan, "fake")
    with pytest.raises(ScheduleError, match="not a sequence"):
        check_knobs(3, plan, "fake")
    from yirage.compiler.schedule import legal

    knobs = [Knob(name, "x", (1, 3)), Knob(name, "y", (False, True))]
    assert legal(knobs, {name: {"x": 3, "y": True}}) and not legal(knobs, {name: {"x": True}})  # JSON true is not 1
    assert not legal(knobs, {name: {"y": 1}}) and not legal(knobs, {name: {"z": 1}})
    assert with_schedule(plan, {name: {"x": 1}}).digest != with_schedule(plan, {name: {"x": "1"}}).digest
    scheduled = with_schedule(plan, {name: {"x": 2}})
    assert scheduled.digest != plan.digest and scheduled.schedule == {name: {"x": 2}} and not plan.schedule
    assert with_schedule(plan, {}) is plan and f"{name}.x=2" in str(scheduled)


def test_every_cpu_knob_value_computes_the_graph(cache) -> None:
    """cpu's knobs (backends/cpu/.../knobs.py), every value: a row-major B of 5 rows (BLAS picked, split-K
    offered), a pre-transposed B of 3 rows (dot products picked, BLAS offered) and rows near the parallel
    threshold, against torch in float64."""
    from yirage.backend.selection import registry
    from yirage.compiler.lower import build_plan
    from yirage.compiler.schedule import check_knobs, with_schedule

    cpu = registry().get("cpu")
    g = yr.new_kernel_graph()
    x, w, v = g.new_input((5, 96)), g.new_input((96, 40)), g.new_input((3, 70))
    wt = g.new_input((70, 40), strides=(1, 70))  # (K, N) viewed from a (N, K) weight: dot products' layout
    g.mark_output(g.softmax(g.matmul(g.silu(x), w), -1))
    g.mark_output(g.matmul(v, wt))
    big = g.new_input((64, 2000))
    g.mark_output(g.softmax(big, -1))
    q, kc, vc, lengths = g.new_input((2, 6, 16)), g.new_input((2, 2, 9, 16)), g.new_input((2, 2, 9, 16)), \
        g.new_input((2,), dtype=yr.int64)
    g.mark_output(g.attention(q, kc, vc, lengths))
    plan = build_plan(g)
    knobs = check_knobs(cpu.schedule_knobs(plan), plan, "cpu")
    values = sorted((k.name, k.values if k.name == "strategy" else tuple(sorted(k.values))) for k in knobs)
    assert values == [("heads_per_pass", (1, 3)), ("parallel", (False, True)), ("strategy", ("blas", "split_k")),
                      ("strategy", ("dot", "blas"))]  # the picks of the other two depend on the thread count
    gen = torch.Generator().manual_seed(8)
    xs, ws = torch.randn(5, 96, generator=gen), torch.randn(96, 40, generator=gen)
    vs = torch.randn(3, 70, generator=gen)
    wts, bigs = torch.randn(40, 70, generator=gen).t(), torch.randn(64, 2000, generator=gen) * 3
    qs, ks, vcs = (torch.randn(*shape, generator=gen) for shape in ((2, 6, 16), (2, 2, 9, 16), (2, 2, 9, 16)))
    ns = torch.tensor([9, 4])
    att = [F.scaled_dot_product_attention(qs[b, :, None].double(), ks[b, :, :n].repeat_interleave(3, 0).double(),
                                          vcs[b, :, :n].repeat_interleave(3, 0).double())[:, 0] for b, n in
           enumerate(ns.tolist())]
    want = [(F.silu(xs.double()) @ ws.double()).softmax(-1), vs.double() @ wts.double(), bigs.double().softmax(-1),
            torch.stack(att)]
    for column in (0, 1):
        schedule = {k.kernel: {k.name: k.values[column]} for k in knobs}
        got = cpu.compile(with_schedule(plan, schedule), g)([xs, ws, vs, wts, bigs, qs, ks, vcs, ns])
        for out, ref in zip(got, want, strict=True):
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6, msg=str(schedule))


def test_a_fast_candidate_is_timed_in_batches_long_enough_to_see_past_the_noise(monkeypatch) -> None:
    """On a fake clock: a 10 us candidate gets BATCH_SECONDS / 10 us calls per batch, a 5 ms one profile_iters."""
    from yirage.backend.selection import registry

    now = [0.0]
    monkeypatch.setattr(superopt.time, "perf_counter", lambda: now[0])
    counts = {"fast": 0, "slow": 0}

    def exe(name: str, seconds: float):  # noqa: ANN202
        def call(inputs):  # noqa: ANN001, ANN202
            counts[name] += 1
            now[0] += seconds
        return call

    cands = [superopt._Candidate(DEFAULT_POLICY, {}, None, exe(name, sec), superopt.Trial(name, 1))
             for name, sec in (("slow", 5e-3), ("fast", 10e-6))]
    best = superopt._time(cands, [], registry().get("cpu"), 0, 3, 2, float("inf"))
    per_batch = round(superopt.BATCH_SECONDS / 10e-6)  # (+1 where the fake clock's float sum rounds up)
    assert counts["slow"] == 1 + 2 * 3 and counts["fast"] in (1 + 2 * per_batch, 1 + 2 * (per_batch + 1))
    assert best.trial.policy == "fast" and cands[1].trial.median_us == pytest.approx(10.0)


def test_the_benchmark_times_every_implementation_of_a_graph(cache) -> None:
    """benchmark/superoptimize.py's row for one small graph: default, superoptimized, torch eager and
    torch.compile each checked against torch in float64 and timed (a smoke run of the script's own code)."""
    import importlib.util

    bench = Path(__file__).resolve().parent.parent / "benchmark"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("superoptimize_bench", bench / "superoptimize.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        case = next(c for c in module.cases(True) if c.name == "residual_norm")
        row = module.run(case, "cpu", torch.device("cpu"), calls=3, budget=5.0, fresh=True)
    finally:
        sys.path.remove(str(bench))
    assert not [k for k in row if k.endswith("error")], row
    assert {"default_us", "superopt_us", "torch_us"} <= row.keys() and row["winner"], row
    assert row["same_program"] == (row["winner"] == "fuse-all"), row  # the default plan, no knob: one program
    assert "torch.compile_us" in row or "did not compile" in row.get("torch.compile", ""), row


def test_a_winner_that_does_not_beat_the_default_when_timed_again_is_dropped(monkeypatch) -> None:
    """On a fake clock: a knob value fast only while the search times it (noise) loses the confirmation against
    the default, which is kept and the report says so; one fast both times is kept."""
    from yirage.backend.selection import registry

    now = [0.0]
    monkeypatch.setattr(superopt.time, "perf_counter", lambda: now[0])

    def exe(seconds):  # noqa: ANN001, ANN202  (seconds: the call's duration, read when called)
        def call(inputs):  # noqa: ANN001, ANN202
            now[0] += seconds()
        return call

    for fast_again, kept in ((False, "default"), (True, "rival")):
        phase = ["search"]
        default = superopt._Candidate(DEFAULT_POLICY, {}, None, exe(lambda: 100e-6), superopt.Trial("default", 1))
        rival = superopt._Candidate(DEFAULT_POLICY, {"k0": {"x": 1}}, None,
                                    exe(lambda p=phase, f=fast_again: 50e-6 if p[0] == "search" or f else 120e-6),
                                    superopt.Trial("rival", 1))
        report = superopt.Report("g", "cpu", None, "default")
        search = superopt._Search(None, registry().get("cpu"), report, [], float("inf"), (0, 3, 3))
        assert search.fastest([default, rival]) is rival
        phase[0] = "again"
        best = search.confirm(default, rival)
        assert best.trial.policy == kept
        assert ("not when timed again" in report.note) == (kept == "default")
