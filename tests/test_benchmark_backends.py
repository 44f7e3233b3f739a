"""``benchmark_backends`` and ``yirage_backend_manager.py benchmark``: the figures' schema and consistency, the
correctness gate before timing, unavailable backends with their reasons, errors, and the CLI (table, JSON, --output).

Short runs on the cpu backend (duration 0.5 s or less). Nothing here asserts that anything is fast; the only time
bound is a generous ceiling on the timed part for a given duration."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from yirage.backend import selection
from yirage.bench import MIN_SAMPLES, WORKLOADS, Workload, benchmark_backends
from yirage.cli import _progress_reporter, main
from yirage.errors import UnknownBackendError

DURATION = 0.5
CELL_KEYS = {"median_us", "p10_us", "p90_us", "samples", "eager_median_us", "eager_p10_us", "eager_p90_us",
             "vs_eager", "compile_s", "max_abs_error", "error"}


@pytest.fixture(scope="module")
def cpu_run() -> tuple[dict[str, Any], list[tuple[int, int, str]]]:
    if not selection.registry().get("cpu").availability().ok:
        pytest.skip("the cpu backend is unavailable here")
    calls: list[tuple[int, int, str]] = []
    result = benchmark_backends(DURATION, backends=["cpu"], progress=lambda *a: calls.append(a))
    return result, calls


def _check_timed_cell(cell: dict[str, Any]) -> None:
    assert set(cell) == CELL_KEYS
    assert cell["error"] is None
    assert cell["samples"] >= 1
    for prefix in ("", "eager_"):
        lo, mid, hi = cell[f"{prefix}p10_us"], cell[f"{prefix}median_us"], cell[f"{prefix}p90_us"]
        assert 0 < lo <= mid <= hi
    assert cell["vs_eager"] == pytest.approx(cell["eager_median_us"] / cell["median_us"], rel=1e-12)
    assert cell["compile_s"] >= 0


def test_cpu_figures_are_consistent(cpu_run: tuple[dict[str, Any], list[tuple[int, int, str]]]) -> None:
    result, _ = cpu_run
    assert json.loads(json.dumps(result)) == result  # plain JSON data
    assert set(result) == {"duration_seconds", "timing_seconds", "compile_seconds", "wall_seconds",
                           "other_load_cores", "cpu_count", "torch", "workloads", "backends", "skipped"}
    assert result["skipped"] == {} and set(result["backends"]) == {"cpu"}
    assert result["other_load_cores"] is None or result["other_load_cores"] >= 0
    assert result["duration_seconds"] == DURATION
    assert set(result["workloads"]) == set(WORKLOADS)
    cpu = result["backends"]["cpu"]
    assert cpu["available"] and cpu["reason"] == selection.registry().get("cpu").availability().reason
    assert set(cpu["workloads"]) == set(WORKLOADS)
    for cell in cpu["workloads"].values():
        _check_timed_cell(cell)
        assert cell["samples"] >= MIN_SAMPLES or result["timing_seconds"] > DURATION  # the hard stop kicked in
    ratios = [c["vs_eager"] for c in cpu["workloads"].values()]
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    assert cpu["summary"] == {"vs_eager_geomean": pytest.approx(geomean), "workloads_ok": len(WORKLOADS),
                              "workloads_failed": 0}
    # the budget is kept: the timed part stays within ~2x of it plus the last turn of each cell, with room for a
    # loaded machine (a run beside other tests under pytest-xdist took 2.08 s for a 0.5 s budget)
    assert 0 < result["timing_seconds"] <= 2 * DURATION + 5.0
    assert result["compile_seconds"] == pytest.approx(sum(c["compile_s"] for c in cpu["workloads"].values()))
    assert result["wall_seconds"] >= result["timing_seconds"]


def test_results_match_torch_float64(cpu_run: tuple[dict[str, Any], list[tuple[int, int, str]]]) -> None:
    """The reported error of each checked graph is within the gate's tolerance of torch's float64 answer."""
    result, _ = cpu_run
    for name, cell in result["backends"]["cpu"]["workloads"].items():
        w = WORKLOADS[name]
        gen = torch.Generator().manual_seed(list(WORKLOADS).index(name))
        inputs = [(torch.randn(s, generator=gen) * k).double() for s, k in zip(w.shapes, w.scales, strict=True)]
        scale = max(1.0, float(w.torch_fn(*inputs).abs().max()))
        assert 0 <= cell["max_abs_error"] <= 2e-3 * scale, name


def test_progress_is_reported_per_cell(cpu_run: tuple[dict[str, Any], list[tuple[int, int, str]]]) -> None:
    _, calls = cpu_run
    total = len(WORKLOADS)
    assert [c[:2] for c in calls] == [(i, total) for i in range(total + 1)]
    assert [c[2] for c in calls[:-1]] == [f"cpu {w}" for w in WORKLOADS]


def _patched(monkeypatch: pytest.MonkeyPatch, build: Any) -> None:
    """One workload whose graph is ``build`` and whose torch function is X @ W."""
    bad = Workload("test", build, lambda x, w: x @ w, ((8, 16), (16, 16)), (1.0, 0.25))
    monkeypatch.setitem(WORKLOADS, "test_case", bad)


def test_a_wrong_graph_is_reported_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    _patched(monkeypatch, lambda g, x, w: g.add(g.matmul(x, w), x))  # X @ W + X: not what torch computes
    cell = benchmark_backends(0.05, backends=["cpu"], workloads=["test_case"])["backends"]["cpu"]["workloads"][
        "test_case"]
    assert cell["error"].startswith("checking against torch float64: AssertionError")
    assert cell["samples"] == 0 and cell["median_us"] is None and cell["vs_eager"] is None
    assert cell["max_abs_error"] > 0.1


def test_a_graph_that_fails_to_build_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    _patched(monkeypatch, lambda g, x, w: g.matmul(w, x))  # (16, 16) @ (8, 16): shapes disagree
    result = benchmark_backends(0.05, backends=["cpu"], workloads=["test_case"])
    cpu = result["backends"]["cpu"]
    assert cpu["workloads"]["test_case"]["error"].startswith("building the graph: ")
    assert cpu["summary"] == {"vs_eager_geomean": None, "workloads_ok": 0, "workloads_failed": 1}


def test_every_backend_is_listed_unavailable_ones_with_reasons() -> None:
    result = benchmark_backends(0.2, workloads=["elementwise"])
    reg = selection.registry()
    assert set(result["backends"]) | set(result["skipped"]) == set(reg.names())
    assert "reference" in result["skipped"] and "reference" not in result["backends"]
    for name, entry in result["backends"].items():
        availability = reg.get(name).availability()
        assert entry["available"] == availability.ok
        assert entry["reason"] == availability.reason and entry["reason"]
        if not availability.ok:
            assert entry["workloads"] == {} and entry["summary"]["vs_eager_geomean"] is None
        else:
            cell = entry["workloads"]["elementwise"]
            assert cell["error"] is not None or cell["median_us"] > 0


@pytest.mark.parametrize("bad", [-1, 0, 0.0, -0.5, math.nan, math.inf, "10", None, True, [1]])
def test_bad_duration_names_cause_and_fix(bad: Any) -> None:
    with pytest.raises(ValueError, match="duration_seconds") as err:
        benchmark_backends(bad, backends=["cpu"])
    assert "pass" in str(err.value)


def test_unknown_backend_raises_the_registrys_error() -> None:
    with pytest.raises(UnknownBackendError, match="no_such_backend") as err:
        benchmark_backends(1, backends=["cpu", "no_such_backend"])
    assert "available here" in str(err.value)


def test_empty_backends_and_unknown_workloads_raise() -> None:
    with pytest.raises(ValueError, match="names no backend"):
        benchmark_backends(1, backends=[])
    with pytest.raises(ValueError, match="unknown workload.*'nope'.*matmul"):
        benchmark_backends(1, backends=["cpu"], workloads=["nope"])


def test_cli_table_json_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    args = ["benchmark", "--duration", "0.3", "--backends", "cpu", "cuda", "--workloads", "matmul", "elementwise"]
    assert main([*args, "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "eager/yirage" in table and "median us" in table
    written = json.loads(out.read_text())
    for wl in ("matmul", "elementwise"):
        cell = written["backends"]["cpu"]["workloads"][wl]
        _check_timed_cell(cell)
        assert re.search(rf"^cpu\s+{wl}\s", table, re.MULTILINE)
        assert f"{cell['vs_eager']:.2f}x" in table
    cuda = selection.registry().get("cuda").availability()
    if not cuda.ok:
        assert written["backends"]["cuda"] == {"available": False, "reason": cuda.reason, "workloads": {},
                                               "summary": {"vs_eager_geomean": None, "workloads_ok": 0,
                                                           "workloads_failed": 0}}
        assert cuda.reason in table
    assert main(["benchmark", "--duration", "0.1", "--backends", "cpu", "--workloads", "matmul", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["backends"]) == {"cpu"} and printed["duration_seconds"] == 0.1


@pytest.mark.parametrize("bad", ["-1", "0", "nan", "inf", "ten"])
def test_cli_bad_duration_exits_2(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["benchmark", "--duration", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--duration" in err and "pass e.g. --duration 10" in err


def test_cli_unknown_backend_and_bad_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["benchmark", "--duration", "1", "--backends", "no_such_backend"]) == 2
    assert "unknown backend 'no_such_backend'" in capsys.readouterr().err
    missing = tmp_path / "no_dir" / "r.json"
    assert main(["benchmark", "--duration", "1", "--output", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_progress_without_tqdm_prints_lines(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a))
    progress, close = _progress_reporter()
    progress(0, 2, "cpu matmul")
    progress(2, 2, "done")
    close()
    assert capsys.readouterr().err.splitlines() == ["benchmark [0/2] cpu matmul", "benchmark [2/2] done"]
