"""Which backend runs: explicit choice, ``YIRAGE_BACKEND``, saved setting, or auto.

The auto policy: among available backends that accept auto selection, the
highest priority wins. Every backend's reason is recorded in
``last_auto_report()``; the choice is logged at INFO and a warning is logged
when auto ends on the host CPU.

Capability-aware auto: a caller that needs something asks for it
(``current_backend(need="kernel_graphs", dtypes=...)``, ``need="persistent"``)
and auto then takes the highest-priority available backend whose
``Backend.capabilities()`` has it, so a plugin that only probes cannot capture
every unqualified ``new_kernel_graph()``. An explicit choice (``set_backend``,
``YIRAGE_BACKEND``, the saved setting, ``backend=``) is never replaced: when it
lacks what is needed, NotSupportedError names what is missing and which
backends have it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from yirage import config
from yirage.backend.base import (
    NEEDS,
    Backend,
    Capabilities,
    checked_capabilities,
    checked_device_info,
    checked_memory_info,
)
from yirage.backend.registry import Registry
from yirage.errors import BackendUnavailableError, NotSupportedError, PluginError, UnknownBackendError

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
    """One backend's standing at an auto selection; ``reason`` says why it was passed over (or its probe)."""

    name: str
    priority: int
    available: bool
    auto: bool
    reason: str
    chosen: bool = False
    capable: bool = True  # False: available, but lacks what was asked for (``reason`` says what)
    need: str = ""  # what was asked for: "" (any backend), "kernel_graphs", "persistent"


#: (need, dtypes) as normalized by ``_request``; None asks for any backend
Request = tuple[str, frozenset[str]] | None

_lock = threading.RLock()
_registry: Registry | None = None
_current: Backend | None = None
_how: tuple[Backend | None, bool, str] = (None, False, "")  # (_current it describes, chosen by auto?, origin)
_by_need: dict[tuple[str, frozenset[str]], tuple[Backend, Backend]] = {}  # request -> (_current then, choice)
_caps: dict[int, tuple[Backend, Capabilities]] = {}  # id(backend) -> its checked capabilities, until reset
_warned_undeclared: set[str] = set()
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


_WHAT = {"kernel_graphs": "compile kernel graphs", "persistent": "run PersistentKernels"}


_requests: dict[tuple[Any, frozenset[Any]], Request] = {}  # (need, dtypes) -> checked request: g(...) asks per call


def _request(need: str | None, dtypes: Iterable[Any]) -> Request:
    """Check and normalize what a caller asks for; dtypes may be names, ``yr.float16`` or torch dtypes."""
    if type(dtypes) is frozenset and (need is None or type(need) is str):
        known = _requests.get((need, dtypes), False)
        if known is not False:
            return known  # type: ignore[return-value]
        req = _checked_request(need, dtypes)
        if len(_requests) < 256:
            _requests[(need, dtypes)] = req
        return req
    return _checked_request(need, dtypes)


def _checked_request(need: str | None, dtypes: Iterable[Any]) -> Request:
    if isinstance(dtypes, str):
        raise TypeError(f"dtypes must be a collection of dtype names such as {{'float32'}}, not the str {dtypes!r}")
    names = frozenset(str(d).removeprefix("torch.") for d in dtypes)
    if need is None:
        if names:
            raise ValueError("dtypes= only applies to need='kernel_graphs'; pass need='kernel_graphs' with them")
        return None
    if need not in NEEDS:
        raise ValueError(f"need={need!r} is not a capability yirage selects by; use one of "
                         f"{', '.join(repr(n) for n in NEEDS)}, or None for any backend")
    if names and need != "kernel_graphs":
        raise ValueError(f"dtypes= only applies to need='kernel_graphs', not need={need!r}; leave dtypes out")
    return need, names


def _what(req: tuple[str, frozenset[str]]) -> str:
    need, dtypes = req
    return _WHAT[need] + (f" in {', '.join(sorted(dtypes))}" if dtypes else "")


def capabilities(backend: Backend) -> Capabilities:
    """``backend``'s checked capabilities, memoized until ``reset_backend``; PluginError when malformed."""
    known = _caps.get(id(backend))
    if known is not None and known[0] is backend:
        return known[1]
    try:
        caps = checked_capabilities(backend)
    except PluginError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's failing description becomes an error naming it
        raise PluginError(f"backend {backend.name!r}: capabilities() raised {type(exc).__name__}: {exc} "
                          "(a bug in the plugin; report it to its authors)") from exc
    _caps[id(backend)] = (backend, caps)
    return caps


def _missing(backend: Backend, req: tuple[str, frozenset[str]]) -> str:
    """Why ``backend`` cannot serve ``req``; '' when it can. Broken capabilities count as missing."""
    try:
        return capabilities(backend).missing(*req)
    except PluginError as exc:
        logger.warning("%s", exc)
        return f"its capabilities are unknown: {exc}"


def _capable(reg: Registry, req: tuple[str, frozenset[str]]) -> list[str]:
    """Names of the available backends that can serve ``req``, best first."""
    return [b.name for b in reg.backends() if b.availability().ok and not _missing(b, req)]


