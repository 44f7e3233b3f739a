"""The numba stages of the CPU backend: render a plan as a module, write it, import it.

numba's ``cache=True`` only works for functions defined in a module file, so
``build`` writes each plan's source to ``<cache>/cpu/<key>/kernels.py``, an
entry of the core's cache (``yirage.compiler.stages.compile_cached``: key =
hash of the source, which embeds the plan digest, and of the backend's
fingerprint and thread count; the manifest catches a damaged file). ``load``
imports it; numba compiles on import and keeps its compiled code beside it
(or below ``NUMBA_CACHE_DIR``), where a second process finds it. numba's own
cache files are checked for ownership before it unpickles them, and a load
that fails on them clears them and compiles once more.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from yirage.compiler.cache import CacheError, cache_root, check_tree, clear_irregular, read_private, write_private
from yirage.compiler.kernel_ir import KernelPlan
from yirage.compiler.stages import Artifact, compile_cached
from yirage.errors import YirageError
from yirage_backend_cpu.render import render_module
from yirage_backend_cpu.sources import backend_fingerprint
from yirage_backend_cpu.threads import guard

__all__ = ["CacheError", "CompileError", "backend_fingerprint", "build", "cache_root", "compile_plan", "load",
           "render"]

logger = logging.getLogger("yirage.cpu")

SOURCE_NAME = "kernels.py"


def render(plan: KernelPlan, fingerprint: str) -> str:
    """Stage 1: the numba module of ``plan``; its header names ``fingerprint`` (version + sources)."""
    return render_module(plan, fingerprint)


def build(source: str, workdir: Path) -> Path:
    """Stage 2: write the module; an identical file is left alone so numba's cache stamp stays valid.

    A directory or FIFO in its place (a corrupted entry: ``workdir`` is a private, checked entry) is removed first.
    """
    path = workdir / SOURCE_NAME
    clear_irregular(path)
    try:
        current = read_private(path).decode("utf-8") if path.exists() else None
    except (OSError, UnicodeDecodeError):
        current = None  # unreadable or torn: written again below
    if current != source:
        write_private(path, source)
    return path


def load(artifact: Artifact) -> Callable[[Any], list[Any]]:
    """Stage 3: import the module (numba compiles or loads its cache) and guard its launcher."""
    with _LOCK:
        return guard(_load(f"yirage_cpu_plan_{artifact.key}", artifact.path))


def compile_plan(backend: Any, plan: KernelPlan) -> Callable[[Any], list[Any]]:
    """render -> build (on a cache miss) -> load, through the core's one cache."""
    return compile_cached(backend, plan)


_LOCK = threading.Lock()  # numba compiles while the module executes: one import at a time


class CompileError(YirageError, RuntimeError):
    """numba could not compile a rendered plan: a renderer bug or an unsupported input, not a cache problem."""


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
    except CacheError:
        raise  # no writable or trustworthy place for numba's cache (it names it and the fix): not a compile failure
    except Exception as exc:  # noqa: BLE001 - numba's cache files may be stale or corrupted: rebuild once
        logger.warning("loading %s failed (%s: %s); clearing its numba cache (%s) and compiling again",
                       path, type(exc).__name__, exc, ", ".join(map(str, caches)))
        for directory in caches:
            shutil.rmtree(directory, ignore_errors=True)
        try:
            module = _import(name, path)
        except CacheError:
            raise
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
