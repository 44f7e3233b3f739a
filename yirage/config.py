"""The user's saved settings (``yirage_backend_manager.py set``), as a small JSON file.

Lives in ``$YIRAGE_CONFIG_DIR`` or ``$XDG_CONFIG_HOME/yirage`` or
``~/.config/yirage``. ``YIRAGE_BACKEND`` always wins over it.

Settings decide what yirage runs, so the directory they are written to follows the compile cache's rules
(yirage/compiler/cache.py): it is created 0700, and one another user owns or can write, or that lies in a
directory every user can write without the sticky bit, is refused; a write never follows a symbolic link
(a planted ``config.json`` -> victim link would otherwise overwrite the victim's file). Anything that is
not a regular file (a FIFO would block ``open`` forever) is refused before it is opened.

Also reads ``YIRAGE_PROBE_TIMEOUT``: how many seconds one plugin's import and
one backend's probe may take before yirage gives up on it (default 20), so a
plugin that hangs cannot hang discovery or selection; and ``YIRAGE_EAGER_START``
(``eager_start``).
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yirage.errors import YirageError


class ConfigError(YirageError):
    """The settings file exists but cannot be used."""


class UnsafeConfigError(ConfigError, PermissionError):
    """A settings path another user could control (a foreign or shared directory, a link): writing is refused."""


class NotRegularFileError(OSError):
    """A path that should hold a file is a FIFO, socket, device, directory or link: opening it could block."""


#: the fix every refused settings path shares
CONFIG_DIR_FIX = "or set YIRAGE_CONFIG_DIR to a directory only you can write"


#: Seconds a plugin's import, its ``yirage_backends`` hook or a backend's
#: probe may take when ``YIRAGE_PROBE_TIMEOUT`` is not set.
DEFAULT_PROBE_TIMEOUT = 20.0


def probe_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``YIRAGE_PROBE_TIMEOUT`` in seconds, checked, so one hanging plugin cannot hang yirage."""
    env = os.environ if environ is None else environ
    raw = env.get("YIRAGE_PROBE_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_PROBE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"YIRAGE_PROBE_TIMEOUT={raw!r} is not a positive number of seconds; set it to e.g. "
            f"{DEFAULT_PROBE_TIMEOUT:g} (how long one plugin import or backend probe may take) or unset it"
        )
    return value


def config_path() -> Path:
    """``$YIRAGE_CONFIG_DIR/config.json``, else ``$XDG_CONFIG_HOME/yirage/config.json``, else ``~/.config/...``."""
    base = os.environ.get("YIRAGE_CONFIG_DIR")
    if base:
        return Path(base) / "config.json"
    xdg = os.environ.get("XDG_CONFIG_HOME")
    root = Path(xdg) if xdg else Path.home() / ".config"
    return root / "yirage" / "config.json"


