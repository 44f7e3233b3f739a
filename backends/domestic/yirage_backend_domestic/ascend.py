"""The Huawei Ascend backend: devices reached through torch_npu as torch "npu"."""

from __future__ import annotations

import yirage
from yirage_backend_domestic._torch_adapter import TorchAdapterBackend

YIRAGE_PLUGIN_API = 1


class AscendBackend(TorchAdapterBackend):
    name = "ascend"
    priority = 90
    vendor = "Huawei Ascend"
    torch_device = "npu"
    adapter = "torch_npu"
    stack = "torch_npu and the CANN toolkit"
    description = "Ascend NPUs (Atlas 300/800, 910B) via torch_npu and CANN"


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [AscendBackend]
