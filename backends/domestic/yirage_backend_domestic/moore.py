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
    collective = "mccl"  # torch_musa registers MCCL
    triton_name = "Moore Threads' Triton"
    triton_install = ("pip install flagtree==0.4.0+mthreads3.1 from the FlagOS index (backend "
                      "triton.backends.mthreads), or the triton of Moore Threads' MUSA release")
    triton_backends = ("mthreads", "musa")
    triton_targets = frozenset({"musa"})
    triton_dists = ("flagtree",)
    triton_fp64 = False  # FlagGems' mthreads descriptor: fp64_enabled=False


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [MooreBackend]
