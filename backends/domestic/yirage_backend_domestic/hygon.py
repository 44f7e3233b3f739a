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


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [HygonBackend]
