"""The user's saved settings (``yirage_backend_manager.py set``), as a small JSON file.

Lives in ``$YIRAGE_CONFIG_DIR`` or ``$XDG_CONFIG_HOME/yirage`` or
``~/.config/yirage``. ``YIRAGE_BACKEND`` always wins over it.

Also reads ``YIRAGE_PROBE_TIMEOUT``: how many seconds one plugin's import and
one backend's probe may take before yirage gives up on it (default 20), so a
plugin that hangs cannot hang discovery or selection.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yirage.errors import YirageError


class ConfigError(YirageError):
    """The settings file exists but cannot be used."""


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
    base = os.environ.get("YIRAGE_CONFIG_DIR")
    if base:
        return Path(base) / "config.json"
    xdg = os.environ.get("XDG_CONFIG_HOME")
    root = Path(xdg) if xdg else Path.home() / ".config"
    return root / "yirage" / "config.json"


def load() -> dict[str, Any]:
    path = config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"the yirage settings file {path} cannot be read ({exc}); "
            "delete it or fix it, e.g. with `python tools/yirage_backend_manager.py set auto`"
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
    path = config_path()
    try:
        data = load()
    except ConfigError:
        data = {}  # `set` is the documented fix for a corrupted file: overwrite it
    data.update(values)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the yirage settings file {path}: {exc}; point YIRAGE_CONFIG_DIR elsewhere"
        ) from exc
    return path
