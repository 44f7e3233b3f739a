"""yirage's logger, with its level taken from ``YIRAGE_LOG_LEVEL``."""

from __future__ import annotations

import logging
import os
import warnings

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger("yirage")


def configure_from_environment() -> None:
    """Apply ``YIRAGE_LOG_LEVEL``; give the logger a stderr handler when set."""
    raw = os.environ.get("YIRAGE_LOG_LEVEL", "").strip()
    if not raw:
        return
    level = raw.upper()
    if level not in LEVELS:
        warnings.warn(
            f"YIRAGE_LOG_LEVEL={raw!r} is not a log level; use one of {', '.join(LEVELS)}. "
            "Keeping the default level.",
            stacklevel=3,
        )
        return
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
