"""Locks that survive ``fork()``.

A child forked while another thread of the parent held a lock inherits the
lock held, but not the thread that would release it: the first
``with lock:`` in the child waits forever (a multiprocessing ``fork`` worker
created while a thread was inside ``pk(...)`` or ``engine.generate`` hangs).
``ForkSafeRLock`` notices it is used in a different process than the one it
was created (or last reset) in and starts over with a fresh lock there.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType
from typing import Any

_guard = threading.Lock()  # serializes the replacement of a lock; itself replaced in a forked child
_locks: weakref.WeakSet[ForkSafeRLock] = weakref.WeakSet()


class ForkSafeRLock:
    """A ``threading.RLock`` that is replaced by a fresh one in a forked child.

    Use it like an RLock (``with lock:``, ``acquire``/``release``). In the
    parent nothing changes. In a child, the threads that may have held it do
    not exist, so whatever they protected may be half-updated: callers must
    leave data they hand to compiled code consistent between calls (the
    PersistentKernel re-validates its tensors before every run).
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.RLock()
        _locks.add(self)

    def _current(self) -> Any:
        if self._pid != os.getpid():
            with _guard:
                if self._pid != os.getpid():  # another thread of the child may have reset it meanwhile
                    self._reset()
        return self._lock

    def _reset(self) -> None:
        """A fresh lock for this process, unless the thread that forked holds it (it exists here and releases it)."""
        if not self._lock._is_owned():
            self._lock = threading.RLock()
        self._pid = os.getpid()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self._current().acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<ForkSafeRLock pid={self._pid} {self._lock!r}>"


def _after_fork_in_child() -> None:
    """A fresh guard (the parent's may have been held at fork) and fresh locks, before any child code runs."""
    global _guard
    _guard = threading.Lock()
    for lock in list(_locks):
        lock._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
