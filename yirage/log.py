"""yirage's logger, with its level taken from ``YIRAGE_LOG_LEVEL``, and ``working``: a progress line for long steps."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}

logger = logging.getLogger("yirage")


def configure_from_environment() -> None:
    """Apply ``YIRAGE_LOG_LEVEL``; give the logger a stderr handler when set."""
    raw = os.environ.get("YIRAGE_LOG_LEVEL", "").strip()
    if not raw:
        return
    level = ALIASES.get(raw.upper(), raw.upper())
    if level not in LEVELS:
        warnings.warn(
            f"YIRAGE_LOG_LEVEL={raw!r} is not a log level; use one of {', '.join(LEVELS)}. "
            "Keeping the default level.",
            stacklevel=3,
        )
        return
    logger.setLevel(level)
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        handler = _FallbackHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


class _FallbackHandler(logging.StreamHandler):
    """Print to stderr only while the application has not configured logging.

    Records still propagate, so an application's own handlers see them and
    this one steps aside (no duplicates).
    """

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


@contextlib.contextmanager
def working(what: str, stream: Any = None, every: float = 1.0, after: float = 2.0) -> Iterator[None]:
    """Show ``what ... N s`` on a terminal while a long step with no progress of its own runs (a JIT compile).

    Nothing is shown on a stream that is not a terminal (logs, CI) unless ``YIRAGE_PROGRESS=1``, nor for a step
    shorter than ``after`` seconds (a warm cache), and ``YIRAGE_PROGRESS=0`` turns it off; the line is cleared
    when the step ends, so the program's own output is unchanged. A daemon thread draws it: the step itself runs
    on the caller's thread, as it would without the indicator. Steps within a step (or in other threads meanwhile)
    draw nothing of their own: one line at a time.
    """
    stream = sys.stderr if stream is None else stream
    setting = os.environ.get("YIRAGE_PROGRESS", "").strip()
    shown = setting == "1" or (setting != "0" and bool(getattr(stream, "isatty", lambda: False)()))
    with _drawing_lock:
        nested = bool(_drawing)
        _drawing.append(what)
    try:
        if not shown or nested:  # an enclosing step's line is already drawn: one line, the outermost step's
            yield
        else:
            yield from _draw(what, stream, every, after)
    finally:
        with _drawing_lock:
            _drawing.remove(what)


_drawing: list[str] = []  # the steps in progress (working() calls, any thread): only the first draws
_drawing_lock = threading.Lock()


def _draw(what: str, stream: Any, every: float, after: float) -> Iterator[None]:
    done = threading.Event()
    start = time.monotonic()

    def draw() -> None:
        drawn = False
        while not done.wait(after if not drawn else every):
            stream.write(f"\r{what} ... {time.monotonic() - start:.0f} s")
            stream.flush()
            drawn = True
        if drawn:
            stream.write("\r" + " " * (len(what) + 12) + "\r")
            stream.flush()

    thread = threading.Thread(target=draw, name="yirage-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)
