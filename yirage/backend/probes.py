"""Import-light probing helpers shared by backends.

Generic facts only (is a module installed, which devices does torch's CUDA
API list): what to make of them, e.g. which vendor a device belongs to, is
each backend's own business.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import platform
import sys
from dataclasses import dataclass
from typing import Any

from yirage.backend.base import MemoryInfo


def module_installed(name: str) -> bool:
    """True when ``import name`` would find a module, without importing it."""
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def is_macos_arm() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


@dataclass(frozen=True)
class TorchDevice:
    """One device as torch's CUDA-API (``torch.cuda``) reports it."""

    index: int
    name: str
    total_memory: int
    multi_processor_count: int | None
    capability: tuple[int, int] | None


@dataclass(frozen=True)
class TorchCudaFacts:
    """What torch says about its CUDA-API devices, and how torch was built."""

    torch_version: str
    cuda_version: str | None  # torch.version.cuda
    hip_version: str | None  # torch.version.hip (ROCm / Hygon DCU builds)
    devices: tuple[TorchDevice, ...]
    error: str = ""


def torch_cuda_facts() -> TorchCudaFacts:
    """Ask torch (imported here, lazily) which CUDA-API devices it sees."""
    if not module_installed("torch"):
        return TorchCudaFacts("", None, None, (), "torch is not installed")
    import torch

    cuda = getattr(torch.version, "cuda", None)
    hip = getattr(torch.version, "hip", None)
    devices: list[TorchDevice] = []
    error = ""
    try:
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                major, minor = getattr(props, "major", None), getattr(props, "minor", None)
                devices.append(
                    TorchDevice(
                        index=index,
                        name=str(props.name),
                        total_memory=int(props.total_memory),
                        multi_processor_count=getattr(props, "multi_processor_count", None),
                        capability=(major, minor) if major is not None else None,
                    )
                )
    except RuntimeError as exc:  # driver present but broken: report it
        error = f"torch.cuda raised {exc}"
    return TorchCudaFacts(torch.__version__, cuda, hip, tuple(devices), error)


def torch_device_module(attr: str) -> Any | None:
    """``torch.<attr>`` (``npu``, ``mlu``, ``musa``) once its adapter registered it."""
    import torch

    return getattr(torch, attr, None)


def torch_cuda_memory(torch_index: int) -> MemoryInfo:
    """Free and total memory of one ``torch.cuda`` device, measured by the driver."""
    import torch

    free, total = torch.cuda.mem_get_info(torch_index)
    return MemoryInfo(int(total), int(total - free), int(free), "torch.cuda.mem_get_info")
