"""Plugin discovery: entry points, allow-list and autoload switches, failures.

Modelled on pluggy's ``load_setuptools_entrypoints`` but robust: each entry
point is loaded on its own, so one plugin that raises on import is recorded
(name, distribution, exception) and skipped while the rest still load. Each
import (and each ``yirage_backends`` hook call) runs in a daemon thread with
the ``YIRAGE_PROBE_TIMEOUT`` limit (default 20 s): a plugin whose import does
not finish in time is recorded as failed ("import did not finish within N s")
and skipped, and yirage never imports that module again in this process while
the abandoned import still runs (it would wait on Python's import lock).

Discovery is lazy and by name first: asking for backend ``x`` loads the
entry points named ``x`` (or distributions named ``x`` / ``yirage-backend-x``),
and only when none provides ``x`` every entry point (``Discovery.load_all``).

Switches, as in pytest and llm:

* ``YIRAGE_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry point automatically;
* ``YIRAGE_PLUGINS=a,b`` loads only the entry points (or distributions)
  named ``a`` and ``b``; a name that matches no entry point is imported as a
  module path, which also works with autoload disabled.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import pluggy

from yirage import config
from yirage.backend import hookspecs
from yirage.backend.base import (
    PLUGIN_API_VERSION,
    SUPPORTED_PLUGIN_APIS,
    Backend,
    TimedCall,
    validate_backend_class,
)
from yirage.errors import PluginAPIVersionError

logger = logging.getLogger("yirage.plugins")

CORE_DISTRIBUTION = "yirage"
#: Distributions built from this repository; on a backend-name clash they win
#: over third-party plugins (pick the other one with YIRAGE_PLUGINS).
BUILTIN_DISTRIBUTIONS = frozenset(
    {
        "yirage-backend-cpu",
        "yirage-backend-opencl",
        "yirage-backend-cuda",
        "yirage-backend-mps",
        "yirage-backend-domestic",
    }
)


@dataclass(frozen=True)
class PluginRecord:
    """What happened to one plugin: loaded, failed, refused or skipped."""

    name: str
    module: str
    distribution: str
    version: str
    status: str  # "loaded", "failed", "refused", "skipped", "excluded"
    error: str = ""


class ImportTimeout(Exception):
    """A plugin import that did not finish within the time limit (internal signal)."""


#: Imports abandoned after a timeout, by module name; their threads may still run.
_abandoned: dict[str, TimedCall] = {}
_abandoned_lock = threading.Lock()


def _still_importing(module: str) -> str | None:
    """The module (or parent package) of ``module`` an abandoned import still holds."""
    parts = module.split(".")
    with _abandoned_lock:
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            call = _abandoned.get(prefix)
            if call is not None:
                if not call.finished.is_set():
                    return prefix
                del _abandoned[prefix]  # it finished after all: importing it again is safe
    return None


def timed_import(load: Callable[[], Any], module: str, limit: float) -> Any:
    """``load()`` (an import) in a daemon thread; ImportTimeout if it takes over ``limit`` s.

    Why a thread: Python cannot interrupt a hanging import. The abandoned
    thread keeps the module's import lock, so the module is remembered and
    never imported again from here while that thread runs.
    """
    stuck = _still_importing(module)
    if stuck is not None:
        raise ImportTimeout(
            f"import did not finish within {limit:g} s (an earlier import of {stuck!r} "
            "in this process is still running)"
        )
    call = TimedCall(load, f"yirage-import-{module}")
    if not call.wait(limit):
        with _abandoned_lock:
            _abandoned[module] = call
        raise ImportTimeout(f"import did not finish within {limit:g} s")
    if call.error is not None:
        raise call.error
    return call.result


def _timeout_advice(limit: float) -> str:
    return (
        "it hangs while importing: fix or uninstall it, leave it out with YIRAGE_PLUGINS, "
        f"or raise YIRAGE_PROBE_TIMEOUT (now {limit:g} s) if it is only slow"
    )


def normalize(name: str) -> str:
    """Compare plugin and distribution names as pip does (PEP 503), case-blind."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _allow_list(environ: Mapping[str, str]) -> list[str] | None:
    raw = environ.get("YIRAGE_PLUGINS")
    if raw is None:
        return None
    return [part.strip() for part in raw.split(",") if part.strip()]


