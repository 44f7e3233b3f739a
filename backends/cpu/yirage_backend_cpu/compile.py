"""Build a plan: render numba source into the cache directory and import it.

numba's ``cache=True`` only works for functions defined in a module file, so
each plan's source lives at ``<cache>/cpu/<key>/kernels.py``; ``key`` is the
hash of the rendered source, which embeds the plan digest (graph, shapes,
dtypes, layouts) and the backend and renderer versions. A second process
finds the file and numba's compiled code beside it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from yirage.compiler.cache import CacheError, cache_root, check_tree, private_dir, private_root, write_private
from yirage.compiler.kernel_ir import KernelPlan
from yirage.errors import YirageError
from yirage_backend_cpu.render import render_module
from yirage_backend_cpu.sources import backend_fingerprint
from yirage_backend_cpu.threads import guard

__all__ = ["CacheError", "CompileError", "backend_fingerprint", "cache_root", "compile_plan"]

logger = logging.getLogger("yirage.cpu")


def _write_if_changed(path: Path, source: str) -> None:
    try:
        current = path.read_text(encoding="utf-8") if path.exists() else None
    except (OSError, UnicodeDecodeError):
        current = "<unreadable>"
    if current == source:
        return
    if current is not None:
        logger.warning("compile-cache file %s differed from its rendering (corrupted or edited); rewriting it", path)
    write_private(path, source)


_LOCK = threading.Lock()  # numba compiles while the module executes: one import at a time


class CompileError(YirageError, RuntimeError):
    """numba could not compile a rendered plan: a renderer bug or an unsupported input, not a cache problem."""


def compile_plan(plan: KernelPlan, version: str) -> tuple[Callable[[Any], list[Any]], Path]:
    source = render_module(plan, f"{version}+{backend_fingerprint()}")
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    root = private_root()
    entry = private_dir(private_dir(root / "cpu") / key)
    path = entry / "kernels.py"
    with _LOCK:
        _write_if_changed(path, source)
        return guard(_load(f"yirage_cpu_plan_{key}", path)), path


def numba_cache_dirs(path: Path) -> list[Path]:
    """Where numba keeps the compiled code of ``path``'s functions: beside it, or below ``NUMBA_CACHE_DIR``."""
    from numba.core import caching, config

    dirs = [path.parent / "__pycache__"]
    if config.CACHE_DIR:
        dirs.append(Path(config.CACHE_DIR) / caching._CacheLocator.get_suitable_cache_subpath(str(path)))
    return dirs


def _load(name: str, path: Path) -> Callable[[Any], list[Any]]:
    module = sys.modules.get(name)
    if module is not None:
        return module.run
    caches = numba_cache_dirs(path)
    for directory in [path.parent, *caches]:
        check_tree(directory)  # before numba unpickles anything from there
    try:
        module = _import(name, path)
    except Exception as exc:  # noqa: BLE001 - numba's cache files may be stale or corrupted: rebuild once
        logger.warning("loading %s failed (%s: %s); clearing its numba cache (%s) and compiling again",
                       path, type(exc).__name__, exc, ", ".join(map(str, caches)))
        for directory in caches:
            shutil.rmtree(directory, ignore_errors=True)
        try:
            module = _import(name, path)
        except Exception as again:  # noqa: BLE001 - reported with the path and what to do
            raise CompileError(
                f"numba could not compile the kernels rendered in {path} ({type(again).__name__}: {again}). "
                "The cache was cleared and the plan rebuilt, so this is not a corrupted cache: it is a bug in "
                "yirage's CPU renderer or an input it does not support; please report it with the graph "
                "(g.to_json()) and this message"
            ) from again
    return module.run


def _import(name: str, path: Path) -> Any:
    """Import the generated module under a stable name (numba's cache records it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
