"""Fixtures: fake plugin distributions on sys.path and an isolated selection state."""

from __future__ import annotations

import itertools
import os
import textwrap
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from yirage.backend import selection
from yirage.backend.registry import Registry

_counter = itertools.count()

# The cpu backend's prompt projections by fixed row limits, not timed: which path a prefill takes (the two round
# differently) must not depend on the machine's load during a test. Set for the whole session, not per test: module
# fixtures start processes (tensor-parallel ranks) before any function fixture runs, and they inherit it from here
# (a rank left timing under the others' load took another path than the single-rank reference and failed 1e-4 of the
# logit range). tests/test_prompt_rows.py times them on purpose.
os.environ["YIRAGE_CPU_PROMPT_TILES"] = "fixed"
# A generate waits for its backend's compile, as each test expects of the runtime it names: with the eager start (the
# users' default) a test run on a cold cache (CI's) would decode its first steps in torch instead of the runtime under
# test, and a prompt's projections in torch. tests/test_eager_start.py turns it on.
os.environ["YIRAGE_EAGER_START"] = "0"

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


# -- what this machine offers, computed from the probes (tests never hard-code one machine) ---------------


def auto_pick(candidates: Iterable[tuple[str, int]]) -> str:
    """The documented auto policy applied to (name, priority) pairs: highest priority, ties by name.

    Written out here, apart from the selection code, so tests compute what ``auto`` must pick on any
    machine from the probes' answers instead of asserting this machine's answer ("cpu").
    """
    ranked = sorted(candidates, key=lambda c: (-c[1], c[0]))
    if not ranked:
        pytest.skip("no backend here is both available and eligible for auto")
    return ranked[0][0]


def auto_candidates(reg: Registry) -> list[tuple[str, int]]:
    """(name, priority) of every backend whose probe says it is available and eligible for auto."""
    return [(b.name, b.priority) for b in reg.backends() if b.availability().ok and b.availability().auto]


def expected_auto(reg: Registry) -> str:
    """What ``set_backend('auto')`` must choose among ``reg``'s backends on this machine."""
    return auto_pick(auto_candidates(reg))


def unavailable_backend(reg: Registry, prefer: str = "cuda") -> str:
    """A registered backend whose probe says it cannot run here (``prefer`` if so), or skip the test."""
    names = [b.name for b in reg.backends() if not b.availability().ok]
    if not names:
        pytest.skip("every registered backend is available on this machine: nothing unavailable to select")
    return prefer if prefer in names else names[0]


def numba_installed() -> bool:
    """Whether the cpu backend's only requirement is met, asked of importlib, not of yirage."""
    import importlib.util

    return importlib.util.find_spec("numba") is not None


def opencl_device_count() -> int:
    """OpenCL devices pyopencl itself reports (0 without pyopencl or an ICD such as PoCL), not asked of yirage."""
    try:
        import pyopencl as cl
    except ImportError:
        return 0
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return 0
    count = 0
    for platform in platforms:
        try:
            count += len(platform.get_devices())
        except cl.Error:
            continue  # a platform without devices
    return count


def persistent_backends() -> list[str]:
    import yirage as yr

    return [backend.value for backend in yr.get_available_backends()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``pk_backend``'s parameters, probed only where a collected test asks for it."""
    if "pk_backend" in metafunc.fixturenames:
        metafunc.parametrize("pk_backend", persistent_backends(), indirect=True)


@pytest.fixture
def pk_backend(request: pytest.FixtureRequest) -> str:
    """Each available backend with a PersistentKernel runtime (the others skip): what an LLM test runs on."""
    import yirage as yr
    from yirage.backend.selection import registry

    backend = registry().get(request.param)
    if type(backend).persistent_runtime is yr.Backend.persistent_runtime:
        pytest.skip(f"backend {request.param!r} has no PersistentKernel runtime yet")
    return request.param


@pytest.fixture
def gpu_layout(monkeypatch: pytest.MonkeyPatch):
    """The opencl backend's PersistentKernel forced into the GPU layout (tests/pocl_layout.py)."""
    from pocl_layout import force_gpu_layout

    return force_gpu_layout(monkeypatch)
