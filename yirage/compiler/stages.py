"""Compile in stages with one cache: render -> build -> load, for every backend.

A backend spells a plan as source (``render``), turns source into files in a
work directory (``build``: a compiler run, or just writing the file for numba)
and turns those files into a launcher (``load``). ``compile_cached`` is the
only place that decides whether ``build`` runs: the entry is keyed by a hash of
the rendered source, the backend's fingerprint (its own sources and versions)
and its target (device arch, thread count), so anything that changes the
generated code or what it was built for lands in a new entry. Each entry
carries a manifest with the sha256 of every file ``build`` produced; a file
that no longer matches (a crash mid-write, an edit, disk damage) is rebuilt
with a warning instead of being loaded; so is an entry whose manifest or file
became a directory, FIFO or anything else but a regular file (removed first:
the entry is private, and reading a FIFO would block forever). Entries are
0700 and checked with cache.py's ownership rules before anything in them is
trusted.

What ``load`` returns is kept for the process by ``Artifact.load_once`` (``loaded.py``: one cache, one
lock for every backend), so a plan compiled again, by another graph object or thread, reuses the loaded
program instead of importing or compiling it again; a rebuilt entry is loaded again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from yirage.compiler.cache import (
    check_private,
    check_tree,
    clear_irregular,
    private_dir,
    private_root,
    read_private,
    write_private,
)
from yirage.compiler.loaded import load_once
from yirage.errors import PluginError

logger = logging.getLogger("yirage.compiler")

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
KEY_CHARS = 24  # 96 bits of the digest name an entry
T = TypeVar("T")


class StagedBackend(Protocol):
    """The stages ``compile_cached`` drives (``yirage.backend.base.Backend`` implements and documents them)."""

    name: str

    def render(self, plan: Any) -> str: ...
    def build(self, source: str, workdir: Path) -> Path | Sequence[Path]: ...
    def load(self, artifact: Artifact) -> Any: ...
    def fingerprint(self) -> str: ...
    def target(self) -> str: ...


@dataclass(frozen=True)
class Artifact:
    """What ``build`` left in a cache entry, verified against the manifest before ``load`` sees it.

    ``files`` are names relative to ``directory``, the main one first; ``rebuilt``
    says whether ``build`` ran in this call (False: served from the cache).
    """

    directory: Path
    files: tuple[str, ...]
    key: str
    rebuilt: bool

    @property
    def path(self) -> Path:
        """The main file (the first one ``build`` returned)."""
        return self.directory / self.files[0]

    def load_once(self, load: Callable[[], T], scope: Hashable = ()) -> T:
        """``load()`` once per process for this entry, and again after it was rebuilt; what a backend's
        ``load`` wraps its loading in. ``scope``: what else the program depends on (e.g. the device index)."""
        return load_once(self.key, load, scope=scope, reload=self.rebuilt)


def sha256_hex(data: bytes) -> str:
    """The default digest of cache keys and manifests."""
    return hashlib.sha256(data).hexdigest()


def cache_key(source: str, fingerprint: str, target: str, digest: Callable[[bytes], str] = sha256_hex) -> str:
    """The entry name: a digest of (source, fingerprint, target), unambiguous however they are spelled."""
    material = json.dumps([source, fingerprint, target], ensure_ascii=False).encode("utf-8")
    return digest(material)[:KEY_CHARS]


_lock = threading.Lock()  # check-then-build of one entry at a time in this process; writes are atomic across processes


def compile_cached(backend: StagedBackend, plan: Any, *, root: Path | None = None) -> Any:
    """``backend.load(artifact)`` for ``plan``, building the artifact only when the cache has no sound entry.

    ``root``: the cache root (default: ``cache_root()``).
    """
    started = time.perf_counter()
    source = _text(backend, "render(plan)", backend.render(plan))
    rendered = time.perf_counter()
    fingerprint = _text(backend, "fingerprint()", backend.fingerprint())
    target = _text(backend, "target()", backend.target())
    key = cache_key(source, fingerprint, target)
    name = _plan_name(plan)
    logger.debug("render of plan %s for backend %r took %.3f s (%d chars)", name, backend.name,
                 rendered - started, len(source))
    entry = private_dir(private_dir(private_root(root) / backend.name) / key)
    with _lock:
        check_tree(entry)  # before anything in it is read, let alone loaded
        artifact = _verified(entry, key)
        if artifact is None:
            logger.debug("compile-cache miss for plan %s on backend %r: key %s; building in %s", name,
                         backend.name, key, entry)
            building = time.perf_counter()
            artifact = _build(backend, source, entry, key, fingerprint, target)
            logger.debug("build of plan %s for backend %r took %.3f s", name, backend.name,
                         time.perf_counter() - building)
        else:
            logger.debug("compile-cache hit for plan %s on backend %r: key %s (%s)", name, backend.name, key, entry)
    loading = time.perf_counter()
    run = backend.load(artifact)
    logger.debug("load of plan %s for backend %r took %.3f s (%s)", name, backend.name,
                 time.perf_counter() - loading, "just built" if artifact.rebuilt else "from the cache")
    return run


def _plan_name(plan: Any) -> str:
    """A short name of a plan for log lines: its digest prefix when it has one."""
    digest = getattr(plan, "digest", None)
    return digest[:12] if isinstance(digest, str) else type(plan).__name__


def _text(backend: StagedBackend, what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise PluginError(f"backend {backend.name!r}: {what} returned {type(value).__name__}, not str; "
                          "a bug in the plugin: report it to its authors")
    return value


def _verified(entry: Path, key: str) -> Artifact | None:
    """The entry's artifact when its manifest is sound and every file matches it; None means build."""
    manifest_path = entry / MANIFEST
    if clear_irregular(manifest_path) or not manifest_path.exists():
        return None
    try:
        manifest = json.loads(read_private(manifest_path).decode("utf-8"))
        files = manifest["files"]
        ok = (manifest.get("format") == MANIFEST_FORMAT and manifest.get("key") == key and isinstance(files, list)
              and files and all(isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f)
                                for f in files))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("compile-cache manifest %s is unreadable (%s: %s); rebuilding the entry",
                       manifest_path, type(exc).__name__, exc)
        return None
    if not ok:
        logger.warning("compile-cache manifest %s is malformed (corrupted or edited); rebuilding the entry",
                       manifest_path)
        return None
    for name, want in files:
        path = entry / name
        inside = _inside(entry, path)
        kind = clear_irregular(path) if inside else None
        try:
            got = sha256_hex(read_private(path)) if inside and not kind else f"<{kind or 'outside the entry'}>"
        except OSError as exc:
            got = f"<unreadable: {exc}>"
        if got != want:
            logger.warning("compile-cache file %s differed from its rendering and build recorded in %s "
                           "(corrupted or edited); rebuilding it", path, manifest_path)
            return None
    return Artifact(entry, tuple(name for name, _ in files), key, rebuilt=False)


