"""The registry: every discovered backend by name, with its plugin record."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from yirage.backend.base import Backend
from yirage.backend.plugins import BUILTIN_DISTRIBUTIONS, Discovery, PluginRecord, PluginSet, record_order
from yirage.errors import UnknownBackendError

logger = logging.getLogger("yirage.backend")


class Registry:
    """Backends discovered once per process (or per ``Registry`` in tests).

    Asking for one backend by name (``in``, ``get``, ``origin``) loads only
    the plugins named like it, unless none provides it; listing (``names``,
    ``backends``, ``plugins``) loads them all. Either way a name resolves to
    the same plugin: built-in distributions win clashes.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ
        self._lock = threading.RLock()
        self._discovery: Discovery | None = None
        self._absorbed: set[int] = set()  # ids of (class, record) pairs already considered
        self._backends: dict[str, Backend] = {}
        self._origin: dict[str, PluginRecord] = {}
        self._conflicts: list[str] = []

    def _started(self) -> Discovery:
        if self._discovery is None:
            self._discovery = Discovery(self._environ)
        return self._discovery

    def _load(self) -> None:
        """Load every plugin the switches allow and take all their backends."""
        with self._lock:
            discovery = self._started()
            if discovery.complete:
                return
            discovery.load_all()
            self._absorb(None)

    def _load_for(self, name: str) -> None:
        """Make sure backend ``name`` is loaded if any plugin provides it, loading as little as possible."""
        with self._lock:
            discovery = self._started()
            if discovery.complete or name in self._backends:
                return
            discovery.load_named(name)
            winner = self._candidate(name)
            if winner is not None and winner[1].distribution not in BUILTIN_DISTRIBUTIONS:
                discovery.load_named(name, builtins_too=True)  # a built-in providing it would win
            if self._candidate(name) is not None:
                self._absorb(name)
            else:
                discovery.load_all()
                self._absorb(None)

    def _ordered(self) -> list[tuple[type[Backend], PluginRecord]]:
        assert self._discovery is not None
        return sorted(self._discovery.plugins.backend_classes, key=lambda pair: record_order(pair[1]))

    def _candidate(self, name: str) -> tuple[type[Backend], PluginRecord] | None:
        return next(((cls, rec) for cls, rec in self._ordered() if cls.name == name), None)

    def _absorb(self, only: str | None) -> None:
        """Instantiate the loaded backend classes (only those named ``only`` if given), first one wins."""
        limit = self._started().plugins.time_limit
        for pair in self._ordered():
            cls, record = pair
            if id(pair) in self._absorbed or (only is not None and cls.name != only):
                continue
            self._absorbed.add(id(pair))
            if cls.name in self._backends:
                first = self._origin[cls.name]
                message = (
                    f"backend {cls.name!r} from plugin {record.name!r} ({record.distribution}) "
                    f"was ignored: plugin {first.name!r} ({first.distribution}) already provides it; "
                    f"uninstall one of them or pick one with YIRAGE_PLUGINS"
                )
                logger.warning("%s", message)
                self._conflicts.append(message)
                continue
            try:
                backend = cls()
            except Exception as exc:  # noqa: BLE001 - one broken backend must not hide the others
                message = (
                    f"backend {cls.name!r} from plugin {record.name!r} ({record.distribution}) "
                    f"could not be created: {type(exc).__name__}: {exc}"
                )
                logger.warning("%s", message)
                self._conflicts.append(message)
                continue
            # what Backend.availability() needs to time its probe and name the plugin in its reasons
            object.__setattr__(backend, "_probe_timeout", limit)
            object.__setattr__(
                backend, "_plugin_origin",
                f"plugin {record.name!r} from distribution {record.distribution} {record.version}".rstrip(),
            )
            self._backends[cls.name] = backend
            self._origin[cls.name] = record
            logger.debug("registered backend %r (priority %d) from plugin %r (%s %s)", cls.name, cls.priority,
                         record.name, record.distribution, record.version)

    @property
    def conflicts(self) -> list[str]:
        """Backends ignored because another plugin provides the name, or broken: loads all plugins first."""
        self._load()
        return self._conflicts

    @property
    def plugins(self) -> PluginSet:
        """Every plugin record: loads all plugins first."""
        self._load()
        return self._started().plugins

    def names(self) -> list[str]:
        """Backend names, highest priority first (ties by name)."""
        self._load()
        return sorted(self._backends, key=lambda n: (-self._backends[n].priority, n))

    def backends(self) -> list[Backend]:
        return [self._backends[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        self._load_for(name)
        return name in self._backends

    def get(self, name: str) -> Backend:
        if isinstance(name, str):
            self._load_for(name)
        try:
            return self._backends[name]
        except KeyError:
            raise UnknownBackendError(self._unknown_message(name)) from None

    def origin(self, name: str) -> PluginRecord:
        self.get(name)
        return self._origin[name]

    def _unknown_message(self, name: str) -> str:
        available = [b.name for b in self.backends() if b.availability().ok]
        message = (
            f"unknown backend {name!r}; available here: {', '.join(available) or 'none'} "
            f"(all loaded: {', '.join(self.names())})."
        )
        records = [r for r in self.plugins.records if r.name == name and r.status != "loaded"]
        if records:
            record = records[0]
            if record.status == "excluded":
                message += (
                    f" It is provided by the installed plugin {record.name!r} ({record.distribution} "
                    f"{record.version}), which was not loaded: {record.error}."
                )
            else:
                message += f" The plugin that provides it did not load: {record.error}"
        else:
            message += (
                " Install the plugin that provides it (a distribution with an entry point "
                "in the 'yirage.backends' group)."
            )
        return message

    def forget_probes(self) -> None:
        for backend in self._backends.values():
            backend.forget_probe()
