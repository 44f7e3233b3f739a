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


def test_the_probe_reads_a_plausible_bandwidth() -> None:
    gb_s = llm_decode.probe_bandwidth()
    assert 0.5 < gb_s < 2000, f"{gb_s} GB/s is not a memory read rate"