def check_plugin_api(module: Any, plugin: str) -> None:
    """Refuse a plugin written for another plugin-API version."""
    declared = getattr(module, "YIRAGE_PLUGIN_API", None)
    if declared is None:
        raise PluginAPIVersionError(
            f"plugin {plugin!r} does not declare the yirage plugin API it was written for; "
            f"add `YIRAGE_PLUGIN_API = {PLUGIN_API_VERSION}` to its module"
        )
    if declared not in SUPPORTED_PLUGIN_APIS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_PLUGIN_APIS))
        raise PluginAPIVersionError(
            f"plugin {plugin!r} was written for yirage plugin API {declared!r}, "
            f"but this yirage speaks API {supported}; install a release of the plugin "
            f"built for API {PLUGIN_API_VERSION}, or a yirage that speaks API {declared!r}"
        )


class PluginSet:
    """The loaded plugins, the Backend classes they gave, and what failed."""

    def __init__(self, time_limit: float = config.DEFAULT_PROBE_TIMEOUT) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.time_limit = time_limit
        self.records: list[PluginRecord] = []
        self.backend_classes: list[tuple[type[Backend], PluginRecord]] = []
        self.handled: set[tuple[str, str, str]] = set()  # entry points already loaded or excluded

    # -- loading ---------------------------------------------------------
    def add(self, module: ModuleType | Any, name: str, distribution: str, version: str) -> PluginRecord:
        """Register one plugin object; record and return the outcome."""
        module_name = getattr(module, "__name__", repr(module))
        try:
            check_plugin_api(module, name)
            self.pm.register(module, name=name)
            self.pm.check_pending()
            record = PluginRecord(name, module_name, distribution, version, "loaded")
        except PluginAPIVersionError as exc:
            record = PluginRecord(name, module_name, distribution, version, "refused", str(exc))
        except (ValueError, pluggy.PluginValidationError) as exc:
            if self.pm.is_registered(module):
                self.pm.unregister(module)
            record = PluginRecord(
                name, module_name, distribution, version, "refused",
                f"plugin {name!r} does not fit yirage's hookspecs: {exc}",
            )
        if record.status == "loaded":
            record = self._collect_backends(module, record)
        if record.error:
            logger.warning("%s", record.error)
        logger.debug("plugin %r (%s %s, module %s): %s; backends: %s", name, distribution, version, module_name,
                     record.status, ", ".join(c.name for c, r in self.backend_classes if r is record) or "none")
        self.records.append(record)
        return record

    def _collect_backends(self, module: Any, record: PluginRecord) -> PluginRecord:
        """Call this plugin's ``yirage_backends`` hookimpls; keep the valid classes."""
        impls = [i for i in self.pm.hook.yirage_backends.get_hookimpls() if i.plugin is module]
        classes: list[Any] = []
        for impl in impls:
            call = TimedCall(lambda f=impl.function: list(f() or []), f"yirage-hook-{record.name}")
            if not call.wait(self.time_limit):
                return replace(record, status="failed", error=(
                    f"plugin {record.name!r} ({record.distribution}, module {record.module}): yirage_backends() "
                    f"did not return within {self.time_limit:g} s; fix or uninstall the plugin, "
                    "or raise YIRAGE_PROBE_TIMEOUT"
                ))
            exc = call.error
            if exc is not None:
                if not isinstance(exc, (Exception, SystemExit)):
                    raise exc
                return replace(record, status="failed",
                               error=f"plugin {record.name!r}: yirage_backends() raised {type(exc).__name__}: {exc}")
            classes += call.result
        problems = [p for p in (validate_backend_class(cls, record.name) for cls in classes) if p]
        good = [cls for cls in classes if validate_backend_class(cls, record.name) is None]
        if problems:
            record = replace(record, status="loaded" if good else "failed", error="; ".join(problems))
        self.backend_classes.extend((cls, record) for cls in good)
        return record

    def load_entry_point(self, ep: metadata.EntryPoint) -> PluginRecord:
        self.handled.add(ep_key(ep))
        dist = getattr(ep, "dist", None)
        dist_name = _distribution_name(ep) or "?"
        dist_version = dist.version if dist is not None else "?"
        if self.pm.get_plugin(ep.name) is not None or self.pm.is_blocked(ep.name):
            record = PluginRecord(
                ep.name, ep.value, dist_name, dist_version, "skipped",
                f"a plugin named {ep.name!r} is already registered",
            )
            self.records.append(record)
            return record
        started = time.perf_counter()
        try:
            module = timed_import(ep.load, ep.module, self.time_limit)
            logger.debug("imported plugin %r (entry point %s from %s %s) in %.3f s", ep.name, ep.value, dist_name,
                         dist_version, time.perf_counter() - started)
        except ImportTimeout as exc:
            message = (f"plugin {ep.name!r} from distribution {dist_name} {dist_version} (module {ep.module}) "
                       f"was skipped: its {exc}; {_timeout_advice(self.time_limit)}")
            return self._failed(ep.name, ep.value, dist_name, dist_version, message)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a crashing plugin is reported and skipped
            message = (f"plugin {ep.name!r} from distribution {dist_name} {dist_version} "
                       f"failed to import: {type(exc).__name__}: {exc}")
            return self._failed(ep.name, ep.value, dist_name, dist_version, message)
        return self.add(module, ep.name, dist_name, dist_version)

    def _failed(self, name: str, value: str, dist_name: str, dist_version: str, message: str) -> PluginRecord:
        """Report a plugin that could not be loaded; the others still load."""
        logger.warning("%s", message)
        record = PluginRecord(name, value, dist_name, dist_version, "failed", message)
        self.records.append(record)
        return record

    def load_module_path(self, path: str, known: list[str]) -> PluginRecord:
        if any(r.module == path and r.status == "loaded" for r in self.records):
            record = PluginRecord(path, path, "?", "?", "skipped", f"plugin module {path!r} is already loaded")
            self.records.append(record)
            return record
        started = time.perf_counter()
        try:
            module = timed_import(lambda: importlib.import_module(path), path, self.time_limit)
            logger.debug("imported plugin module %r named in YIRAGE_PLUGINS in %.3f s", path,
                         time.perf_counter() - started)
        except ImportTimeout as exc:
            message = (
                f"plugin module {path!r} named in YIRAGE_PLUGINS was skipped: its {exc}; "
                f"{_timeout_advice(self.time_limit)}"
            )
            return self._failed(path, path, "?", "?", message)
        except ModuleNotFoundError as exc:
            if exc.name != path.split(".")[0] and exc.name != path:
                message = f"plugin module {path!r} named in YIRAGE_PLUGINS failed to import: ModuleNotFoundError: {exc}"
            else:
                message = (
                    f"YIRAGE_PLUGINS names {path!r}, which matches no installed plugin and no importable "
                    f"module; installed plugins: {', '.join(known) or 'none'}"
                )
            return self._failed(path, path, "?", "?", message)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - same policy as for entry points
            message = f"plugin module {path!r} named in YIRAGE_PLUGINS failed to import: {type(exc).__name__}: {exc}"
            return self._failed(path, path, "?", "?", message)
        return self.add(module, path, "(YIRAGE_PLUGINS)", "")

    def exclude(self, ep: metadata.EntryPoint, why: str) -> None:
        """Record an installed plugin that the switches kept from loading."""
        logger.debug("plugin %r (%s) not loaded: %s", ep.name, _distribution_name(ep) or "?", why)
        self.handled.add(ep_key(ep))
        dist = getattr(ep, "dist", None)
        self.records.append(PluginRecord(
            ep.name, ep.value, _distribution_name(ep) or "?", dist.version if dist is not None else "?",
            "excluded", why,
        ))


