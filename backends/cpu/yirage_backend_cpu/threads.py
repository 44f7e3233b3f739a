"""numba's threading layer: fast beside torch, and safe after fork() and across threads.

OpenMP is the default, on purpose: torch's own threads are GNU OpenMP, and
numba's OpenMP layer shares that thread pool, while TBB competes with
torch's spinning threads. Measured on W1 B=8 and W2 with yirage calls
interleaved with torch calls (the issue-7 note): TBB 0.45-0.69x of
OpenMP's speed; alone they tie. GNU OpenMP cannot run in a child forked
after the parent ran parallel kernels (numba kills that child with
SIGTERM), so such a child gets a clear ``ForkError`` instead, naming the
fixes: the 'spawn'/'forkserver' start methods, or the TBB layer
(``pip install yirage-backend-cpu[tbb]`` and ``NUMBA_THREADING_LAYER=tbb``),
which is fork-safe. The tbb wheel puts ``libtbb.so.12`` in ``<prefix>/lib``,
which the dynamic loader does not search in a virtualenv, so it is
preloaded by path when TBB is asked for. With the workqueue layer (neither
fork- nor thread-safe) launches are serialized.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from importlib import metadata
from typing import Any

from yirage.errors import YirageError
from yirage.locks import ForkSafeRLock

logger = logging.getLogger("yirage.cpu")


class ForkError(YirageError, RuntimeError):
    """A compiled CPU kernel called in a child forked from a process whose threading layer cannot survive it."""


_state = {"forked_from": "", "serial": False}
_serial_lock = ForkSafeRLock()  # a child forked mid-launch must not inherit it held


@functools.cache
def prepare() -> str:
    """Choose the layer (once, before numba launches a thread pool); return the one numba is set to use."""
    import numba

    wanted = str(numba.config.THREADING_LAYER)
    if wanted == "default" and not os.environ.get("NUMBA_THREADING_LAYER_PRIORITY"):
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]  # see the module docstring
    if wanted in ("tbb", "safe", "forksafe", "threadsafe"):
        _preload_tbb()
    _state["serial"] = wanted == "workqueue"
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
    return "omp" if wanted == "default" else wanted


def _preload_tbb() -> bool:
    try:
        files = metadata.files("tbb") or []
    except metadata.PackageNotFoundError:
        return False
    for f in files:
        if f.name == "libtbb.so.12":
            path = f.locate()
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                logger.warning("could not load TBB from %s (%s); numba falls back to another threading layer",
                               path, exc)
                return False
            return True
    return False


def active_layer() -> str:
    """The layer numba launched with, or '' before its first parallel kernel."""
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:  # no parallel kernel has run yet
        return ""


def _after_fork_in_child() -> None:
    import sys

    if "numba" not in sys.modules:
        return
    layer = active_layer()
    if layer in ("omp", "workqueue"):
        _state["forked_from"] = layer


def check_fork() -> None:
    """Raise instead of letting numba kill a child forked after the parent ran parallel kernels."""
    layer = _state["forked_from"]
    if layer:
        raise ForkError(
            f"this process was forked from one that had run parallel numba kernels with the {layer!r} threading "
            "layer, which cannot run again after fork() (numba would kill this process). Use the 'spawn' or "
            "'forkserver' start method (multiprocessing.set_start_method('spawn'), or DataLoader("
            "multiprocessing_context='spawn')), or the fork-safe TBB layer: pip install "
            "'yirage-backend-cpu[tbb]' and set NUMBA_THREADING_LAYER=tbb")


def guard(run: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
    """Wrap a compiled launcher with the fork check and, on the workqueue layer, one launch at a time."""

    def guarded(inputs: Any) -> list[Any]:
        if _state["forked_from"]:
            check_fork()
        if _state["serial"]:
            with _serial_lock:
                return run(inputs)
        return run(inputs)

    guarded.__wrapped__ = run  # type: ignore[attr-defined]
    return guarded


def with_threads(run: Callable[[Any], list[Any]], threads: int | None) -> Callable[[Any], list[Any]]:
    """``run`` on at most ``threads`` numba threads (an applied configuration's count); None: numba's default.

    numba's thread count is per calling thread, so it is set around each call and restored.
    """
    if threads is None:
        return run
    import numba

    count = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))

    def limited(inputs: Any) -> list[Any]:
        previous = numba.get_num_threads()
        numba.set_num_threads(count)
        try:
            return run(inputs)
        finally:
            numba.set_num_threads(previous)

    limited.__wrapped__ = run  # type: ignore[attr-defined]
    limited.threads = count  # type: ignore[attr-defined]
    return limited


def serialized() -> Any:
    """A context manager that serializes launches when the layer requires it (a no-op otherwise)."""
    import contextlib

    return _serial_lock if _state["serial"] else contextlib.nullcontext()
