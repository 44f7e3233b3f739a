"""A complete third-party yirage backend plugin in one module.

Install it (``pip install ./examples/yirage-backend-example``) and
``python -m yirage info`` lists the ``example`` backend; nothing else is needed.
"""

from __future__ import annotations

import yirage
from yirage.backend.host import host_device_info, host_memory_info

YIRAGE_PLUGIN_API = 1  # the plugin-API version this module was written for


class ExampleBackend(yirage.Backend):
    name = "example"
    priority = 10  # below the built-in cpu backend: auto never prefers it
    vendor = "Example Corp"
    torch_device = "cpu"
    device_kind = "cpu"
    description = "an example plugin that describes the host CPU"

    def probe(self) -> yirage.Availability:
        return yirage.Availability(True, "the example backend runs wherever Python does")

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        return host_device_info()

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        return host_memory_info()


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [ExampleBackend]
