"""yirage's logger, with its level taken from ``YIRAGE_LOG_LEVEL``."""

from __future__ import annotations

import logging
import os
import warnings

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