def _inside(entry: Path, path: Path) -> bool:
    return path.resolve().is_relative_to(entry.resolve()) and path.name != MANIFEST


def _build(backend: StagedBackend, source: str, entry: Path, key: str, fingerprint: str, target: str) -> Artifact:
    """Run ``backend.build`` in ``entry``, check what it returned and record it in the manifest."""
    produced = backend.build(source, entry)
    paths: Sequence[Any] = [produced] if isinstance(produced, (str, Path)) else produced
    if not isinstance(paths, (list, tuple)):
        paths = [produced]  # refused below, with what it was
    names = []
    for p in paths:
        path = entry / p if isinstance(p, (str, Path)) else None  # an absolute path stays as it is
        if path is None or not _inside(entry, path) or not path.is_file():
            raise PluginError(
                f"backend {backend.name!r}: build(source, workdir) returned {p!r}; it must return the path (or "
                f"paths) of files it wrote inside the work directory {entry} (not {MANIFEST}). A bug in the plugin: "
                "report it to its authors")
        check_private(path)
        names.append(path.resolve().relative_to(entry.resolve()).as_posix())
    if not names:
        raise PluginError(f"backend {backend.name!r}: build(source, workdir) returned no files; it must return the "
                          f"path of what it wrote in {entry}. A bug in the plugin: report it to its authors")
    manifest = {"format": MANIFEST_FORMAT, "key": key, "backend": backend.name, "fingerprint": fingerprint,
                "target": target, "files": [[n, sha256_hex(read_private(entry / n))] for n in names]}
    write_private(entry / MANIFEST, json.dumps(manifest, indent=1))  # last: an entry without one is rebuilt
    return Artifact(entry, tuple(names), key, rebuilt=True)
