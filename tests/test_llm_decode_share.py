"""benchmark/llm_decode.py's share of the bound: each run against the bandwidth probed around it, not a
single probe from the start of the session (the host's bandwidth drifts between runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
import llm_decode  # noqa: E402 - lives in benchmark/, a scripts folder, not a package


def test_each_run_is_measured_against_the_faster_probe_around_it() -> None:
    probes = iter([10.0, 20.0, 5.0, 40.0, 8.0])  # before run 1, then after each of 4 runs
    times = {"a": iter([2.0, 4.0]), "b": iter([1.0, 1.0])}
    peers = {name: (lambda it=it: next(it)) for name, it in times.items()}
    samples = llm_decode.measure(peers, rounds=2, probe=lambda: next(probes))
    assert samples.ms == {"a": [2.0, 4.0], "b": [1.0, 1.0]}
    assert samples.gb_s == {"a": [20.0, 40.0], "b": [20.0, 40.0]}  # max(before, after) of each run
    stats = llm_decode.summarize(samples, weight_gb=0.02)  # 20 MB a token: 1 ms at 20 GB/s
    # a: 1 ms / 2 ms = 0.5 and 0.5 ms / 4 ms = 0.125; b: 1.0 and 0.5
    assert stats["a"]["share_of_bound"] == pytest.approx((0.5 + 0.125) / 2)
    assert stats["b"]["share_of_bound"] == pytest.approx(0.75)
    assert (stats["a"]["bandwidth_min"], stats["a"]["bandwidth_max"]) == (20.0, 40.0)


class Durations:
    """A fake ``time.perf_counter`` whose successive (start, stop) reads are ``durations`` seconds apart."""

    def __init__(self, durations: list[float]) -> None:
        self.reads = iter(t for i, d in enumerate(durations) for t in (10.0 * i, 10.0 * i + d))

    def perf_counter(self) -> float:
        return next(self.reads)


def test_the_probe_reports_its_buffer_bytes_over_its_fastest_read(monkeypatch) -> None:
    """The probe's GB/s is 256 MiB (its buffer, 4 bytes a float32) over the fastest of its 6 timed reads (3 per
    method), in 1e9 bytes per second: on a fake clock with known read times, exactly that (a count of values for
    bytes, the slowest read, the mean or MiB units fail); and its numba stream sums every value of a buffer."""
    import numpy as np
    import torch

    durations = [0.05, 0.04, 0.08, 0.03, 0.02, 0.06]
    monkeypatch.setattr(llm_decode, "time", Durations(durations))
    assert llm_decode.probe_bandwidth() == pytest.approx(64 * 2**20 * 4 / min(durations) / 1e9, rel=1e-9)
    threads = max(1, torch.get_num_threads())
    n = 2**16 * threads  # the probe's chunks are n // threads values long: all of them read
    assert llm_decode._prange_sum(np.arange(n, dtype=np.float32) % 7, threads) == float(sum(i % 7 for i in range(n)))
