"""Plugin discovery: entry points, allow-list and autoload switches, failures.

Modelled on pluggy's ``load_setuptools_entrypoints`` but robust: each entry
point is loaded on its own, so one plugin that raises on import is recorded
(name, distribution, exception) and skipped while the rest still load.

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
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import pluggy

from yirage.backend import hookspecs
from yirage.backend.base import PLUGIN_API_VERSION, SUPPORTED_PLUGIN_APIS, Backend, validate_backend_class
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

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self.backend_classes: list[tuple[type[Backend], PluginRecord]] = []

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
        self.records.append(record)
        return record

    def _collect_backends(self, module: Any, record: PluginRecord) -> PluginRecord:
        """Call this plugin's ``yirage_backends`` hookimpls; keep the valid classes."""
        impls = [i for i in self.pm.hook.yirage_backends.get_hookimpls() if i.plugin is module]
        classes: list[Any] = []
        for impl in impls:
            try:
                classes += list(impl.function() or [])
            except Exception as exc:  # noqa: BLE001 - a plugin's hook must not take the host down
                return replace(record, status="failed",
                               error=f"plugin {record.name!r}: yirage_backends() raised {type(exc).__name__}: {exc}")
        problems = [p for p in (validate_backend_class(cls, record.name) for cls in classes) if p]
        good = [cls for cls in classes if validate_backend_class(cls, record.name) is None]
        if problems:
            record = replace(record, status="loaded" if good else "failed", error="; ".join(problems))
        self.backend_classes.extend((cls, record) for cls in good)
        return record

    def load_entry_point(self, ep: metadata.EntryPoint) -> PluginRecord:
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
        try:
            module = ep.load()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a crashing plugin is reported and skipped
            message = (
                f"plugin {ep.name!r} from distribution {dist_name} {dist_version} "
                f"failed to import: {type(exc).__name__}: {exc}"
            )
            logger.warning("%s", message)
            record = PluginRecord(ep.name, ep.value, dist_name, dist_version, "failed", message)
            self.records.append(record)
            return record
        return self.add(module, ep.name, dist_name, dist_version)

    def load_module_path(self, path: str, known: list[str]) -> PluginRecord:
        if any(r.module == path and r.status == "loaded" for r in self.records):
            record = PluginRecord(path, path, "?", "?", "skipped", f"plugin module {path!r} is already loaded")
            self.records.append(record)
            return record
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name != path.split(".")[0] and exc.name != path:
                message = f"plugin module {path!r} named in YIRAGE_PLUGINS failed to import: ModuleNotFoundError: {exc}"
            else:
                message = (
                    f"YIRAGE_PLUGINS names {path!r}, which matches no installed plugin and no importable "
                    f"module; installed plugins: {', '.join(known) or 'none'}"
                )
            logger.warning("%s", message)
            record = PluginRecord(path, path, "?", "?", "failed", message)
            self.records.append(record)
            return record
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - same policy as for entry points
            message = f"plugin module {path!r} named in YIRAGE_PLUGINS failed to import: {type(exc).__name__}: {exc}"
            logger.warning("%s", message)
            record = PluginRecord(path, path, "?", "?", "failed", message)
            self.records.append(record)
            return record
        return self.add(module, path, "(YIRAGE_PLUGINS)", "")

    def exclude(self, ep: metadata.EntryPoint, why: str) -> None:
        """Record an installed plugin that the switches kept from loading."""
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


def discover(environ: Mapping[str, str] | None = None) -> PluginSet:
    """Load the core's own plugin, then the entry points the switches allow."""
    from yirage.backend import reference

    env = os.environ if environ is None else environ
    plugins = PluginSet()
    plugins.add(reference, "reference", CORE_DISTRIBUTION, _core_version())

    allow = _allow_list(env)
    wanted = {normalize(name) for name in allow or ()}
    autoload = not env.get("YIRAGE_DISABLE_PLUGIN_AUTOLOAD")  # any non-empty value disables, as in pytest
    eps = sorted(
        metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP),
        key=lambda ep: (_distribution_name(ep) not in BUILTIN_DISTRIBUTIONS, _distribution_name(ep), ep.name),
    )
    matched: set[str] = set()
    for ep in eps:
        names = {normalize(ep.name), normalize(_distribution_name(ep))}
        if allow is not None:
            hit = names & wanted
            if not hit:
                plugins.exclude(ep, f"not named in YIRAGE_PLUGINS={env.get('YIRAGE_PLUGINS')!r}")
                continue
            matched |= hit
        elif not autoload:
            plugins.exclude(ep, "YIRAGE_DISABLE_PLUGIN_AUTOLOAD is set")
            continue
        plugins.load_entry_point(ep)
    known = sorted({ep.name for ep in eps} | {_distribution_name(ep) for ep in eps})
    for name in allow or ():
        if normalize(name) not in matched and normalize(name) != "reference":
            plugins.load_module_path(name, known)
    return plugins
