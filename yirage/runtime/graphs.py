"""Compiling kernel graphs: the per-graph executable cache behind ``g.compile()`` and ``g(...)``.

The graph layer is pure IR, so the cache lives here, outside the graph. It is
keyed by the graph's identity (a graph's hash and ``==`` compare content, and
two equal graphs are still two programs a user may change apart), then by the
graph's digest and the backend: adding an op changes the digest, so nothing
compiled before the change is returned after it. An executable is built from
a copy of the graph, so it never refers back to the user's graph: the cache
entry goes when the graph is garbage collected.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from yirage.backend.base import Backend
from yirage.compiler.lower import build_plan
from yirage.graph.kernel_graph import KernelGraph, install_compiler
from yirage.locks import ForkSafeRLock
from yirage.runtime.executable import BackendOutputError, Executable, plugin_of

logger = logging.getLogger("yirage.runtime")


class _Entry:
    """The executables of one graph, for one content of it, and the dtypes that content computes in."""

    __slots__ = ("digest", "dtypes", "executables", "graph")

    def __init__(self, graph: weakref.ref[KernelGraph], digest: str, dtypes: frozenset[str]) -> None:
        self.graph = graph
        self.digest = digest
        self.dtypes = dtypes
        self.executables: dict[str, Executable] = {}


_entries: dict[int, _Entry] = {}  # id(graph) -> entry; removed by a weakref callback when the graph dies
_lock = ForkSafeRLock()  # guards changes to _entries; lookups are single dict reads and need none


def _forget(key: int, ref: weakref.ref[KernelGraph]) -> None:
    """Weakref callback: the graph is gone (this runs before its id can be reused)."""
    with _lock:
        entry = _entries.get(key)
        if entry is not None and entry.graph is ref:
            del _entries[key]


def _entry(graph: KernelGraph) -> _Entry | None:
    """The cache entry of this graph as it is now, if any."""
    entry = _entries.get(id(graph))
    if entry is None or entry.graph() is not graph or entry.digest != graph.digest:
        return None
    return entry


def cached(graph: KernelGraph, backend_name: str) -> Executable | None:
    """The executable compiled for this graph, as it is now, on ``backend_name``; None if there is none."""
    entry = _entry(graph)
    return None if entry is None else entry.executables.get(backend_name)


def _store(graph: KernelGraph, digest: str, exe: Executable, dtypes: frozenset[str]) -> Executable:
    """Keep ``exe`` for ``graph`` unless the graph changed meanwhile; a racing thread's twin wins if first."""
    with _lock:
        if graph.digest != digest:
            return exe  # the graph changed while we compiled: do not cache what it no longer is
        key = id(graph)
        entry = _entries.get(key)
        if entry is None or entry.graph() is not graph or entry.digest != digest:
            entry = _Entry(weakref.ref(graph, lambda ref, key=key: _forget(key, ref)), digest, dtypes)
            _entries[key] = entry  # a stale entry (older content) goes with its executables
        return entry.executables.setdefault(exe.backend.name, exe)


def graph_dtypes(graph: KernelGraph) -> frozenset[str]:
    """Every dtype the graph computes in (inputs and intermediates): what its backend must compile."""
    return frozenset(node.dtype.name for node in graph.nodes)


def compile_graph(graph: KernelGraph, backend: Any = None) -> Executable:
    """Compile once per (backend, graph content); later calls reuse the executable.

    Without a named backend, auto picks the best one that compiles kernel graphs in this graph's dtypes
    (checked here, where the dtypes are known); a named one that cannot raises NotSupportedError.
    """
    from yirage.backend.selection import current_backend, resolve

    entry = _entry(graph)
    dtypes = graph_dtypes(graph) if entry is None else entry.dtypes  # the entry's: no walk over the nodes per call
    chosen: Backend = (current_backend(need="kernel_graphs", dtypes=dtypes) if backend is None
                       else resolve(backend, need="kernel_graphs", dtypes=dtypes))
    exe = None if entry is None else entry.executables.get(chosen.name)
    if exe is not None:
        return exe
    logger.debug("compiling graph %s (%d nodes, dtypes %s) for backend %r", graph.digest[:12], len(graph.nodes),
                 ", ".join(sorted(dtypes)), chosen.name)
    snapshot = graph.copy()  # what is compiled; later ops added to ``graph`` cannot reach it
    digest = snapshot.digest
    started = time.perf_counter()
    plan = build_plan(snapshot)
    run = chosen.compile(plan, snapshot)
    if not callable(run):
        raise BackendOutputError(f"backend {chosen.name!r} (from {plugin_of(chosen)}) returned {run!r} from "
                                 "compile(plan, graph) instead of a run(inputs) function. This is a bug in the plugin: "
                                 "report it to its authors, and compile with another backend meanwhile")
    seconds = time.perf_counter() - started
    logger.info("compiled graph %s for %s in %.3f s (%d kernels)", digest[:12], chosen.name, seconds,
                len(plan.kernels))
    return _store(graph, digest, Executable(snapshot, plan, chosen, run, seconds), graph_dtypes(snapshot))


def new_kernel_graph(backend: Any = None) -> KernelGraph:
    """Start a kernel graph; ``backend`` defaults to the process default at compile time.

    Unset, auto picks (when compiling) the best backend that compiles kernel graphs in the graph's
    dtypes; a named backend must be able to compile kernel graphs at all (checked now, with the reason).
    """
    if backend is not None:
        from yirage.backend.selection import resolve

        # fail early, with the reason: unknown, unavailable, or unable to compile kernel graphs
        backend = resolve(backend, "new_kernel_graph(backend=...)", need="kernel_graphs").name
    return KernelGraph(backend=backend)


install_compiler(compile_graph)
