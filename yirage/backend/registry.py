"""The registry: every discovered backend by name, with its plugin record."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from yirage.backend.base import Backend
from yirage.backend.plugins import PluginRecord, PluginSet, discover
from yirage.errors import UnknownBackendError

logger = logging.getLogger("yirage.backend")


class Registry:
    """Backends discovered once per process (or per ``Registry`` in tests)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ
        self._lock = threading.Lock()
        self._plugins: PluginSet | None = None
        self._backends: dict[str, Backend] = {}
        self._origin: dict[str, PluginRecord] = {}
        self.conflicts: list[str] = []

    def _load(self) -> None:
        with self._lock:
            if self._plugins is not None:
                return
            plugins = discover(self._environ)
            for cls, record in plugins.backend_classes:
                if cls.name in self._backends:
                    first = self._origin[cls.name]
                    message = (
                        f"backend {cls.name!r} from plugin {record.name!r} ({record.distribution}) "
                        f"was ignored: plugin {first.name!r} ({first.distribution}) already provides it; "
                        f"uninstall one of them or pick one with YIRAGE_PLUGINS"
                    )
                    logger.warning("%s", message)
                    self.conflicts.append(message)
                    continue
                try:
                    backend = cls()
                except Exception as exc:  # noqa: BLE001 - one broken backend must not hide the others
                    message = (
                        f"backend {cls.name!r} from plugin {record.name!r} ({record.distribution}) "
                        f"could not be created: {type(exc).__name__}: {exc}"
                    )
                    logger.warning("%s", message)
                    self.conflicts.append(message)
                    continue
                self._backends[cls.name] = backend
                self._origin[cls.name] = record
            self._plugins = plugins

    @property
    def plugins(self) -> PluginSet:
        self._load()
        assert self._plugins is not None
        return self._plugins

    def names(self) -> list[str]:
        """Backend names, highest priority first (ties by name)."""
        self._load()
        return sorted(self._backends, key=lambda n: (-self._backends[n].priority, n))

    def backends(self) -> list[Backend]:
        return [self._backends[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._backends

    def get(self, name: str) -> Backend:
        self._load()
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
