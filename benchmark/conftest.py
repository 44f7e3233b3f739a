"""pytest-benchmark setup for the files under benchmark/ (not collected by `make test`: testpaths is tests/).

    .venv/bin/python -m pytest benchmark/ --benchmark-only [--workload-shape 1,64,256]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmark scripts import each other as top-level modules (timing, ...)
    sys.path.insert(0, str(HERE))

from bench_workloads import Shape  # noqa: E402 - needs the path above

from yirage import system  # noqa: E402

SHAPE_KEY = pytest.StashKey[Shape]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--workload-shape", default="1,64,256", metavar="B,S,H",
                     help="batch, sequence length and hidden size of the microbenchmarks (default 1,64,256)")


def pytest_configure(config: pytest.Config) -> None:
    """Check --workload-shape once, before collection, so a bad value is one clear usage error."""
    text = config.getoption("--workload-shape")
    try:
        batch, seq, hidden = (int(part) for part in text.split(","))
    except ValueError:
        raise pytest.UsageError(f"--workload-shape {text!r}: give three positive integers B,S,H such as 1,64,256"
                                ) from None
    if min(batch, seq, hidden) < 1 or hidden % 64:
        raise pytest.UsageError(f"--workload-shape {text!r}: sizes must be positive and H a multiple of 64 "
                                "(attention uses heads of 64), e.g. 1,64,256")
    config.stash[SHAPE_KEY] = Shape(batch, seq, hidden)


@pytest.fixture(scope="session")
def workload_shape(request: pytest.FixtureRequest) -> Shape:
    """The --workload-shape option as a Shape."""
    return request.config.stash[SHAPE_KEY]


@pytest.fixture(scope="session", autouse=True)
def torch_threads() -> None:
    """One torch thread per physical core, as the scripts use (torch's default may count SMT siblings)."""
    torch.set_num_threads(system.host_facts()["physical_cores"] or torch.get_num_threads())
