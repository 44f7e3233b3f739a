"""Which backend runs: explicit choice, ``YIRAGE_BACKEND``, saved setting, or auto.

The auto policy: among available backends that accept auto selection, the
highest priority wins. Every backend's reason is recorded in
``last_auto_report()``; the choice is logged at INFO and a warning is logged
when auto ends on the host CPU.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from yirage import config
from yirage.backend.base import Backend, checked_device_info, checked_memory_info
from yirage.backend.registry import Registry
from yirage.errors import BackendUnavailableError, UnknownBackendError

logger = logging.getLogger("yirage.backend")


class _BackendTypeMeta(type):
    def __getattr__(cls, attr: str) -> BackendType:
        if attr.startswith("_") or not attr.isupper():
            raise AttributeError(attr)
        name = attr.lower()
        if name not in registry():
            raise AttributeError(f"BackendType has no member {attr}: {registry()._unknown_message(name)}")
        return cls(name)

    def __iter__(cls):  # type: ignore[no-untyped-def]
        return iter([cls(name) for name in registry().names()])


class BackendType(metaclass=_BackendTypeMeta):
    """Enum-like handle of a backend: ``.value`` is its name, ``.name`` upper case.

    Members exist for every discovered backend (``BackendType.CPU``); they
    compare equal to their name so ``yr.get_backend() == 'cpu'`` works.
    """

    __slots__ = ("value",)
    _interned: dict[str, BackendType] = {}

    def __new__(cls, value: str) -> BackendType:
        if isinstance(value, BackendType):
            return value
        member = cls._interned.get(value)
        if member is None:
            if value not in registry():
                raise UnknownBackendError(registry()._unknown_message(value))
            member = super().__new__(cls)
            object.__setattr__(member, "value", value)
            cls._interned[value] = member
        return member

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError("BackendType members are immutable")

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (BackendType, (self.value,))

    @property
    def name(self) -> str:
        return self.value.upper()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BackendType):
            return self.value == other.value
        if isinstance(other, str):
            return self.value == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"<BackendType.{self.name}: {self.value!r}>"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class AutoDecision:
    name: str
    priority: int
    available: bool
    auto: bool
    reason: str
    chosen: bool = False


_lock = threading.RLock()
_registry: Registry | None = None
_current: Backend | None = None
_requested: str | None = None
_requested_from = ""
_auto_report: list[AutoDecision] = []


def registry() -> Registry:
    global _registry
    with _lock:
        if _registry is None:
            _registry = Registry()
        return _registry


def read_environment() -> None:
    """Record ``YIRAGE_BACKEND`` (called at import and by ``reset_backend``)."""
    global _requested, _requested_from
    value = os.environ.get("YIRAGE_BACKEND", "").strip()
    _requested, _requested_from = (value.lower(), "YIRAGE_BACKEND") if value else (None, "")


def _normalize(name: str | BackendType | Backend) -> str:
    if isinstance(name, (BackendType, Backend)):
        return name.name if isinstance(name, Backend) else name.value
    if not isinstance(name, str):
        raise TypeError(f"a backend name must be a str such as 'cpu' or 'auto', not {type(name).__name__}")
    return name.strip().lower()


def _alternatives(reg: Registry, exclude: str) -> str:
    names = [b.name for b in reg.backends() if b.name != exclude and b.availability().ok]
    return ", ".join(names) or "none"


def resolve(name: str | BackendType, origin: str = "") -> Backend:
    """The available backend for ``name`` ('auto' included), or a clear error."""
    key = _normalize(name)
    reg = registry()
    if key == "auto":
        return _choose_auto(reg)
    where = f" (from {origin})" if origin else ""
    if key not in reg:
        raise UnknownBackendError(f"cannot select backend {key!r}{where}: " + reg._unknown_message(key))
    backend = reg.get(key)
    avail = backend.availability()
    if not avail.ok:
        raise BackendUnavailableError(
            f"backend {key!r}{where} is unavailable: {avail.reason}. "
            f"Available backends: {_alternatives(reg, key)}; use set_backend('auto') to pick the best of them."
        )
    return backend


def _choose_auto(reg: Registry) -> Backend:
    global _auto_report
    report: list[AutoDecision] = []
    chosen: Backend | None = None
    for backend in reg.backends():
        avail = backend.availability()
        take = chosen is None and avail.ok and avail.auto
        if take:
            chosen = backend
        report.append(AutoDecision(backend.name, backend.priority, avail.ok, avail.auto, avail.reason, take))
    _auto_report = report
    if chosen is None:
        lines = "; ".join(f"{d.name}: {d.reason}" for d in report)
        raise BackendUnavailableError(f"auto found no usable backend ({lines}); install torch to get 'reference'")
    passed = [d for d in report if d.priority > chosen.priority]
    logger.info(
        "auto selected backend %r (priority %d); passed over: %s",
        chosen.name, chosen.priority,
        "; ".join(f"{d.name}: {d.reason}" for d in passed) or "nothing",
    )
    if chosen.device_kind == "cpu":
        excluded = [r.name for r in reg.plugins.records if r.status == "excluded"]
        limited = ""
        if excluded:
            limited = f"; not loaded (YIRAGE_PLUGINS / YIRAGE_DISABLE_PLUGIN_AUTOLOAD): {', '.join(excluded)}"
        logger.warning(
            "yirage auto selected %r, which runs on the host CPU: no loaded accelerator backend is available "
            "(`python -m yirage info` lists why)%s",
            chosen.name, limited,
        )
    return chosen


def last_auto_report() -> list[AutoDecision]:
    """Every backend's standing at the last auto selection, best first."""
    return list(_auto_report)


