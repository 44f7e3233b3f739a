"""One fingerprint of the backend's own sources, and numba caches tied to it.

numba re-checks only the file a cached function is defined in (its mtime
and size), yet ``pk_runtime.decode`` inlines code from ``pk_tasks`` and
``kernel_lib``: edit ``kernel_lib`` alone and the cached decode loop keeps
the old code. ``tie_caches_to_sources`` adds the fingerprint of every
backend source file to the freshness stamp of each cached function in a
module, so any change to any of them recompiles them all.

numba caches a module's functions beside it (``__pycache__``) or in the user's
cache (``~/.cache/numba``); in a read-only install with an unwritable HOME
neither works and every ``cache=True`` function of the backend fails to import
("no locator available"). Importing this module adds a last-resort locator for
the backend's own files: ``numba/`` in the yirage compile cache, so setting
``YIRAGE_CACHE_DIR`` is enough; when that fails too, the import fails with a
CacheError that names each place tried and that fix.
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


def _fallback_locator(caching: Any) -> type:
    """numba's locator for the backend's own files, below ``<yirage cache>/numba`` (private, 0700)."""
    from yirage.compiler.cache import CacheError, private_dir, private_root

    user_wide = getattr(caching, "UserWideCacheLocator", None) or caching._UserWideCacheLocator

    class YirageCacheLocator(user_wide):
        """Tried after numba's own locators, for files of this package only."""

        yirage_fallback = True

        def __init__(self, py_func: Any, py_file: str) -> None:
            super().__init__(py_func, py_file)
            self._cache_path = str(private_dir(private_dir(private_root() / "numba")
                                               / self.get_suitable_cache_subpath(py_file)))

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            if Path(py_file).resolve().parent != PACKAGE:
                return None
            try:
                locator = cls(py_func, py_file)
                locator.ensure_cache_path()
            except (CacheError, OSError) as exc:
                user_cache = user_wide(py_func, py_file).get_cache_path()
                raise CacheError(
                    f"numba cannot cache the compiled code of {py_file}: no writable place for it. Beside it "
                    f"({Path(py_file).parent / '__pycache__'}) is not writable (a read-only install?), nor is numba's "
                    f"user cache ({user_cache}: HOME or XDG_CACHE_HOME), nor the yirage compile cache ({exc}). Set "
                    "YIRAGE_CACHE_DIR to a directory you can write (yirage keeps numba's cache of its own code there "
                    "when the others fail), or NUMBA_CACHE_DIR") from exc
            return locator

    return YirageCacheLocator


def _register_fallback_locator() -> None:
    """Append the locator above to numba's list, once (numba tries its own locators first)."""
    try:
        from numba.core import caching
    except ImportError:  # numba is not installed: the backend's probe reports that, and there is nothing to cache
        return
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list):
        logger.debug("numba's cache locators changed layout; a read-only install needs NUMBA_CACHE_DIR")
        return
    if not any(getattr(c, "yirage_fallback", False) for c in classes):
        classes.append(_fallback_locator(caching))


PACKAGE = Path(__file__).resolve().parent
_register_fallback_locator()  # before any module of the backend defines a cache=True function


def tie_caches_to_sources(namespace: dict[str, Any]) -> None:
    """Make every cached numba function in ``namespace`` stale when any backend source changes.

    Also refuse a cache directory others could write (numba unpickles its index files): with
    ``NUMBA_CACHE_DIR`` pointing at a shared directory, another user could plant one there.
    """
    from numba.core.caching import IndexDataCacheFile
    from numba.core.ccallback import CFunc
    from numba.core.registry import CPUDispatcher

    from yirage.compiler.cache import check_tree

    for value in list(namespace.values()):  # jitted functions, and C entry points (pk_entry: not compiled yet)
        if not isinstance(value, CPUDispatcher | CFunc) or value.__module__ != namespace.get("__name__"):
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
