"""One fingerprint of the backend's own sources, and numba caches tied to it.

numba re-checks only the file a cached function is defined in (its mtime
and size), yet ``pk_runtime.decode`` inlines code from ``pk_tasks`` and
``kernel_lib``: edit ``kernel_lib`` alone and the cached decode loop keeps
the old code. ``tie_caches_to_sources`` adds the fingerprint of every
backend source file to the freshness stamp of each cached function in a
module, so any change to any of them recompiles them all.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from yirage.codegen.fingerprint import source_fingerprint

logger = logging.getLogger("yirage.cpu")


def backend_fingerprint() -> str:
    """Hash of the backend's own sources and of the core's descriptor and control-buffer layouts (the decode
    loop reads their columns and slots, frozen into its code).

    Generated kernels and cached functions depend on all of them.
    """
    from yirage.persistent import control, specs

    core = Path(specs.__file__).parent
    return "-".join([source_fingerprint(Path(__file__).parent), source_fingerprint(core, Path(specs.__file__).name),
                     source_fingerprint(core, Path(control.__file__).name)])


_checked: set[str] = set()


def tie_caches_to_sources(namespace: dict[str, Any]) -> None:
    """Make every cached numba function in ``namespace`` stale when any backend source changes.

    Also refuse a cache directory others could write (numba unpickles its index files): with
    ``NUMBA_CACHE_DIR`` pointing at a shared directory, another user could plant one there.
    """
    from numba.core.caching import IndexDataCacheFile
    from numba.core.registry import CPUDispatcher

    from yirage.compiler.cache import check_tree

    for value in list(namespace.values()):
        if not isinstance(value, CPUDispatcher) or value.__module__ != namespace.get("__name__"):
            continue
        cache_dir = getattr(getattr(value, "_cache", None), "_cache_path", None)
        if isinstance(cache_dir, str) and cache_dir not in _checked:
            check_tree(Path(cache_dir), tighten=True)  # before numba loads anything from it
            _checked.add(cache_dir)
        cache_file = getattr(getattr(value, "_cache", None), "_cache_file", None)
        if not isinstance(cache_file, IndexDataCacheFile) or not hasattr(cache_file, "_source_stamp"):
            logger.debug("numba's cache layout changed; %s keeps its own freshness check", value.__name__)
            continue
        cache_file._source_stamp = (cache_file._source_stamp, backend_fingerprint())
