"""The ``torch`` backend: the kernel plan as unfused torch ops on the host CPU.

The torch-device lowering (``yirage.codegen.torch_plan``) that the domestic accelerators fall back to,
run on torch's CPU device so the conformance kit proves it here. It sits in the core next to the mixin
it is made of (it needs only the backend layer and torch), is always registered, like ``reference``,
and is never picked by ``set_backend('auto')``: it is correct but unfused, slower than ``cpu``.
"""

from __future__ import annotations

import sys

from yirage.backend.base import Availability, Backend, DeviceInfo, MemoryInfo
from yirage.backend.hookspecs import hookimpl
from yirage.backend.host import host_device_info, host_memory_info
from yirage.backend.plugins import install_core_plugin
from yirage.backend.probes import distribution_version, module_installed
from yirage.backend.torch_stages import TorchLoweringStages

YIRAGE_PLUGIN_API = 1


class TorchBackend(TorchLoweringStages, Backend):
    name = "torch"
    priority = 5  # above reference (0), below cpu (20): only ever chosen by name
    vendor = "PyTorch"
    torch_device = "cpu"
    device_kind = "cpu"
    description = "the kernel plan as unfused torch ops on any torch device (here: the CPU)"

    def probe(self) -> Availability:
        if not module_installed("torch"):
            return Availability(False, "torch is not installed: pip install 'torch==2.13.0'")
        return Availability(
            True, f"torch {distribution_version('torch')} on the host CPU, kernel by kernel: the unfused fallback "
            "of backends without a compiler, so auto passes over it (compile with backend='cpu' for speed)",
            auto=False)

    def device_info(self, index: int = 0) -> DeviceInfo:
        return host_device_info(torch=distribution_version("torch"))

    def memory_info(self, index: int = 0) -> MemoryInfo:
        return host_memory_info()


@hookimpl
def yirage_backends() -> list[type[Backend]]:
    return [TorchBackend]


install_core_plugin(sys.modules[__name__], "torch")
