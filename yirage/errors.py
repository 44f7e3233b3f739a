"""Exception types: each one names the cause and the fix in its message."""

from __future__ import annotations


class YirageError(Exception):
    """Base class of every error yirage raises on purpose."""


class BackendError(YirageError):
    """Something is wrong with the choice or state of a backend."""


class UnknownBackendError(BackendError, ValueError):
    """A backend name that no loaded plugin provides."""


class BackendUnavailableError(BackendError, RuntimeError):
    """A known backend whose probe says it cannot run on this machine."""


class NotSupportedError(BackendError, NotImplementedError):
    """A backend that does not implement a feature (compile, persistent runtime, ...)."""


class PluginError(YirageError):
    """A plugin that could not be loaded, or was refused."""


class PluginAPIVersionError(PluginError):
    """A plugin written for a plugin-API version this yirage does not speak."""


class UnsupportedAPIError(NotSupportedError, AttributeError):
    """A Mirage API that yirage does not provide (yet); the message says what to use instead.

    It is an AttributeError too, so ``hasattr`` and ``getattr(obj, name, default)`` keep working.
    """


class DeviceMemoryError(YirageError, MemoryError):
    """A call whose outputs cannot fit in the memory its device has free (checked before allocating them)."""
