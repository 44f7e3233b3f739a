"""Idle PersistentKernel threads give their core away on a busy machine (spin, then yield, then sleep).

The wait primitives are checked for what they promise (a sleep sleeps and burns no CPU time); the decode loop
is checked under CPU hogs (more runnable threads than cores) against transformers: backing off must not change
a single token or logit beyond the usual tolerance. No speed is asserted here: benchmark/llm_decode.py --busy N
measures it against llama.cpp and HF eager in one run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine

transformers = pytest.importorskip("transformers")
numba = pytest.importorskip("numba")

from llm_oracle import Reference, assert_decode_matches, zoo_factory  # noqa: E402 - needs transformers, checked just above

pytestmark = pytest.mark.skipif(not yr.is_backend_available("cpu"), reason="the cpu backend is not available here")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


def test_sleep_gives_the_core_away_and_yield_and_pause_return() -> None:
    from yirage_backend_cpu.backoff import cpu_relax, os_yield, sleep_us

    @numba.njit(nogil=True)
    def wait(rounds: int, micros: int) -> int:
        for _ in range(rounds):
            cpu_relax()
            os_yield()
        sleep_us(micros)
        return rounds

    wait(1, 1)  # compile outside the measured window
    wall, cpu = time.perf_counter(), time.thread_time()
    assert wait(1000, 20_000) == 1000
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= 0.019, f"usleep(20 ms) returned after {wall * 1e3:.2f} ms"
    assert cpu < wall / 2, f"the sleep burned {cpu * 1e3:.1f} ms of CPU time in {wall * 1e3:.1f} ms: it spun"


def test_decode_under_cpu_hogs_matches_transformers(zoo, monkeypatch) -> None:
    """Under 2 CPU hogs the step-by-step decode keeps transformers' tokens and logits, and every run reports its
    own backoff counts: stale counts planted in the runtime's counter slots before each run are gone after it, and
    no run counts more sleeps (each a usleep of SLEEP_US) or yields (each a system call, well over 10 ns) than its
    threads had time for. Whether a run waits long enough to yield at all is up to the scheduler: the next test
    forces a long wait and asserts that it is counted."""
    from yirage_backend_cpu.backoff import SLEEP_US
    from yirage_backend_cpu.pk_runtime import CPUPersistentRuntime
    from yirage_backend_cpu.pk_team import SLEEPS, YIELDS

    runs = []
    real_run = CPUPersistentRuntime.run

    def run(self, max_new_tokens=None):
        self.flags[YIELDS] = self.flags[SLEEPS] = 10**12  # a previous run's counts: this run must not report them
        start = time.perf_counter()
        try:
            return real_run(self, max_new_tokens)
        finally:
            runs.append((time.perf_counter() - start, dict(self.last_backoff), self.effective()[0]))

    monkeypatch.setattr(CPUPersistentRuntime, "run", run)
    model = zoo("llama-gqa")
    steps = 6  # a prefix of the reference continuation: enough steps to wait, short under the hogs
    ref = model.reference
    reference = Reference(ref.ids, ref.tokens[:, :steps], ref.logits[:, :steps])
    engine = InferEngine(model.path, backend="cpu", num_workers=2, num_local_schedulers=1)
    config = GenerationConfig(max_new_tokens=steps, eos_token_id=(), output_logits=True)
    engine.generate(ref.ids, GenerationConfig(max_new_tokens=2, eos_token_id=()))  # compile first
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.2)  # let the hogs take the cores
        result = engine.generate(ref.ids, config)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=30)
    assert_decode_matches(reference, result.tokens, result.logits, label=f"{model.label} under 2 CPU hogs")
    assert len(runs) >= steps - 1  # output_logits: one run per decode step
    for wall, backoff, threads in runs:
        print(f"run of {wall * 1e3:.2f} ms on {threads} threads: idle threads yielded {backoff['yields']} and "
              f"slept {backoff['sleeps']} times")
        assert set(backoff) == {"yields", "sleeps"} and min(backoff.values()) >= 0, backoff
        assert backoff["sleeps"] * SLEEP_US * 1e-6 <= threads * wall, (backoff, wall, threads)
        assert backoff["yields"] * 1e-8 <= threads * wall, (backoff, wall, threads)
    assert torch.equal(result.tokens, reference.tokens)


def test_an_idle_worker_yields_or_sleeps_while_the_other_runs_a_long_task(tmp_path: Path) -> None:
    """One task per layer and two workers: one worker waits while the other streams a whole projection (gate/up:
    32 MiB, larger than the L3, so >= 0.3 ms at any read speed), far past the ~60 us spin phase, so the backoff
    must have yielded or slept at least once."""
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                                      num_attention_heads=8, vocab_size=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    engine = InferEngine(str(tmp_path), backend="cpu", num_workers=2, num_local_schedulers=0, tasks_per_layer=1)
    ids = torch.randint(0, 4096, (1, 4), generator=torch.Generator().manual_seed(0))
    engine.generate(ids, GenerationConfig(max_new_tokens=8, eos_token_id=()))
    runtime = next(iter(engine._decoders.values())).runtime
    if runtime.effective()[1] < 2:
        pytest.skip("one worker thread here (numba's thread count): no worker waits for another")
    backoff = runtime.last_backoff
    assert backoff["yields"] + backoff["sleeps"] > 0, backoff


def test_a_team_that_cannot_gather_decodes_one_region_per_step(zoo, monkeypatch) -> None:
    """Two workers on one thread run one after the other, so the team's barrier could never fill: the gather gives
    up (pk_team.GATHER_CYCLES) and decode runs each step in a parallel region of its own (pk_runtime.member's
    ``single`` mode). The tokens and logits must still be transformers'."""
    from yirage_backend_cpu.pk_runtime import CPUPersistentRuntime

    monkeypatch.setattr(CPUPersistentRuntime, "effective", lambda self: (1, 2, 0))  # 1 thread, 2 workers
    walls = []
    real_run = CPUPersistentRuntime.run

    def run(self, max_new_tokens=None):
        start = time.perf_counter()
        try:
            return real_run(self, max_new_tokens)
        finally:
            walls.append(time.perf_counter() - start)

    monkeypatch.setattr(CPUPersistentRuntime, "run", run)
    model = zoo("llama-gqa")
    steps = 6
    ref = model.reference
    reference = Reference(ref.ids, ref.tokens[:, :steps], ref.logits[:, :steps])
    engine = InferEngine(model.path, backend="cpu", num_workers=2, num_local_schedulers=0)
    result = engine.generate(ref.ids, GenerationConfig(max_new_tokens=steps, eos_token_id=(), output_logits=True))
    assert_decode_matches(reference, result.tokens, result.logits, label=f"{model.label}, a team that cannot gather")
    assert torch.equal(result.tokens, reference.tokens)
    assert walls and min(walls) > 0.01, f"runs of {walls} s: the gather did not wait for the second thread"
    whole = engine.generate(ref.ids, GenerationConfig(max_new_tokens=steps, eos_token_id=()))  # every step, one run
    assert torch.equal(whole.tokens, reference.tokens)
