"""Fixtures: fake plugin distributions on sys.path and an isolated selection state."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from yirage.backend import selection
from yirage.backend.registry import Registry

_counter = itertools.count()

BACKEND_TEMPLATE = '''
import yirage

YIRAGE_PLUGIN_API = {api}

def _make(name, priority, ok=True, auto=True, kind="gpu", reason=None):
    class Fake(yirage.Backend):
        pass
    Fake.name, Fake.priority, Fake.device_kind, Fake.vendor = name, priority, kind, "Fake Inc"
    Fake.probe = lambda self: yirage.Availability(ok, reason or f"{{name}} probe says ok={{ok}}", auto)
    Fake.device_info = lambda self, index=0: yirage.DeviceInfo(f"{{name}}-device", "Fake Inc", kind, 7, 1 << 30)
    Fake.memory_info = lambda self, index=0: yirage.MemoryInfo(1 << 30, 0, 1 << 30, "fake")
    return Fake

@yirage.hookimpl
def yirage_backends():
    return [{backends}]
'''


def fake_backends_source(*specs: str, api: int = 1) -> str:
    """Source of a plugin module; each spec is a ``_make(...)`` call."""
    return BACKEND_TEMPLATE.format(api=api, backends=", ".join(specs))


def unique(prefix: str) -> str:
    return f"{prefix}_{next(_counter)}"


@pytest.fixture(autouse=True)
def private_settings(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep the user's saved default backend (and yirage env vars) out of every test."""
    for key in ("YIRAGE_BACKEND", "YIRAGE_PLUGINS", "YIRAGE_DISABLE_PLUGIN_AUTOLOAD", "YIRAGE_LOG_LEVEL",
                "YIRAGE_PROBE_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    settings = tmp_path_factory.mktemp("settings")
    monkeypatch.setenv("YIRAGE_CONFIG_DIR", str(settings))
    return settings


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """Make a real distribution visible to importlib.metadata; returns its module name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str, dist: str | None = None, version: str = "1.0", ep_name: str | None = None) -> str:
        module = unique("fakeplugin")
        dist = dist or module.replace("_", "-")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[yirage.backends]\n{ep_name or module} = {module}\n")
        import importlib

        importlib.invalidate_caches()
        return module

    return make


@pytest.fixture
def isolated_selection(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Registry], None]]:
    """Swap in a registry for the selection API; restore the real one afterwards."""
    monkeypatch.delenv("YIRAGE_BACKEND", raising=False)

    def use(registry: Registry) -> None:
        monkeypatch.setattr(selection, "_registry", registry)
        monkeypatch.setattr(selection, "_current", None)
        selection.read_environment()

    yield use
    selection.read_environment()
    monkeypatch.setattr(selection, "_current", None)
