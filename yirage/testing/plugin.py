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
                    help="run ten times as many seeded random graphs in yirage's random-graph tests")


_SLOW = False


def pytest_configure(config: pytest.Config) -> None:
    global _SLOW
    _SLOW = bool(config.getoption("--yirage-slow", default=False))


#: seeded random graphs per backend in the kit (every one is a compile on a real backend)
RANDOM_GRAPHS, RANDOM_GRAPHS_SLOW = 40, 400


def random_graph_examples() -> int:
    """Random graphs (seeds 0..n-1) per random-graph test: 40, or 400 with --yirage-slow."""
    return RANDOM_GRAPHS_SLOW if _SLOW else RANDOM_GRAPHS


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
    if "yirage_graph_seed" in metafunc.fixturenames:  # the seed is in the test id: a failure names its graph
        slow = metafunc.config.getoption("--yirage-slow", default=False)
        metafunc.parametrize("yirage_graph_seed", range(RANDOM_GRAPHS_SLOW if slow else RANDOM_GRAPHS),
                             ids=lambda seed: f"seed{seed}")


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
def yirage_is_oracle(yirage_backend: str) -> bool:
    """True for the reference backend, which IS ``run_reference``: a case whose only oracle is
    ``run_reference`` would compare it with itself, so such cases skip there."""
    from yirage.backend.selection import registry
    from yirage.reference.backend import ReferenceBackend

    return isinstance(registry().get(yirage_backend), ReferenceBackend)


@pytest.fixture
def yirage_dtypes(yirage_backend: str) -> frozenset[str]:
    from yirage.backend.selection import registry

    return registry().get(yirage_backend).kernel_dtypes
