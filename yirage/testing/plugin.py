"""pytest plugin: parametrize ``yirage_backend`` over backends that compile graphs.

Registered through the ``pytest11`` entry point, so it is active wherever
yirage is installed. ``--yirage-backend NAME`` (repeatable) picks backends;
without it every available backend is used, and those that cannot compile
kernel graphs yet are reported as skipped with their reason.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("yirage")
    group.addoption("--yirage-backend", action="append", default=[], metavar="NAME",
                    help="run yirage's backend-generic tests on this backend (repeatable; default: all available)")
    group.addoption("--yirage-slow", action="store_true", default=False,
                    help="run more hypothesis examples in yirage's random-graph tests")


_SLOW = False


def pytest_configure(config: pytest.Config) -> None:
    global _SLOW
    _SLOW = bool(config.getoption("--yirage-slow", default=False))


def random_graph_examples() -> int:
    """Hypothesis examples per random-graph test: 100, or 1000 with --yirage-slow (only yirage's tests)."""
    return 1000 if _SLOW else 100


def selected_backends(config: pytest.Config) -> list[str]:
    import yirage as yr

    chosen = config.getoption("--yirage-backend")
    if chosen:
        for name in chosen:
            if not yr.is_backend_available(name):
                try:
                    reason = yr.get_backend_info(name)["reason"]
                except yr.YirageError as exc:
                    reason = str(exc)
                raise pytest.UsageError(f"--yirage-backend {name}: unavailable here: {reason}")
        return list(chosen)
    return [b.value for b in yr.get_available_backends()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "yirage_backend" in metafunc.fixturenames:
        metafunc.parametrize("yirage_backend", selected_backends(metafunc.config), indirect=True)


@pytest.fixture
def yirage_backend(request: pytest.FixtureRequest) -> Any:
    """A backend name whose ``compile`` is implemented, else the test skips with the reason."""
    from yirage.backend.selection import registry

    name = request.param
    backend = registry().get(name)
    if not backend.kernel_dtypes:
        pytest.skip(f"backend {name!r} does not compile kernel graphs yet")
    return name


@pytest.fixture
def yirage_dtypes(yirage_backend: str) -> frozenset[str]:
    from yirage.backend.selection import registry

    return registry().get(yirage_backend).kernel_dtypes
