"""The MetaX backend: CUDA-compatible devices that torch lists under torch.cuda."""

from __future__ import annotations

import re

import yirage
from yirage_backend_domestic._cuda_compatible import CudaCompatibleBackend

YIRAGE_PLUGIN_API = 1


class MetaXBackend(CudaCompatibleBackend):
    name = "metax"
    priority = 95
    vendor = "MetaX"
    device_name = re.compile(r"\bmetax\b|\bMXC\d", re.IGNORECASE)
    needs_hip = False
    stack = "MetaX's PyTorch build on the MACA software stack"
    description = "MetaX GPUs (C500, N260) through the MACA CUDA-compatible stack"
    collective = "nccl"  # MetaX's CUDA-compatible torch serves its MCCL under the name nccl
    triton_name = "MetaX's Triton"
    triton_install = ("the triton of MetaX's MACA release (backend triton.backends.metax), or FlagTree built with "
                      "FLAGTREE_BACKEND=metax")
    triton_backends = ("metax",)
    triton_targets = frozenset({"maca"})
    triton_dists = ("flagtree",)
    triton_fp64 = True
    later_step = "compiling yirage's CUDA dialect with MACA's compiler instead is a later step"


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [MetaXBackend]
