"""Kernel graphs on the cpu backend pick their thread count from measured call times (threads.AdaptiveThreads).

A fake clock makes the calls' durations exact: a run that is fast on all threads keeps them and tries the
others once every ``EXPLORE`` calls; when all threads turn slow (another process took a core), the launcher
moves to the count that measures faster, and moves back when the load goes; short calls are left alone. The
speed beside a real busy process is measured, not asserted: ``benchmark/kernel_graphs.py --busy``.
"""

from __future__ import annotations

import pytest
import torch

import yirage as yr

numba = pytest.importorskip("numba")
pytestmark = pytest.mark.skipif(not yr.is_backend_available("cpu"), reason="the cpu backend is not available here")

from yirage_backend_cpu.threads import AdaptiveThreads, adaptive_threads  # noqa: E402 - needs the cpu backend


class FakeRun:
    """Advances a fake clock by the time its thread count costs now; records the counts it ran on."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now, self.counts = cost, 0.0, []

    def __call__(self, inputs):  # noqa: ANN001, ANN204
        count = numba.get_num_threads()
        self.counts.append(count)
        self.now += self.cost[count]
        return [inputs]

    def clock(self) -> float:
        return self.now


def launcher(cost: dict[int, float]) -> tuple[AdaptiveThreads, FakeRun]:
    run = FakeRun(cost)
    adaptive = AdaptiveThreads(run, (2, 1))
    adaptive.clock = run.clock
    return adaptive, run


def test_the_faster_count_runs_and_the_other_is_explored_rarely() -> None:
    adaptive, run = launcher({2: 2.5e-3, 1: 3.6e-3})  # a quiet machine: both threads win
    before = numba.get_num_threads()
    for _ in range(200):
        assert adaptive("x") == ["x"]
    assert numba.get_num_threads() == before  # restored after every call
    assert run.counts[:3] == [2, 2, 2] and run.counts[3] == 1  # warm-up, then the other count measured once
    later = run.counts[4:]
    assert later.count(1) == len([c for c in range(5, 201) if c % AdaptiveThreads.EXPLORE == 0])
    assert later.count(2) == len(later) - later.count(1)


def test_a_load_that_comes_moves_the_launcher_to_fewer_threads_and_back_when_it_goes() -> None:
    adaptive, run = launcher({2: 2.5e-3, 1: 3.6e-3})
    for _ in range(50):
        adaptive("x")
    run.cost[2] = 6.4e-3  # another process took a core: the thread sharing it makes every call wait
    for _ in range(10):
        adaptive("x")
    busy = run.counts[-5:]
    assert busy == [1] * 5, run.counts[-12:]
    for _ in range(100):
        adaptive("x")
    assert run.counts[-100:].count(1) > 90
    run.cost[2] = 2.5e-3  # the load went
    for _ in range(2 * AdaptiveThreads.EXPLORE + 5):
        adaptive("x")
    assert run.counts[-5:] == [2] * 5, run.counts[-40:]


def test_short_calls_keep_numbas_threads_and_are_not_measured(monkeypatch) -> None:
    adaptive, run = launcher({2: 20e-6, 1: 30e-6})
    for _ in range(AdaptiveThreads.WARM):
        adaptive("x")
    assert adaptive.small
    sets: list[int] = []
    monkeypatch.setattr(numba, "set_num_threads", lambda n: sets.append(n))
    for _ in range(50):
        adaptive("x")
    assert sets == [] and len(run.counts) == AdaptiveThreads.WARM + 50


def test_an_applied_thread_count_caps_the_counts_tried_and_a_graph_still_computes_torchs_answer() -> None:
    assert adaptive_threads(lambda inputs: [], 1).counts == (1,)
    top = numba.config.NUMBA_NUM_THREADS
    assert adaptive_threads(lambda inputs: [], None).counts == tuple(dict.fromkeys((top, max(1, top // 2), 1)))
    g = yr.new_kernel_graph()
    x, w = g.new_input((2, 256)), g.new_input((256, 300))
    g.mark_output(g.matmul(g.rms_norm(x, (256,)), w))
    gen = torch.Generator().manual_seed(2)
    xs, ws = torch.randn(2, 256, generator=gen), torch.randn(256, 300, generator=gen)
    want = torch.nn.functional.rms_norm(xs.double(), (256,), eps=1e-6) @ ws.double()
    exe = g.compile("cpu")
    for _ in range(40):  # every count the launcher tries computes the same product
        torch.testing.assert_close(exe([xs, ws])[0].double(), want, rtol=1e-5, atol=1e-5)


def test_an_applied_cap_holds_on_every_call_a_callers_lower_setting_caps_and_failed_calls_are_not_measured() -> None:
    """Short calls stop being measured, but an applied configuration's count still applies to each of them; a
    caller who lowered numba's thread count keeps it; a call that raised leaves no estimate behind."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs numba with 2 or more threads")
    run = FakeRun({1: 20e-6, 2: 10e-6})
    capped = adaptive_threads(run, 1)
    capped.clock = run.clock
    for _ in range(AdaptiveThreads.WARM + 20):
        capped("x")
    assert capped.small and set(run.counts) == {1}  # short calls, still on the applied count
    before = numba.get_num_threads()
    run = FakeRun({1: 3e-3, 2: 2e-3})
    free = AdaptiveThreads(run, (2, 1))
    free.clock = run.clock
    numba.set_num_threads(1)
    try:
        for _ in range(10):
            free("x")
        assert set(run.counts) == {1} and numba.get_num_threads() == 1
    finally:
        numba.set_num_threads(before)

    def failing(inputs):  # noqa: ANN001, ANN202
        raise ValueError("bad input")

    broken = AdaptiveThreads(failing, (2, 1))
    for _ in range(AdaptiveThreads.WARM + 2):
        with pytest.raises(ValueError, match="bad input"):
            broken("x")
    assert broken.estimate == {2: None, 1: None} and not broken.small and numba.get_num_threads() == before
