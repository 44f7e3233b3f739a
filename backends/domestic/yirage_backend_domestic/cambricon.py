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
    collective = "cncl"  # torch_mlu registers CNCL
    triton_name = "Cambricon's Triton"
    triton_install = ("the triton of Cambricon's torch_mlu release, whose backend is triton.backends.mlu; or FlagTree "
                      "built with FLAGTREE_BACKEND=cambricon from its triton_v3.2.x branch")
    triton_backends = ("mlu",)
    triton_targets = frozenset({"mlu"})
    triton_dists = ("flagtree",)
    triton_fp64 = False  # FlagGems' cambricon descriptor: fp64_enabled=False


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [CambriconBackend]
