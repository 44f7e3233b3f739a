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


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [IluvatarBackend]