def set_backend(name: str | BackendType) -> BackendType:
    """Select the process-wide default backend; 'auto' picks the best available."""
    global _current
    with _lock:
        _current = resolve(name)
        return BackendType(_current.name)


def current_backend() -> Backend:
    """The selected Backend object, resolving the default on first use."""
    global _current
    with _lock:
        if _current is None:
            if _requested is not None:
                _current = resolve(_requested, _requested_from)
            else:
                saved = config.load().get("backend")
                if saved:
                    _current = resolve(str(saved), f"the saved setting in {config.config_path()}")
                else:
                    _current = resolve("auto")
        return _current


def get_backend() -> BackendType:
    return BackendType(current_backend().name)


def reset_backend(rediscover: bool = False) -> None:
    """Forget the selection and memoized probes; re-read ``YIRAGE_BACKEND``.

    ``rediscover=True`` also reloads the plugins, e.g. after installing one
    into a running session.
    """
    global _current, _registry
    with _lock:
        _current = None
        if rediscover:
            _registry = None
        elif _registry is not None:
            _registry.forget_probes()
        read_environment()


def get_available_backends() -> list[BackendType]:
    return [BackendType(b.name) for b in registry().backends() if b.availability().ok]


def is_backend_available(name: Any) -> bool:
    """False for unknown names and non-strings; loads only the plugins named like ``name``.

    Never raises for the name; a malformed ``YIRAGE_PROBE_TIMEOUT`` is still a ConfigError.
    """
    try:
        key = _normalize(name)
    except TypeError:
        return False
    reg = registry()
    return key in reg and reg.get(key).availability().ok


def get_backend_info(name: str | BackendType | None = None) -> dict[str, Any]:
    """Measured facts about a backend (the current one by default)."""
    if name is None:
        backend = current_backend()
    else:
        key = _normalize(name)
        backend = resolve("auto") if key == "auto" else registry().get(key)
    return describe(backend)


def describe(backend: Backend) -> dict[str, Any]:
    avail = backend.availability()
    origin = registry().origin(backend.name)
    info: dict[str, Any] = {
        "name": backend.name,
        "available": avail.ok,
        "auto": avail.auto,
        "reason": avail.reason,
        "priority": backend.priority,
        "vendor": backend.vendor,
        "torch_device": backend.torch_device,
        "description": backend.description,
        "plugin": {"name": origin.name, "distribution": origin.distribution, "version": origin.version},
        "device": None,
        "memory": None,
    }
    if avail.ok:
        try:
            info["device_count"] = backend.device_count()
            info["device"] = checked_device_info(backend, 0).as_dict()
            info["memory"] = checked_memory_info(backend, 0).as_dict()
        except Exception as exc:  # noqa: BLE001 - report a failing driver query, keep describing the rest
            logger.warning("describing backend %r failed", backend.name, exc_info=True)
            info["error"] = f"describing the device failed: {type(exc).__name__}: {exc}"
    return info


def get_memory_info(name: str | BackendType | None = None) -> dict[str, Any]:
    backend = current_backend() if name is None else resolve(name)
    return checked_memory_info(backend, 0).as_dict()


read_environment()
