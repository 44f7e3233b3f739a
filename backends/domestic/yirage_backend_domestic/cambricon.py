"""The Cambricon backend: devices reached through torch_mlu as torch "mlu"."""

from __future__ import annotations

import yirage
from yirage_backend_domestic._torch_adapter import TorchAdapterBackend

YIRAGE_PLUGIN_API = 1


class CambriconBackend(TorchAdapterBackend):
    name = "cambricon"
    priority = 90
    vendor = "Cambricon"
    torch_device = "mlu"
    adapter = "torch_mlu"
    stack = "torch_mlu and the Cambricon Neuware SDK"
    description = "Cambricon MLUs (MLU370, MLU590) via torch_mlu and Neuware"


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [CambriconBackend]