def _distribution_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else ""


def _core_version() -> str:
    try:
        return metadata.version(CORE_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "source"


def ep_key(ep: metadata.EntryPoint) -> tuple[str, str, str]:
    return (_distribution_name(ep), ep.name, ep.value)


def _ep_order(ep: metadata.EntryPoint) -> tuple[bool, str, str]:
    """Built-in distributions first (they win name clashes), then by distribution and name."""
    return (_distribution_name(ep) not in BUILTIN_DISTRIBUTIONS, _distribution_name(ep), ep.name)


def record_order(record: PluginRecord) -> tuple[int, str, str]:
    """The order full discovery loads plugins in: core, built-ins, third parties, YIRAGE_PLUGINS modules."""
    if record.distribution == CORE_DISTRIBUTION:
        rank = 0
    elif record.distribution in BUILTIN_DISTRIBUTIONS:
        rank = 1
    elif record.distribution == "(YIRAGE_PLUGINS)":
        rank = 3
    else:
        rank = 2
    return (rank, record.distribution, record.name)


def _lookup_names(ep: metadata.EntryPoint) -> set[str]:
    """The backend names an entry point probably provides, judged by its names alone."""
    dist = normalize(_distribution_name(ep))
    names = {normalize(ep.name), dist}
    if dist.startswith("yirage-backend-"):
        names.add(dist.removeprefix("yirage-backend-"))
    return names


_core_plugins: list[tuple[ModuleType, str]] = []


def install_core_plugin(module: ModuleType, name: str) -> None:
    """Register a plugin module that ships in the core (the reference oracle).

    The core's plugins sit above this layer (they import the Backend class), so they
    announce themselves when imported instead of discovery importing them; every
    Discovery made afterwards registers them, even with plugin autoload off.
    """
    if all(known is not module for known, _ in _core_plugins):
        _core_plugins.append((module, name))


class Discovery:
    """Loads plugins on demand under the switches: by backend name first, all when needed."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.env = os.environ if environ is None else environ
        self.plugins = PluginSet(config.probe_timeout(self.env))
        for module, name in _core_plugins:
            self.plugins.add(module, name, CORE_DISTRIBUTION, _core_version())
        self.allow = _allow_list(self.env)
        self.wanted = {normalize(name) for name in self.allow or ()}
        self.autoload = not self.env.get("YIRAGE_DISABLE_PLUGIN_AUTOLOAD")  # any non-empty value disables
        self.complete = False
        self._eps: list[metadata.EntryPoint] | None = None

    def entry_points(self) -> list[metadata.EntryPoint]:
        if self._eps is None:
            self._eps = sorted(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=_ep_order)
        return self._eps

    def _permitted(self, ep: metadata.EntryPoint) -> bool:
        names = {normalize(ep.name), normalize(_distribution_name(ep))}
        if self.allow is not None:
            return bool(names & self.wanted)
        return self.autoload

    def load_named(self, name: str, builtins_too: bool = False) -> None:
        """Load the permitted entry points named like backend ``name`` (and all built-ins if asked)."""
        if self.complete:
            return
        key = normalize(name)
        logger.debug("looking up plugins that provide backend %r%s", name,
                     " (and the built-ins)" if builtins_too else "")
        for ep in self.entry_points():
            if ep_key(ep) in self.plugins.handled or not self._permitted(ep):
                continue
            builtin = _distribution_name(ep) in BUILTIN_DISTRIBUTIONS
            if key in _lookup_names(ep) or (builtins_too and builtin):
                self.plugins.load_entry_point(ep)

    def load_all(self) -> None:
        """Load or exclude every entry point, then the module paths of YIRAGE_PLUGINS."""
        if self.complete:
            return
        eps = self.entry_points()
        logger.debug("loading every plugin the switches allow: %d entry point(s) in group %r", len(eps),
                     hookspecs.ENTRY_POINT_GROUP)
        matched: set[str] = set()
        for ep in eps:
            if self.allow is not None:
                matched |= {normalize(ep.name), normalize(_distribution_name(ep))} & self.wanted
            if ep_key(ep) in self.plugins.handled:
                continue
            if self.allow is not None and not self._permitted(ep):
                self.plugins.exclude(ep, f"not named in YIRAGE_PLUGINS={self.env.get('YIRAGE_PLUGINS')!r}")
            elif self.allow is None and not self.autoload:
                self.plugins.exclude(ep, "YIRAGE_DISABLE_PLUGIN_AUTOLOAD is set")
            else:
                self.plugins.load_entry_point(ep)
        known = sorted({ep.name for ep in eps} | {_distribution_name(ep) for ep in eps})
        core = {normalize(core_name) for _, core_name in _core_plugins}  # registered already, not module paths
        for name in self.allow or ():
            if normalize(name) not in matched and normalize(name) not in core:
                self.plugins.load_module_path(name, known)
        self.complete = True


def discover(environ: Mapping[str, str] | None = None) -> PluginSet:
    """Load the core's own plugin, then every entry point the switches allow."""
    discovery = Discovery(environ)
    discovery.load_all()
    return discovery.plugins
