"""The Hygon backend: CUDA-compatible devices that torch lists under torch.cuda."""

from __future__ import annotations

import re

import yirage
from yirage_backend_domestic._cuda_compatible import CudaCompatibleBackend

YIRAGE_PLUGIN_API = 1


class HygonBackend(CudaCompatibleBackend):
    name = "hygon"
    priority = 95
    vendor = "Hygon"
    device_name = re.compile(r"\bhygon\b|\bDCU\b|^(K100|Z100)", re.IGNORECASE)
    needs_hip = True
    stack = "Hygon's PyTorch build on the DTK (ROCm/HIP) stack"
    description = "Hygon DCUs (Z100, K100) through the DTK HIP stack"
    collective = "nccl"  # a ROCm build of torch serves RCCL under the name nccl
    triton_name = "a ROCm Triton"
    triton_install = ("pip install flagtree==0.4.0+hcu3.0 from the FlagOS index (backend triton.backends.hcu), DTK's "
                      "triton, or a ROCm Triton with its amd backend")
    triton_backends = ("hcu", "amd")
    triton_targets = frozenset({"hip"})
    triton_dists = ("flagtree", "pytorch-triton-rocm")
    triton_fp64 = True
    later_step = "running yirage's HIP dialect (hip_build compiles it) on the DCU instead is a later step"


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [HygonBackend]
