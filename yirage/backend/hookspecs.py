"""The one hookspec module: the hooks a yirage plugin may implement.

A plugin is a module (registered under the entry-point group
``yirage.backends``) that sets ``YIRAGE_PLUGIN_API = 1`` and implements hooks
marked with ``yirage.hookimpl``, as in pluggy's eggsample.
"""

from __future__ import annotations

import pluggy

PROJECT = "yirage"
ENTRY_POINT_GROUP = "yirage.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def yirage_backends() -> list[type]:  # type: ignore[empty-body]
    """Return the Backend subclasses this plugin provides.

    Called once per process at discovery. Keep it import-light: import the
    device's library inside the backend's ``probe``, not here.
    """
