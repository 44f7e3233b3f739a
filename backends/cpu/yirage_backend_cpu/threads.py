"""numba's threading layer: pick one that survives fork() and concurrent callers.

numba's GNU OpenMP layer kills a forked child (SIGTERM, "fork() called from
a process already using GNU OpenMP") the moment the child launches a parallel
kernel, as a multiprocessing DataLoader worker does. Its TBB layer is both
fork-safe and thread-safe, and measured as fast here (W1-W4, see the issue-7
note), so the CPU backend depends on the ``tbb`` wheel and makes it loadable:
the wheel puts ``libtbb.so.12`` in ``<prefix>/lib``, which the dynamic loader
does not search in a virtualenv, so it is preloaded by path before numba
chooses a layer. A user's own ``NUMBA_THREADING_LAYER`` is respected; if it
is OpenMP, a forked child gets a clear error instead of being killed, and
with the workqueue layer (neither fork- nor thread-safe) launches are
serialized.
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
    """Make TBB loadable (once, before numba launches a thread pool); return the layer numba is set to use."""
    import numba

    wanted = str(numba.config.THREADING_LAYER)
    if wanted in ("default", "safe", "threadsafe", "forksafe", "tbb") and _preload_tbb():
        wanted = "tbb"
    _state["serial"] = wanted == "workqueue"
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
    return wanted


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
            "multiprocessing_context='spawn')), or let yirage use TBB: pip install tbb and leave "
            "NUMBA_THREADING_LAYER unset")


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


def serialized() -> Any:
    """A context manager that serializes launches when the layer requires it (a no-op otherwise)."""
    import contextlib

    return _serial_lock if _state["serial"] else contextlib.nullcontext()
