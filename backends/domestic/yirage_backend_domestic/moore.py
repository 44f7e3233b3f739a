"""The Moore Threads backend: devices reached through torch_musa as torch "musa"."""

from __future__ import annotations

import yirage
from yirage_backend_domestic._torch_adapter import TorchAdapterBackend

YIRAGE_PLUGIN_API = 1


class MooreBackend(TorchAdapterBackend):
    name = "moore"
    priority = 90
    vendor = "Moore Threads"
    torch_device = "musa"
    adapter = "torch_musa"
    stack = "torch_musa and the MUSA toolkit"
    description = "Moore Threads GPUs (MTT S80/S4000) via torch_musa and MUSA"


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [MooreBackend]
