"""The shell commands of the spec's "命令行工具" section (/work/shared/spec/yirage-multi-backend.md), run as written.

Each command is the spec's text; ``python`` is this interpreter, script paths are the repository's, and the
working directory is a fresh temporary one (so ``--output results.json`` lands there, not in the checkout).
YIRAGE_CONFIG_DIR points at a temporary directory, so ``set`` and ``--apply`` never touch the user's settings.
Where a command as written takes longer than this suite can afford, the test runs the smallest variant that
goes through the same argument parsing and code, and its docstring names the difference. No GPU here: the
cuda commands must fail with the reason cuda is unavailable.

Covered elsewhere, to keep the suite short: ``test cpu`` is the whole conformance kit on cpu, which ``make test``
runs as tests/test_conformance.py (the tool's ``test NAME --quick`` path: tests/test_backend_manager_test.py);
the demo's ``--backend all`` and ``--backend cpu`` runs are tests/test_demo_multi_backend.py's.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import yirage as yr

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # generous: cold numba/PoCL compiles; this only catches a hang


def unavailable_reason(name: str) -> str | None:
    """The probe's reason when ``name`` is installed but cannot run here; None when it runs (or is not installed)."""
    if name not in {b.value for b in yr.BackendType}:
        return None
    info = yr.get_backend_info(name)
    return None if info["available"] else info["reason"]


CUDA_OFF = unavailable_reason("cuda")
no_cuda = pytest.mark.skipif(CUDA_OFF is None, reason="cuda runs here (or is not installed): nothing to refuse")
needs_cpu = pytest.mark.skipif(not yr.is_backend_available("cpu"), reason="the cpu backend (numba) is unavailable")


def spec(command: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run one spec command line: ``python`` -> this interpreter, the script relative to the repository."""
    words = shlex.split(command)
    assert words[0] == "python", command
    config = tmp_path / "config"
    config.mkdir(exist_ok=True)
    env = {**os.environ, "YIRAGE_CONFIG_DIR": str(config)}
    return subprocess.run([sys.executable, str(ROOT / words[1]), *words[2:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_info(tmp_path: Path) -> None:
    out = ok(spec("python tools/yirage_backend_manager.py info", tmp_path))
    for backend in yr.BackendType:
        assert f"\n  {backend.value} " in out or f"\n{backend.value} " in out, backend.value
    assert "Default backend: " in out and "PersistentKernel configuration" in out


def test_the_spec_tool_is_python_m_yirage(tmp_path: Path) -> None:
    """tools/yirage_backend_manager.py (the spec's name, the only script) runs yirage/cli.py, as ``-m yirage`` does."""
    script = ok(spec("python tools/yirage_backend_manager.py --help", tmp_path))
    module = subprocess.run([sys.executable, "-m", "yirage", "--help"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert ok(module) == script
    assert all(command in script for command in ("info", "set", "test", "benchmark", "optimize"))


@no_cuda
def test_optimize_cuda_apply_fails_with_the_reason(tmp_path: Path) -> None:
    done = spec("python tools/yirage_backend_manager.py optimize --backend cuda --apply", tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "backend 'cuda'" in done.stderr and "unavailable" in done.stderr and CUDA_OFF in done.stderr
    assert not list((tmp_path / "config").iterdir()), "nothing may be applied for an unavailable backend"


@needs_cpu
def test_benchmark(tmp_path: Path) -> None:
    """Spec: ``benchmark --duration 30``; run with ``--duration 0.2`` (30 s of timing is beyond the suite's budget;
    the argument is parsed by the same _duration and only sets how long each cell is timed)."""
    out = ok(spec("python tools/yirage_backend_manager.py benchmark --duration 0.2", tmp_path))
    rows = [line.split() for line in out.splitlines() if line.startswith("cpu ")]
    assert rows and all(float(row[2]) > 0 for row in rows), out  # every cpu workload timed, none "error"
    assert "eager/yirage" in out and "Unavailable" in out


@no_cuda
def test_set_cuda_fails_with_the_reason(tmp_path: Path) -> None:
    done = spec("python tools/yirage_backend_manager.py set cuda", tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "backend 'cuda' is unavailable" in done.stderr and CUDA_OFF in done.stderr
    assert not list((tmp_path / "config").iterdir()), "an unavailable default must not be saved"


def demo_summary(out: str) -> dict[str, str]:
    rows = out.split("\nSummary\n", 1)[1].splitlines()[1:]
    last = ("All checks", "FAILED", "WARNING", "Nothing")  # the verdict lines after the table
    return {line.split()[0]: line for line in rows if line and not line.startswith(last)}


def test_demo_skip_persistent(tmp_path: Path) -> None:
    """As written: the default backend, 20 iterations, kernel graphs only."""
    out = ok(spec("python demo/demo_multi_backend.py --skip-persistent", tmp_path))
    default = yr.get_backend().value
    assert "4/4 match" in demo_summary(out)[default] and "greedy tokens" not in out


@needs_cpu
def test_multi_backend_benchmark(tmp_path: Path) -> None:
    """Spec: ``--iterations 50 --output results.json`` and the custom configuration (``--batch-sizes 1 4 8
    --seq-lengths 128 512 1024 --hidden-sizes 768 1024 --dtype float16``), as one run of the same flags at the
    smallest sizes: --iterations 2, one batch size, sequence length and hidden size each (those of
    tests/test_multi_backend_benchmark.py, whose kernels are then in the compile cache), --backends cpu
    --no-compile, in float32 (the spec's grids on every backend with torch.compile peers take minutes, and
    float16 kernels would be compiled for this test alone: the kit checks them); tests/test_multi_backend_benchmark.py
    checks the figures, the JSON schema and the plot."""
    ok(spec("python benchmark/multi_backend_benchmark.py --iterations 2 --output results.json --backends cpu "
            "--batch-sizes 2 --seq-lengths 8 --hidden-sizes 128 --dtype float32 --no-compile", tmp_path))
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["iterations"] == 2 and doc["config"]["dtype"] == "float32"
    cpu = [r for r in doc["results"] if r["backend"] == "cpu"]
    assert {r["workload"] for r in cpu} == {"matmul", "rmsnorm_linear", "gated_mlp", "attention", "elementwise"}
    assert all(r["error"] is None and r["median_us"] > 0 for r in cpu), cpu