def _require(backend: Backend, req: tuple[str, frozenset[str]], where: str) -> None:
    """Refuse an explicitly chosen backend that lacks what is needed, naming what is missing and who has it."""
    missing = capabilities(backend).missing(*req)
    if not missing:
        return
    cls = type(backend)
    if (req[0] == "kernel_graphs" and cls.capabilities is Backend.capabilities and cls.compile is not Backend.compile
            and not backend.kernel_dtypes):
        # it implements compile() but declares no dtypes: honour the explicit choice, tell its author once
        if backend.name not in _warned_undeclared:
            _warned_undeclared.add(backend.name)
            logger.warning("backend %r implements compile() but declares no kernel_dtypes, so auto and the "
                           "conformance kit pass it over; its authors should set kernel_dtypes", backend.name)
        return
    able = _capable(registry(), req)
    hint = f"pick one of them (e.g. backend={able[0]!r}) or " if able else "install a backend that can, or "
    raise NotSupportedError(
        f"backend {backend.name!r}{where} {missing}, so it cannot {_what(req)} as asked. Backends available "
        f"here that can: {', '.join(able) or 'none'}; {hint}leave the backend unset so auto picks the best "
        "capable one (`python -m yirage info` shows every backend's capabilities)"
    )


def resolve(name: str | BackendType, origin: str = "", need: str | None = None,
            dtypes: Iterable[Any] = ()) -> Backend:
    """The available backend for ``name`` ('auto' included) that can serve ``need``, or a clear error.

    ``need``: None (any backend), "kernel_graphs" (with the graph's ``dtypes`` if known) or "persistent".
    'auto' picks the best backend that has it; a named backend that lacks it raises NotSupportedError.
    """
    req = _request(need, dtypes)
    key = _normalize(name)
    reg = registry()
    if key == "auto":
        return _choose_auto(reg, req)
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
    if req is not None:
        _require(backend, req, where)
    return backend


def _choose_auto(reg: Registry, req: Request = None) -> Backend:
    global _auto_report
    report: list[AutoDecision] = []
    chosen: Backend | None = None
    for backend in reg.backends():
        avail = backend.availability()
        reason, capable = avail.reason, True
        if avail.ok and avail.auto and req is not None:
            missing = _missing(backend, req)
            reason, capable = (missing, False) if missing else (reason, True)
        take = chosen is None and avail.ok and avail.auto and capable
        if take:
            chosen = backend
        report.append(AutoDecision(backend.name, backend.priority, avail.ok, avail.auto, reason, take, capable,
                                   req[0] if req else ""))
    _auto_report = report
    asked = f" that can {_what(req)}" if req else ""
    if chosen is None:
        lines = "; ".join(f"{d.name}: {d.reason}" for d in report)
        raise BackendUnavailableError(f"auto found no usable backend{asked} ({lines}); "
                                      "install torch to get 'reference'")
    passed = [d for d in report if d.priority > chosen.priority]
    logger.info(
        "auto selected backend %r (priority %d)%s; passed over: %s",
        chosen.name, chosen.priority, f" to {_what(req)}" if req else "",
        "; ".join(f"{d.name}: {d.reason}" for d in passed) or "nothing",
    )
    if chosen.device_kind == "cpu":
        excluded = [r.name for r in reg.plugins.records if r.status == "excluded"]
        limited = ""
        if excluded:
            limited = f"; not loaded (YIRAGE_PLUGINS / YIRAGE_DISABLE_PLUGIN_AUTOLOAD): {', '.join(excluded)}"
        logger.warning(
            "yirage auto selected %r, which runs on the host CPU: no loaded accelerator backend%s is available "
            "(`python -m yirage info` lists why)%s",
            chosen.name, asked, limited,
        )
    return chosen


def last_auto_report() -> list[AutoDecision]:
    """Every backend's standing at the last auto selection, best first."""
    return list(_auto_report)


def set_backend(name: str | BackendType) -> BackendType:
    """Select the process-wide default backend; 'auto' picks the best available.

    After ``set_backend('auto')`` kernel graphs and PersistentKernels still get the best backend
    that can run them; after ``set_backend('x')`` they run on x or fail saying what x lacks.
    """
    global _current, _how
    with _lock:
        key = _normalize(name)
        _current = resolve(key)
        _how = (_current, key == "auto", f"set_backend({key!r})")
        _by_need.clear()
        return BackendType(_current.name)


def current_backend(need: str | None = None, dtypes: Iterable[Any] = ()) -> Backend:
    """The selected Backend object, resolving the default on first use.

    ``need`` ("kernel_graphs", with the graph's ``dtypes`` when known, or "persistent"): when the
    selection is auto, the best available backend that can serve it (memoized; the decision lands in
    ``last_auto_report``); when a backend was named, that backend, or NotSupportedError saying what it
    lacks and which backends have it.
    """
    global _current, _how
    req = _request(need, dtypes)
    with _lock:
        if _current is None:
            if _requested is not None:
                key, origin = _requested, _requested_from
            else:
                saved = config.load().get("backend")
                key, origin = (str(saved), f"the saved setting in {config.config_path()}") if saved else ("auto", "")
            _current = resolve(key, origin)
            _how = (_current, _normalize(key) == "auto", origin)
            _by_need.clear()
        if req is None:
            return _current
        chosen_by, auto, origin = _how
        if chosen_by is not _current:  # _current was replaced behind our back: treat it as named
            auto, origin = False, ""
        if not auto:
            _require(_current, req, f" (from {origin})" if origin else "")
            return _current
        known = _by_need.get(req)
        if known is not None and known[0] is _current:
            return known[1]
        choice = _current if not _missing(_current, req) else _choose_auto(registry(), req)
        _by_need[req] = (_current, choice)
        return choice


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
        _by_need.clear()
        _caps.clear()
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
        "capabilities": None,
    }
    try:
        info["capabilities"] = capabilities(backend).as_dict()
    except PluginError as exc:  # shown in place of the capabilities; the rest is still described
        info["capabilities_error"] = str(exc)
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
