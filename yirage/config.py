"""The user's saved settings (``backend_manager.py set``), as a small JSON file.

Lives in ``$YIRAGE_CONFIG_DIR`` or ``$XDG_CONFIG_HOME/yirage`` or
``~/.config/yirage``. ``YIRAGE_BACKEND`` always wins over it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from yirage.errors import YirageError


class ConfigError(YirageError):
    """The settings file exists but cannot be used."""


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
            "delete it or fix it, e.g. with `python tools/backend_manager.py set auto`"
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"the yirage settings file {path} is corrupted ({exc}); "
            "delete it or fix it, e.g. with `python tools/backend_manager.py set auto`"
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
