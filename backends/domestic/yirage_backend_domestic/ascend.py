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
    collective = "hccl"  # torch_npu registers HCCL
    triton_name = "triton-ascend"
    triton_install = ("pip install triton-ascend, Huawei's Triton for CANN; or FlagTree's build: "
                      "pip install flagtree==0.4.0+ascend3.2 from the FlagOS index")
    triton_backends = ("ascend",)
    triton_targets = frozenset({"npu"})
    triton_dists = ("triton-ascend", "flagtree")
    triton_fp64 = False  # FlagGems' ascend descriptor: fp64_enabled=False


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [AscendBackend]
