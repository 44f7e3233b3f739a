"""demo/demo_multi_backend.py: its checks pass on the backends here, list every backend, and can fail.

The demo checks kernel graphs against the float64 graph oracle and a PersistentKernel decode against the reference
backend's PersistentKernel and transformers; these tests run it as a user would (a subprocess: PersistentKernels
hand raw addresses to compiled code, so a crash fails a test instead of killing the run), and break one piece
in-process to show that a wrong result turns into a FAIL line and exit status 1.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import yirage as yr

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo" / "demo_multi_backend.py"
TIMEOUT = 600  # generous: a cold numba compile of the PersistentKernel takes up to a minute; this only catches hangs
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_cpu = pytest.mark.skipif(not yr.is_backend_available("cpu"), reason="the cpu backend (numba) is unavailable")


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DEMO), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT)


def summary(out: str) -> dict[str, str]:
    """The summary table's rows: backend name -> the rest of its line."""
    rows = out.split("\nSummary\n", 1)[1].splitlines()[1:]
    last = ("All checks", "FAILED", "WARNING", "Nothing")  # the verdict lines after the table
    return {line.split()[0]: line for line in rows if line and not line.startswith(last)}


def load_demo() -> Any:
    """The demo as a module (demo/ is a scripts folder, not a package); loaded once, tests patch its attributes."""
    name = "demo_multi_backend_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DEMO)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


@needs_cpu
def test_cpu_demo_checks_the_graphs_and_the_persistent_kernel() -> None:
    done = run_demo("--backend", "cpu", "--iterations", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    oracles = "reference PK and transformers" if HAVE_TRANSFORMERS else "reference PK"
    pk_rows = [line for line in out.splitlines() if line.startswith("cpu ") and "ok: matches" in line]
    assert len(pk_rows) == 1 and pk_rows[0].endswith(f"ok: matches {oracles}"), out
    row = summary(out)["cpu"]
    assert "4/4 match" in row and "match, " in row and "ms/token" in row, out
    assert "All checks passed" in out and "FAIL" not in out


def test_all_lists_every_backend_available_or_with_its_reason() -> None:
    """The spec's ``--backend all --iterations 20``, with one iteration (the checks are the same)."""
    done = run_demo("--backend", "all", "--iterations", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = summary(done.stdout)
    names = [b.value for b in yr.BackendType]
    assert sorted(rows) == sorted(names), done.stdout
    for name in names:
        info = yr.get_backend_info(name)
        if info["available"]:
            assert "available" in rows[name] and "4/4 match" in rows[name], rows[name]
        else:
            assert rows[name].split(None, 2)[1:] == ["unavailable", info["reason"]], rows[name]


def test_a_named_unavailable_backend_is_reported_not_failed(capsys: pytest.CaptureFixture[str]) -> None:
    demo = load_demo()
    off = [b.value for b in yr.BackendType if not yr.get_backend_info(b.value)["available"]]
    if not off:
        pytest.skip("every discovered backend is available here")
    assert demo.main(["--backend", off[0]]) == 0
    assert yr.get_backend_info(off[0])["reason"] in capsys.readouterr().out


def test_an_unknown_backend_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_demo().main(["--backend", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "nosuch" in err and "cpu" in err  # names the typo and the backends there are


@needs_cpu
def test_a_wrong_kernel_graph_result_is_a_failure(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    demo = load_demo()
    monkeypatch.setattr(demo, "cases", lambda: {"swiglu (4x64)": demo.swiglu(4, 64)})  # small: the check is the point
    run = yr.KernelGraph.run

    def off_by_a_little(self: Any, inputs: Any, backend: Any = None) -> list[Any]:
        outs = run(self, inputs, backend=backend)
        return [out * 1.001 for out in outs] if backend == "cpu" else outs

    monkeypatch.setattr(yr.KernelGraph, "run", off_by_a_little)
    assert demo.main(["--backend", "cpu", "--iterations", "1", "--skip-persistent"]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("swiglu (4x64)") and "cpu" in line and "FAIL:" in line for line in out.splitlines())
    assert "0/1 match" in summary(out)["cpu"] and "FAILED: 1 check(s)" in out


@needs_cpu
def test_a_wrong_persistent_kernel_result_is_a_failure(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    demo = load_demo()
    monkeypatch.setattr(demo, "cases", lambda: {"swiglu (4x64)": demo.swiglu(4, 64)})
    decode = demo.yirage_decode

    def perturbed_on_cpu(weights: dict[str, Any], backend: str, *args: Any) -> Any:
        if backend == "cpu":  # one down projection 1% off: what a backend's wrong tile would do
            name = "layers.1.mlp.down_proj.weight"
            weights = {**weights, name: weights[name] * 1.01}
        return decode(weights, backend, *args)

    monkeypatch.setattr(demo, "yirage_decode", perturbed_on_cpu)
    # transformers' side costs seconds of imports and shares mismatch() with the reference PK's: left out here
    monkeypatch.setattr(demo, "hf_decode", lambda *args: None)
    torch.manual_seed(0)
    assert demo.main(["--backend", "cpu", "--iterations", "1"]) == 1
    out = capsys.readouterr().out
    pk_row = next(line for line in out.splitlines() if line.startswith("cpu ") and "FAIL:" in line)
    assert "logits differ from reference PK at" in pk_row and "transformers is not installed" in out
    assert summary(out)["cpu"].split()[2:4] == ["1/1", "match"] and "FAILED: 1 check(s)" in out
