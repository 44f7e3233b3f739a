"""Behaviour that only a fresh process shows: import cost, env vars, the CLI.

Nothing here assumes this machine: what ``auto`` must pick, which backend is
unavailable and whether OpenCL has a device are computed from the probes
(``tests.conftest``), so the tests adapt on a CUDA box or without PoCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import expected_auto, numba_installed, opencl_device_count, unavailable_backend
from yirage.backend.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
KEEP = {"YIRAGE_CONFIG_DIR", "YIRAGE_CACHE_DIR"}  # the test session's private settings and cache


@pytest.fixture(scope="module")
def here() -> Registry:
    """The backends a fresh process sees (no YIRAGE_* switches), probed once in this process."""
    return Registry(environ={})


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


def test_the_acceptance_one_liner(here) -> None:
    out = run(
        "import yirage as yr; print([b.value for b in yr.get_available_backends()]); "
        "yr.set_backend('auto'); print(yr.get_backend().value)"
    )
    assert out.returncode == 0, out.stderr
    listed, chosen = out.stdout.strip().splitlines()
    oracle = {name for name, ok in _oracle_availability().items() if ok}
    assert oracle <= set(eval(listed)) <= set(here.names()), (listed, oracle)
    want = expected_auto(here)
    assert chosen == want
    # auto warns exactly when it ends on the host CPU
    assert ("host CPU" in out.stderr) is (here.get(want).device_kind == "cpu"), out.stderr


def test_yirage_backend_env_selects_a_backend_auto_would_not_pick(here) -> None:
    """OpenCL when it has a device here (PoCL or a GPU driver), else the best other available backend."""
    others = [b.name for b in here.backends() if b.availability().ok and b.name != expected_auto(here)]
    if not others:
        pytest.skip("only one backend is available here")
    name = "opencl" if "opencl" in others else others[0]
    out = run("import yirage as yr; print(yr.get_backend().value)", env={"YIRAGE_BACKEND": name})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == name


def test_yirage_backend_env_naming_an_unavailable_backend_fails_with_the_reason(here) -> None:
    name = unavailable_backend(here)
    out = run("import yirage as yr; print(yr.get_backend().value)", env={"YIRAGE_BACKEND": name})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "BackendUnavailableError" in last and repr(name) in last and "YIRAGE_BACKEND" in last
    assert here.get(name).availability().reason in out.stderr and "Available backends:" in last


def test_log_level_env_sets_the_logger_level() -> None:
    code = "import logging, yirage; print(logging.getLogger('yirage').level)"
    assert run(code, env={"YIRAGE_LOG_LEVEL": "debug"}).stdout.strip() == str(10)
    bad = run(code, env={"YIRAGE_LOG_LEVEL": "loud"})
    assert "YIRAGE_LOG_LEVEL='loud' is not a log level" in bad.stderr


def test_debug_logging_shows_the_auto_decision(here) -> None:
    out = run("import yirage as yr; yr.set_backend('auto')", env={"YIRAGE_LOG_LEVEL": "INFO"})
    want = expected_auto(here)
    assert f"auto selected backend {want!r}" in out.stderr, out.stderr
    passed = [b.name for b in here.backends() if b.priority > here.get(want).priority]
    for name in passed:  # every better backend is named with the reason it was passed over
        assert f"{name}: " in out.stderr, (name, out.stderr)
    if not passed:
        assert "passed over: nothing" in out.stderr, out.stderr


def _oracle_availability() -> dict[str, bool]:
    """Which backends can run here, asked of the libraries themselves, not of yirage.

    Only answers the libraries give for certain: with a torch.cuda device visible, which CUDA-API
    vendor owns it is left to test_vendor.py; with a vendor adapter installed, whether it sees a
    device is left out.
    """
    import importlib.util
    import platform

    import torch

    oracle = {
        "reference": True,
        "cpu": numba_installed(),
        "opencl": opencl_device_count() > 0,
        "mps": platform.system() == "Darwin" and torch.backends.mps.is_available(),
    }
    if not torch.cuda.is_available():
        oracle.update(dict.fromkeys(("cuda", "metax", "iluvatar", "hygon"), False))
    for name, adapter in (("ascend", "torch_npu"), ("cambricon", "torch_mlu"), ("moore", "torch_musa")):
        if importlib.util.find_spec(adapter) is None:
            oracle[name] = False
    return oracle


def test_info_lists_every_backend_truthfully(here) -> None:
    out = run("", args=["tools/yirage_backend_manager.py", "info", "--json"])
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    listed = {b["name"]: b["available"] for b in info["backends"]}
    oracle = _oracle_availability()
    assert set(oracle) <= set(listed)
    assert {name: listed[name] for name in oracle} == oracle
    assert info["default"]["backend"] == expected_auto(here)
    assert info["host"]["logical_cores"] == os.cpu_count()
    text = run("", args=["-m", "yirage", "info"])
    assert text.returncode == 0, text.stderr
    for name in listed:
        assert f"\n{name} " in text.stdout
    assert f"Default backend: {expected_auto(here)}" in text.stdout


def test_info_survives_an_unusable_default(here) -> None:
    name = unavailable_backend(here)
    out = run("", args=["-m", "yirage", "info"], env={"YIRAGE_BACKEND": name})
    assert out.returncode == 0, out.stderr
    assert f"Default backend: none: backend {name!r} (from YIRAGE_BACKEND) is unavailable" in out.stdout


def test_set_saves_the_default_for_later_processes(tmp_path, here) -> None:
    env = {"YIRAGE_CONFIG_DIR": str(tmp_path)}
    out = run("", args=["tools/yirage_backend_manager.py", "set", "reference"], env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "config.json").read_text()) == {"backend": "reference"}
    assert run("import yirage as yr; print(yr.get_backend())", env=env).stdout.strip() == "reference"
    other = next((b.name for b in here.backends() if b.availability().ok and b.name != "reference"), None)
    if other is None:
        pytest.skip("no available backend besides reference to override the saved one with")
    both = {**env, "YIRAGE_BACKEND": other}
    assert run("import yirage as yr; print(yr.get_backend())", env=both).stdout.strip() == other


def test_set_refuses_an_unavailable_backend(tmp_path, here) -> None:
    name = unavailable_backend(here, prefer="mps")
    out = run("", args=["tools/yirage_backend_manager.py", "set", name], env={"YIRAGE_CONFIG_DIR": str(tmp_path)})
    assert out.returncode == 2 and repr(name) in out.stderr and "unavailable" in out.stderr
    assert not (tmp_path / "config.json").exists()


def test_a_corrupted_settings_file_is_named_with_the_fix(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    out = run("import yirage as yr; yr.get_backend()", env={"YIRAGE_CONFIG_DIR": str(tmp_path)})
    assert out.returncode != 0
    assert str(tmp_path / "config.json") in out.stderr and "corrupted" in out.stderr and "set auto" in out.stderr
    fixed = run("", args=["tools/yirage_backend_manager.py", "set", "auto"], env={"YIRAGE_CONFIG_DIR": str(tmp_path)})
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
    fixed = run("", args=["tools/yirage_backend_manager.py", "set", "reference"], env=env)  # available everywhere
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads((tmp_path / "config.json").read_text()) == {"backend": "reference"}


def test_a_directory_in_place_of_the_settings_file_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "config.json").mkdir()
    out = run("import yirage as yr; yr.get_backend()", env={"YIRAGE_CONFIG_DIR": str(tmp_path)})
    assert "ConfigError" in out.stderr and "cannot be read" in out.stderr
