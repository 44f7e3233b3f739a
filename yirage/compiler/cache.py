"""Where compiled code is kept, and the rule that nobody else may write there.

A compile cache holds code that yirage imports and runs (numba's cache
index is a pickle), so a cache another user can write is a way to run code
as you. Like ssh with ``~/.ssh`` and pip with its cache, yirage creates the
cache root with mode 0700 and refuses a root, entry or file that is not
owned by the current user or that group or others can write.

Everything yirage reads there must be a regular file: ``open`` on a FIFO blocks
forever. A FIFO, socket or device inside a checked entry cannot be something
yirage wrote, and the entry is this user's alone, so ``check_tree`` removes it
(the entry is then rebuilt); a directory where a file belongs is removed by
``clear_irregular`` the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from pathlib import Path

from yirage.config import file_kind, read_regular
from yirage.errors import YirageError

logger = logging.getLogger("yirage.compiler")


class CacheError(YirageError, RuntimeError):
    """A compile-cache entry that cannot be written or loaded."""


class CacheSecurityError(CacheError, PermissionError):
    """A cache path another user could write: loading code from it is refused."""


def cache_root() -> Path:
    """``$YIRAGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/yirage``, else ``~/.cache/yirage``."""
    base = os.environ.get("YIRAGE_CACHE_DIR")
    if base:
        return Path(base).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return ((Path(xdg) if xdg else Path.home() / ".cache") / "yirage").absolute()


def _fix(path: Path) -> str:
    return (f"run `chmod -R go-w {path}` (and chown it to yourself) if you trust its contents, or delete it; "
            "or set YIRAGE_CACHE_DIR to a private directory")


def check_private(path: Path, info: os.stat_result | None = None) -> None:
    """Refuse ``path`` unless it is owned by the current user and not writable by group or others."""
    if os.name != "posix":
        return
    st = info or os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise CacheSecurityError(f"compile-cache path {path} is a symbolic link; yirage loads compiled code from "
                                 f"this cache and does not follow links there. {_fix(path)}")
    if st.st_uid not in (os.geteuid(), 0):  # root could change anything anyway
        raise CacheSecurityError(
            f"compile-cache path {path} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}) or root; "
            f"yirage runs code from this cache, so it only trusts files you own. {_fix(path)}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheSecurityError(
            f"compile-cache path {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o}); "
            f"another user could make yirage run their code. {_fix(path)}")


def check_tree(path: Path, tighten: bool = False) -> None:
    """``check_private`` on a directory and everything below it (a cache entry holds a handful of files).

    ``tighten``: a directory of our own that group or others may write (numba creates its cache
    directories with the umask's mode) loses those bits first; everything inside must still be ours.
    A FIFO, socket or device below it is removed (reading it would block forever; the entry is rebuilt).
    """
    if not os.path.lexists(path):
        return
    st = os.lstat(path)
    if tighten and os.name == "posix":
        if st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    check_private(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"the compile-cache directory {path} is {file_kind(st.st_mode)}, not a directory; delete it "
                         "(yirage recreates it) or set YIRAGE_CACHE_DIR to another directory")
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                info = os.lstat(Path(dirpath) / name)
            except FileNotFoundError:
                # another process of ours renamed its temporary file into place after the listing (xdist workers
                # building one entry): what is gone cannot be loaded, and its directory, checked private, holds
                # only what this user put there
                continue
            check_private(Path(dirpath) / name, info)
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                _remove(Path(dirpath) / name, file_kind(info.st_mode))


def clear_irregular(path: Path) -> str | None:
    """Remove ``path`` when it is not a regular file (a directory or FIFO where yirage keeps a file); say what it was.

    None when it is a regular file or missing. Only for paths in an entry ``check_tree`` just checked: the
    entry is this user's alone, so what is removed is no one else's.
    """
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # missing: nothing to clear (a read reports it)
        return None
    if stat.S_ISREG(info.st_mode):
        return None
    kind = file_kind(info.st_mode)
    _remove(path, kind)
    return kind


def _remove(path: Path, kind: str) -> None:
    """Remove a corrupted piece of a private cache entry, with a warning; CacheError with the fix when it cannot."""
    logger.warning("compile-cache path %s is %s, not a regular file (corrupted; yirage reads only files it wrote "
                   "there, and reading a FIFO would block forever); removing it so the entry is rebuilt", path, kind)
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return  # another process of ours removed it first
    except OSError as exc:
        raise CacheError(f"compile-cache path {path} is {kind}, not a regular file, and cannot be removed ({exc}); "
                         "delete it yourself or set YIRAGE_CACHE_DIR to another directory") from exc


def read_private(path: Path) -> bytes:
    """The bytes of a file in a checked entry: a link, FIFO or directory is refused before it is opened (OSError)."""
    return read_regular(path, follow_symlinks=False)


_made: set[Path] = set()
_lock = threading.Lock()


def private_root(root: Path | None = None) -> Path:
    """The cache root, created 0700 if missing and checked to be private (once per process and path)."""
    root = cache_root() if root is None else root
    with _lock:
        if root in _made:
            return root
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create the compile cache at {root}: {exc}; "
                             "set YIRAGE_CACHE_DIR to a writable directory") from exc
        if not root.is_dir():
            raise CacheError(f"the compile cache {root} is not a directory; set YIRAGE_CACHE_DIR to a directory")
        check_private(root)
        _check_parents(root)
        _made.add(root)
        logger.debug("compile cache at %s (private to this user: checked)", root)
    return root


def _check_parents(root: Path) -> None:
    """A parent others may write without the sticky bit lets them swap the whole cache for their own."""
    if os.name != "posix":
        return
    for parent in root.parents:
        st = os.stat(parent)
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise CacheSecurityError(
                f"the compile cache {root} lies in {parent}, which every user can write (mode "
                f"{stat.S_IMODE(st.st_mode):#o}, no sticky bit), so another user could replace the cache; "
                "set YIRAGE_CACHE_DIR to a directory inside one only you can write")


def private_dir(path: Path) -> Path:
    """A directory below the cache root, created 0700; an existing one must be private."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(f"cannot create the compile-cache directory {path}: {exc}; "
                         "set YIRAGE_CACHE_DIR to a writable directory") from exc
    check_private(path)
    return path


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` atomically (temp file + rename), readable and writable by the owner only.

    Text is written as UTF-8; bytes (a compiled binary) as they are.
    """
    if os.path.isdir(path) and not os.path.islink(path):
        raise CacheError(f"cannot write the compile cache at {path}: it is a directory where yirage keeps a file; "
                         f"delete it (`rm -r {path}`) or set YIRAGE_CACHE_DIR to another directory")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CacheError(f"cannot write the compile cache at {path}: {exc}; "
                         "set YIRAGE_CACHE_DIR to a writable directory") from exc
