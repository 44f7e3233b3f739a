"""Build a plan: render numba source into the cache directory and import it.

numba's ``cache=True`` only works for functions defined in a module file, so
each plan's source lives at ``<cache>/cpu/<key>/kernels.py``; ``key`` is the
hash of the rendered source, which embeds the plan digest (graph, shapes,
dtypes, layouts) and the backend and renderer versions. A second process
finds the file and numba's compiled code beside it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from yirage.compiler.kernel_ir import KernelPlan
from yirage.errors import YirageError
from yirage_backend_cpu.render import render_module

logger = logging.getLogger("yirage.cpu")


class CacheError(YirageError, RuntimeError):
    """A compile-cache entry that cannot be written or loaded."""


def cache_root() -> Path:
    base = os.environ.get("YIRAGE_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "yirage"


def _write_if_changed(path: Path, source: str) -> None:
    try:
        current = path.read_text(encoding="utf-8") if path.exists() else None
    except (OSError, UnicodeDecodeError):
        current = "<unreadable>"
    if current == source:
        return
    if current is not None:
        logger.warning("compile-cache file %s differed from its rendering (corrupted or edited); rewriting it", path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(source, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise CacheError(
            f"cannot write the compile cache at {path}: {exc}; set YIRAGE_CACHE_DIR to a writable directory"
        ) from exc


_LOCK = threading.Lock()  # numba compiles while the module executes: one import at a time


@functools.cache
def backend_fingerprint() -> str:
    """Hash of the backend's own sources: generated kernels inline kernel_lib, which numba does not track."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for f in sorted(here.glob("*.py")):
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def compile_plan(plan: KernelPlan, version: str) -> tuple[Callable[[Any], list[Any]], Path]:
    source = render_module(plan, f"{version}+{backend_fingerprint()}")
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    path = cache_root() / "cpu" / key / "kernels.py"
    with _LOCK:
        _write_if_changed(path, source)
        return _load(f"yirage_cpu_plan_{key}", path), path


def _load(name: str, path: Path) -> Callable[[Any], list[Any]]:
    module = sys.modules.get(name)
    if module is None:
        try:
            module = _import(name, path)
        except Exception as exc:  # noqa: BLE001 - numba's cache files may be stale or corrupted: rebuild once
            logger.warning("loading %s failed (%s: %s); clearing its numba cache and compiling again",
                           path, type(exc).__name__, exc)
            shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)
            try:
                module = _import(name, path)
            except Exception as again:  # noqa: BLE001 - reported with the path and the fix
                raise CacheError(
                    f"compiling the kernels in {path} failed ({type(again).__name__}: {again}); "
                    f"delete {path.parent} and run again, and report the error if it persists"
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
