"""Programs loaded in this process, at most one per key: the one cache behind every backend's ``load``.

Why: on a compile-cache hit, loading is what is left to pay (a module import, an OpenCL or Metal compile, a
cubin load) and a loaded program holds device state (kernels, buffers) worth sharing between the compiled
graphs of one plan. Each backend used to keep a dict and a lock of its own for that; this module is the one
copy. ``stages.Artifact.load_once`` keys it by the cache entry (``compile_cached``'s key: a digest of source,
backend fingerprint and target, so two backends never share a key) and a scope the backend adds (the device a
program is loaded on, say); a backend's runtime that has no cache entry (the PersistentKernel's) keys it
with ``stages.cache_key`` of its source.

Thread-safe under one re-entrant lock, held while a program loads: two threads asking for the same key load it
once; a load that itself loads a program (it may) does not deadlock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_programs: dict[tuple[str, Hashable], Any] = {}
_lock = threading.RLock()


def load_once(key: str, load: Callable[[], T], *, scope: Hashable = (), reload: bool = False) -> T:
    """``load()``'s program for ``(key, scope)``: loaded on the first call in this process, then reused.

    ``reload``: load again and replace the kept program (the entry was just rebuilt, so an earlier program
    may come from different files).
    """
    with _lock:
        program = _programs.get((key, scope))
        if program is None or reload:
            program = load()
            _programs[(key, scope)] = program
        return program


__all__ = ["load_once"]
