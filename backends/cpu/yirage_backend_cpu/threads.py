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
import threading
import time
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


class AdaptiveThreads:
    """A compiled launcher that runs on all its threads or on fewer, whichever measured faster lately.

    numba splits a parallel loop evenly and waits for every thread at its end; when another process keeps one core
    busy, the thread that shares that core finishes its half late (and the call waits up to a scheduler time slice
    for it). Measured on 2 cores beside one busy process (RMSNorm -> 4096 x 4096 linear, weights rotating over 6
    copies, benchmark/kernel_graphs.py's W1 B=1 by hand): 6.4 ms a call on 2 threads, 3.6 ms on 1, torch eager 4.3
    ms in the same run; quiet: 2.5 ms on 2 threads, 3.6 on 1. So each launcher keeps a running estimate (``ALPHA``)
    of its call time at each count in ``counts`` (all threads first), runs the fastest, and gives another count one
    call in ``EXPLORE`` so that a load that came or went shows up. Calls faster than ``MIN_SECONDS`` are too short
    for a time slice to matter and for the thread-count switch (~3 us) to pay: after ``WARM`` calls they run on all
    threads with nothing measured (on the caller's own numba setting, unless an applied configuration caps the
    count). A caller that lowered numba's thread count keeps that cap. Thread-safe: numba's thread count belongs to
    the calling thread, and the estimates are updated under a lock.
    """

    ALPHA = 0.5  # weight of the newest call in a count's estimate: one exploring call moves it halfway
    EXPLORE = 32
    MIN_SECONDS = 200e-6
    WARM = 3
    clock = staticmethod(time.perf_counter)  # replaceable by a test

    def __init__(self, run: Callable[[Any], list[Any]], counts: tuple[int, ...]) -> None:
        import numba

        self.run, self.counts = run, counts
        self.capped = counts[0] < numba.config.NUMBA_NUM_THREADS  # an applied configuration's count
        self.estimate: dict[int, float | None] = dict.fromkeys(counts)
        self.calls = 0
        self.small = False
        self.fastest_warm = float("inf")
        self._lock = threading.Lock()
        self.__wrapped__ = run

    def __call__(self, inputs: Any) -> list[Any]:
        import numba

        if self.small and not self.capped:
            return self.run(inputs)  # the caller's own numba setting applies, as for any numba code
        previous = numba.get_num_threads()
        count = self.counts[0] if self.small else self.pick()
        numba.set_num_threads(min(count, previous))  # a caller who lowered numba's count keeps that cap
        start = self.clock()
        try:
            out = self.run(inputs)
        finally:
            numba.set_num_threads(previous)
        if not self.small:
            self.record(count, self.clock() - start)  # a call that raised says nothing about its speed
        return out

    def pick(self) -> int:
        with self._lock:
            self.calls += 1
            full = self.counts[0]
            if self.calls <= self.WARM or len(self.counts) == 1:
                return full
            untried = [c for c in self.counts if self.estimate[c] is None]
            if untried:
                return untried[0]
            ranked = sorted(self.counts, key=lambda c: self.estimate[c])  # type: ignore[arg-type, return-value]
            if self.calls % self.EXPLORE == 0:
                return ranked[1 + (self.calls // self.EXPLORE) % (len(ranked) - 1)]
            return ranked[0]

    def record(self, count: int, seconds: float) -> None:
        with self._lock:
            if self.calls <= self.WARM:  # warm-up: the fastest call counts (the first one pays numba's dispatch)
                self.fastest_warm = min(self.fastest_warm, seconds)
                if self.calls == self.WARM:
                    self.estimate[count] = self.fastest_warm
                    self.small = self.fastest_warm < self.MIN_SECONDS
                return
            old = self.estimate[count]
            self.estimate[count] = seconds if old is None else old + self.ALPHA * (seconds - old)


def adaptive_threads(run: Callable[[Any], list[Any]], threads: int | None) -> Callable[[Any], list[Any]]:
    """``run`` on at most ``threads`` numba threads (an applied configuration's count; None: numba's), or on half
    or one of them where that measured faster (``AdaptiveThreads``)."""
    import numba

    top = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)) if threads is not None else \
        numba.config.NUMBA_NUM_THREADS
    return AdaptiveThreads(run, tuple(dict.fromkeys((top, max(1, top // 2), 1))))


def serialized() -> Any:
    """A context manager that serializes launches when the layer requires it (a no-op otherwise)."""
    import contextlib

    return _serial_lock if _state["serial"] else contextlib.nullcontext()
