"""Behaviour that only a fresh process shows: import cost, env vars, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEEP = {"YIRAGE_CONFIG_DIR", "YIRAGE_CACHE_DIR"}  # the test session's private settings and cache


def run(code: str, env: dict[str, str] | None = None, args: list[str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("YIRAGE_") or k in KEEP}
    full_env.update(env or {})
    cmd = [sys.executable, *(args if args is not None else ["-c", code])]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=ROOT, timeout=120, check=False)


def test_import_is_light() -> None:
    out = run(
        "import sys, yirage\n"
        "print([m for m in ('torch', 'numba', 'pyopencl', 'numpy', 'llvmlite') if m in sys.modules])"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_acceptance_one_liner() -> None:
    out = run(
        "import yirage as yr; print([b.value for b in yr.get_available_backends()]); "
        "yr.set_backend('auto'); print(yr.get_backend().value)"
    )
    assert out.returncode == 0, out.stderr
    listed, chosen = out.stdout.strip().splitlines()
    assert {"reference", "cpu", "opencl"} <= set(eval(listed))
    assert chosen == "cpu"
    assert "host CPU" in out.stderr  # auto warns when it ends on the CPU


def test_yirage_backend_env_selects_opencl() -> None:
    pytest.importorskip("pyopencl")
    out = run("import yirage as yr; print(yr.get_backend().value)", env={"YIRAGE_BACKEND": "opencl"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "opencl"


def test_yirage_backend_env_cuda_fails_with_the_reason() -> None:
    import torch

    if torch.version.cuda:
        pytest.skip("CUDA torch build here")
    out = run("import yirage as yr; print(yr.get_backend().value)", env={"YIRAGE_BACKEND": "cuda"})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "BackendUnavailableError" in last and "'cuda'" in last and "YIRAGE_BACKEND" in last
    assert "CPU-only build" in last and "Available backends:" in last


def test_log_level_env_sets_the_logger_level() -> None:
    code = "import logging, yirage; print(logging.getLogger('yirage').level)"
    assert run(code, env={"YIRAGE_LOG_LEVEL": "debug"}).stdout.strip() == str(10)
    bad = run(code, env={"YIRAGE_LOG_LEVEL": "loud"})
    assert "YIRAGE_LOG_LEVEL='loud' is not a log level" in bad.stderr


def test_debug_logging_shows_the_auto_decision() -> None:
    out = run("import yirage as yr; yr.set_backend('auto')", env={"YIRAGE_LOG_LEVEL": "INFO"})
    assert "auto selected backend 'cpu'" in out.stderr and "cuda:" in out.stderr


def _oracle_availability() -> dict[str, bool]:
    """Which backends can run here, asked of the libraries themselves, not of yirage."""
    import importlib.util
    import platform

    import torch

    def opencl() -> bool:
        try:
            import pyopencl as cl

            return any(p.get_devices() for p in cl.get_platforms())
        except (ImportError, RuntimeError):
            return False

    return {
        "reference": True,
        "cpu": importlib.util.find_spec("numba") is not None,
        "opencl": opencl(),
        "cuda": bool(torch.version.cuda) and torch.cuda.is_available(),
        "mps": platform.system() == "Darwin" and torch.backends.mps.is_available(),
        "ascend": importlib.util.find_spec("torch_npu") is not None,
        "cambricon": importlib.util.find_spec("torch_mlu") is not None,
        "moore": importlib.util.find_spec("torch_musa") is not None,
        "metax": False,
        "iluvatar": False,
        "hygon": bool(getattr(torch.version, "hip", None)) and torch.cuda.is_available(),
    }


def test_info_lists_every_backend_truthfully() -> None:
    out = run("", args=["tools/backend_manager.py", "info", "--json"])
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    listed = {b["name"]: b["available"] for b in info["backends"]}
    oracle = _oracle_availability()
    assert set(oracle) <= set(listed)
    assert {name: listed[name] for name in oracle} == oracle
    assert info["default"]["backend"] == "cpu"
    assert info["host"]["logical_cores"] == os.cpu_count()
    text = run("", args=["-m", "yirage", "info"])
    assert text.returncode == 0, text.stderr
    for name in oracle:
        assert f"\n{name} " in text.stdout
    assert "Default backend: cpu" in text.stdout


def test_info_survives_an_unusable_default() -> None:
    out = run("", args=["-m", "yirage", "info"], env={"YIRAGE_BACKEND": "cuda"})
    assert out.returncode == 0, out.stderr
    assert "Default backend: none: backend 'cuda' (from YIRAGE_BACKEND) is unavailable" in out.stdout


def test_set_saves_the_default_for_later_processes(tmp_path) -> None:
    env = {"YIRAGE_CONFIG_DIR": str(tmp_path)}
    out = run("", args=["tools/backend_manager.py", "set", "reference"], env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "config.json").read_text()) == {"backend": "reference"}
    assert run("import yirage as yr; print(yr.get_backend())", env=env).stdout.strip() == "reference"
    both = {**env, "YIRAGE_BACKEND": "cpu"}
    assert run("import yirage as yr; print(yr.get_backend())", env=both).stdout.strip() == "cpu"


def test_set_refuses_an_unavailable_backend(tmp_path) -> None:
    out = run("", args=["tools/backend_manager.py", "set", "mps"], env={"YIRAGE_CONFIG_DIR": str(tmp_path)})
    assert out.returncode == 2 and "'mps'" in out.stderr and "unavailable" in out.stderr
    assert not (tmp_path / "config.json").exists()


def test_a_corrupted_settings_file_is_named_with_the_fix(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    out = run("import yirage as yr; yr.get_backend()", env={"YIRAGE_CONFIG_DIR": str(tmp_path)})
    assert out.returncode != 0
    assert str(tmp_path / "config.json") in out.stderr and "corrupted" in out.stderr and "set auto" in out.stderr
    fixed = run("", args=["tools/backend_manager.py", "set", "auto"], env={"YIRAGE_CONFIG_DIR": str(tmp_path)})
    assert fixed.returncode == 0, fixed.stderr


def test_logging_reaches_the_applications_own_handlers() -> None:
    code = (
        "import logging, io, yirage as yr\n"
        "buf = io.StringIO(); logging.basicConfig(stream=buf, level=logging.INFO)\n"
        "yr.set_backend('auto'); print('auto selected' in buf.getvalue())"
    )
    out = run(code, env={"YIRAGE_LOG_LEVEL": "INFO"})
    assert out.stdout.strip() == "True", out.stderr
    assert "auto selected" not in out.stderr  # no duplicate on stderr once the app configured logging


def test_warn_is_accepted_as_a_level() -> None:
    out = run("import logging, yirage; print(logging.getLogger('yirage').level)", env={"YIRAGE_LOG_LEVEL": "warn"})
    assert out.stdout.strip() == "30" and not out.stderr


@pytest.mark.parametrize("content", [b"\xff\xfe{", b"[1, 2]"])
def test_unreadable_settings_are_reported_by_info_and_fixed_by_set(tmp_path, content) -> None:
    (tmp_path / "config.json").write_bytes(content)
    env = {"YIRAGE_CONFIG_DIR": str(tmp_path)}
    out = run("", args=["-m", "yirage", "info", "--json"], env=env)
    assert out.returncode == 0, out.stderr
    default = json.loads(out.stdout)["default"]
    assert str(tmp_path / "config.json") in default["settings_error"]
    fixed = run("", args=["tools/backend_manager.py", "set", "cpu"], env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads((tmp_path / "config.json").read_text()) == {"backend": "cpu"}


def test_a_directory_in_place_of_the_settings_file_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "config.json").mkdir()
    out = run("import yirage as yr; yr.get_backend()", env={"YIRAGE_CONFIG_DIR": str(tmp_path)})
    assert "ConfigError" in out.stderr and "cannot be read" in out.stderr