def file_kind(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words, for error messages."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"not a regular file (mode {mode:#o})"


def read_regular(path: Path, follow_symlinks: bool = True) -> bytes:
    """The bytes of ``path``, refusing anything but a regular file before opening it.

    Why: ``open`` on a FIFO blocks until a writer comes, forever, and on a device it may have side effects.
    ``path`` is checked with (l)stat first, then opened non-blocking and checked again on the open file, so a
    swap between the two cannot make it block either. FileNotFoundError when missing; NotRegularFileError
    (an OSError) naming what it is otherwise.
    """
    info = os.stat(path) if follow_symlinks else os.lstat(path)
    _require_regular(path, info)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(path, flags), "rb") as f:
        _require_regular(path, os.fstat(f.fileno()))
        return f.read()


def _require_regular(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise NotRegularFileError(errno.EINVAL, f"{path} is {file_kind(info.st_mode)}, not a regular file, so "
                                                "yirage does not open it (reading a FIFO would block forever)")


def check_config_dir(directory: Path) -> Path:
    """Create ``directory`` 0700 if missing; refuse it unless only this user can write it (as the compile cache).

    A link, a directory another user owns or can write, or one inside a directory every user can write without
    the sticky bit lets another user replace the files written there, or plant a link that a write would follow.
    """
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise ConfigError(f"cannot create the yirage settings directory {directory}: {exc}; "
                          f"{CONFIG_DIR_FIX}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeConfigError(f"the yirage settings directory {directory} is {file_kind(info.st_mode)}, not a "
                                f"directory; yirage does not write through links. Delete it, {CONFIG_DIR_FIX}")
    if os.name == "posix":
        _check_owner(directory, info)
        _check_parents(directory)
    return directory


def _check_owner(directory: Path, info: os.stat_result) -> None:
    """The compile cache's rule: owned by this user (or root) and not writable by group or others."""
    if info.st_uid not in (os.geteuid(), 0):  # root could change anything anyway
        raise UnsafeConfigError(
            f"the yirage settings directory {directory} is owned by uid {info.st_uid}, not by you (uid "
            f"{os.geteuid()}) or root, so its owner could make yirage overwrite your files through links planted "
            f"there; {CONFIG_DIR_FIX}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeConfigError(
            f"the yirage settings directory {directory} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):#o}), so another user could make yirage overwrite your files through "
            f"links planted there; run `chmod go-w {directory}` if only you use it, {CONFIG_DIR_FIX}")


def _check_parents(directory: Path) -> None:
    """A parent every user can write without the sticky bit lets them swap the whole directory for their own."""
    for parent in directory.absolute().parents:
        info = os.stat(parent)
        if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            raise UnsafeConfigError(
                f"the yirage settings directory {directory} lies in {parent}, which every user can write (mode "
                f"{stat.S_IMODE(info.st_mode):#o}, no sticky bit), so another user could replace it; "
                f"{CONFIG_DIR_FIX}")


def check_writable_target(path: Path) -> None:
    """Refuse to write ``path`` when its directory is not private or ``path`` is a link or a directory.

    Called before the old contents are read too, so a planted link is neither followed nor read.
    A FIFO or other special file is left to :func:`write_atomic`, which replaces it without opening it.
    """
    check_config_dir(path.parent)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeConfigError(f"{path} is a symbolic link (to {os.readlink(path)}); yirage does not write through "
                                f"links in its settings directory, where one could redirect the write to another "
                                f"file. Delete the link, {CONFIG_DIR_FIX}")
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path} is a directory where yirage keeps a settings file; delete it (`rm -r {path}`), "
                          f"{CONFIG_DIR_FIX}")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a new 0600 temporary file (O_EXCL, no links) renamed over it.

    Why: a crash never leaves a torn file, and a link planted at the temporary or the final name is never
    followed (``os.replace`` swaps the name itself). OSError when it cannot write.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o600), "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def load() -> dict[str, Any]:
    """The saved settings ({} when there are none); ConfigError naming the path and the fix when unusable."""
    path = config_path()
    try:
        text = read_regular(path).decode("utf-8")
    except (FileNotFoundError, NotADirectoryError):  # ENOTDIR: a parent is a file (HOME=/dev/null): no settings
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"the yirage settings file {path} cannot be read ({exc}); "
            "delete it or fix it, e.g. with `python tools/yirage_backend_manager.py set auto`, "
            f"{CONFIG_DIR_FIX}"
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"the yirage settings file {path} is corrupted ({exc}); "
            "delete it or fix it, e.g. with `python tools/yirage_backend_manager.py set auto`"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"the yirage settings file {path} must hold a JSON object; delete it or fix it")
    return data


def save(**values: Any) -> Path:
    """Merge ``values`` into the saved settings; the directory must be private and the file no link (see above)."""
    path = config_path()
    check_writable_target(path)  # before reading: a planted link is neither read nor written through
    try:
        data = load()
    except ConfigError:
        data = {}  # `set` is the documented fix for a corrupted file: overwrite it
    data.update(values)
    try:
        write_atomic(path, json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(
            f"cannot write the yirage settings file {path}: {exc}; point YIRAGE_CONFIG_DIR elsewhere"
        ) from exc
    return path


#: ``YIRAGE_EAGER_START=0``: a generate waits for its backend's compile instead of decoding its first steps in
#: torch meanwhile (``InferEngine(eager_start=...)``); also the default of a backend's prompt projections, which
#: then run torch's GEMM while their own code compiles instead of waiting for it
EAGER_START_ENV = "YIRAGE_EAGER_START"


def eager_start(environ: Mapping[str, str] | None = None) -> bool:
    """``YIRAGE_EAGER_START`` (default on): whether work that would wait for a compile runs in torch meanwhile."""
    env = os.environ if environ is None else environ
    raw = env.get(EAGER_START_ENV, "1").strip().lower()
    if raw not in ("0", "1", "true", "false", "yes", "no", "on", "off", ""):
        raise ConfigError(f"{EAGER_START_ENV}={raw!r} is not a switch; set it to 1 (decode in torch while the "
                          "backend compiles, the default) or 0 (wait for the compile)")
    return raw not in ("0", "false", "no", "off")
