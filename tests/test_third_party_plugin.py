"""A third-party plugin, installed by pip, is discovered, listed and selectable.

The example package in examples/yirage-backend-example is installed with pip
into a temporary target directory; a fresh process sees it on PYTHONPATH.
What the built-in backends contribute (which are available, what auto picks) is
computed from the probes in this process, never assumed (no "cpu" or "opencl").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import auto_candidates, auto_pick, numba_installed
from yirage.backend.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
KEEP = {"YIRAGE_CONFIG_DIR", "YIRAGE_CACHE_DIR"}  # the test session's private settings and cache


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT / "examples" / "yirage-backend-example")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    if pip.returncode != 0:
        pytest.fail(f"pip could not install the example plugin:\n{pip.stdout}\n{pip.stderr}")
    # a second distribution whose plugin crashes on import
    (target / "crashing_backend.py").write_text("raise RuntimeError('vendor SDK not initialised')\n")
    info = target / "crashing_backend-0.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: crashing-backend\nVersion: 0.9\n")
    (info / "entry_points.txt").write_text("[yirage.backends]\ncrasher = crashing_backend\n")
    return target


@pytest.fixture(scope="module")
def here() -> Registry:
    """The built-in backends a fresh process sees without the example plugin, probed once."""
    return Registry(environ={})


def run(site: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("YIRAGE_") or k in KEEP}
    full["PYTHONPATH"] = os.pathsep.join([str(site), full.get("PYTHONPATH", "")])
    full.update(env)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full, cwd=ROOT,
                          timeout=120, check=False)


def test_pip_installed_plugin_is_discovered_listed_and_selectable(site, here) -> None:
    assert list(site.glob("yirage_backend_example-1.0.0.dist-info"))
    out = run(site, ["-m", "yirage", "info", "--json"])
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    example = next(b for b in info["backends"] if b["name"] == "example")
    assert example["available"] and example["vendor"] == "Example Corp"
    assert example["plugin"] == {"name": "example", "distribution": "yirage-backend-example", "version": "1.0.0"}
    builtin = {b.name for b in here.backends() if b.availability().ok}
    assert {b["name"] for b in info["backends"] if b["available"]} == builtin | {"example"}
    crash = next(p for p in info["plugins"] if p["name"] == "crasher")
    assert crash["status"] == "failed" and crash["distribution"] == "crashing-backend"
    assert "RuntimeError: vendor SDK not initialised" in crash["error"]

    chosen = run(site, ["-c", "import yirage as yr; yr.set_backend('example'); print(yr.get_backend().value)"])
    assert chosen.stdout.strip() == "example", chosen.stderr
    assert "crasher" not in chosen.stderr  # a name lookup imports only the plugin named like it (issue 7)
    via_env = run(site, ["-c", "import yirage as yr; print(yr.get_backend().value)"], YIRAGE_BACKEND="example")
    assert via_env.stdout.strip() == "example", via_env.stderr


def test_auto_does_not_prefer_a_lower_priority_plugin(site, here) -> None:
    """The example (priority 10, eligible for auto) wins only where no better built-in backend is available."""
    want = auto_pick([*auto_candidates(here), ("example", 10)])
    out = run(site, ["-c", "import yirage as yr; print(yr.set_backend('auto'))"])
    assert out.stdout.strip() == want, out.stderr


def test_the_allow_list_can_exclude_the_plugin(site) -> None:
    code = "import yirage as yr; print(yr.is_backend_available('example'), yr.is_backend_available('cpu'))"
    assert run(site, ["-c", code], YIRAGE_PLUGINS="cpu").stdout.strip() == f"False {numba_installed()}"
    assert run(site, ["-c", code], YIRAGE_PLUGINS="example").stdout.strip() == "True False"
    off = run(site, ["-c", code], YIRAGE_DISABLE_PLUGIN_AUTOLOAD="1")
    assert off.stdout.strip() == "False False"
    assert "crasher" not in off.stderr


def test_the_crashing_plugin_is_shown_by_the_text_info(site) -> None:
    out = run(site, ["tools/yirage_backend_manager.py", "info"])
    assert out.returncode == 0, out.stderr
    assert "Plugin problems" in out.stdout
    assert "crasher (crashing-backend 0.9): failed" in out.stdout
