"""The Iluvatar CoreX backend: CUDA-compatible devices that torch lists under torch.cuda."""

from __future__ import annotations

import re

import yirage
from yirage_backend_domestic._cuda_compatible import CudaCompatibleBackend

YIRAGE_PLUGIN_API = 1


class IluvatarBackend(CudaCompatibleBackend):
    name = "iluvatar"
    priority = 95
    vendor = "Iluvatar CoreX"
    device_name = re.compile(r"\biluvatar\b|\b(BI|MR)-V\d+", re.IGNORECASE)
    needs_hip = False
    stack = "Iluvatar's PyTorch build on the CoreX SDK"
    description = "Iluvatar CoreX GPUs (BI-V100/V150, MR-V100) through the CoreX CUDA-compatible stack"
    collective = "nccl"  # Iluvatar's CUDA-compatible torch serves its IXCCL under the name nccl
    triton_name = "Iluvatar's Triton"
    triton_install = ("pip install flagtree==0.4.0+iluvatar3.1 from the FlagOS index (backend "
                      "triton.backends.iluvatar), or the triton of Iluvatar's CoreX SDK")
    triton_backends = ("iluvatar", "corex")
    triton_targets = frozenset({"cuda", "corex"})  # FlagTree's iluvatar driver reports GPUTarget("cuda", ...)
    triton_dists = ("flagtree",)
    triton_fp64 = False  # FlagGems' iluvatar descriptor: fp64_enabled=False
    later_step = "compiling yirage's CUDA dialect with the CoreX compiler instead is a later step"


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [IluvatarBackend]
