"""The MPS backend: Apple silicon GPUs through Metal and torch's "mps" device."""

from __future__ import annotations

import platform

import psutil

import yirage
from yirage import system
from yirage.backend.probes import is_macos_arm, module_installed

YIRAGE_PLUGIN_API = 1


class MPSBackend(yirage.Backend):
    name = "mps"
    priority = 80
    vendor = "Apple"
    torch_device = "mps"
    device_kind = "gpu"
    description = "Metal Shading Language kernels on Apple silicon GPUs"

    def probe(self) -> yirage.Availability:
        if not is_macos_arm():
            return yirage.Availability(
                False, f"MPS needs macOS on Apple silicon; this is {platform.system()} {platform.machine()}"
            )
        if not module_installed("torch"):
            return yirage.Availability(False, "torch is not installed: pip install torch")
        import torch

        if not torch.backends.mps.is_built():
            return yirage.Availability(False, f"torch {torch.__version__} was built without MPS support")
        if not torch.backends.mps.is_available():
            return yirage.Availability(False, "torch reports MPS unavailable (macOS 12.3 or newer is required)")
        return yirage.Availability(True, f"Metal GPU of {system.cpu_model()}")

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        self.require_available()
        return yirage.DeviceInfo(
            name=f"{system.cpu_model()} GPU",
            vendor="Apple",
            kind="gpu",
            compute_units=None,  # the GPU core count is not exposed through sysctl or torch
            memory_bytes=psutil.virtual_memory().total,  # unified memory
            simd_width=32,
        )

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        import torch

        self.require_available()
        total = psutil.virtual_memory().total
        recommended = int(torch.mps.recommended_max_memory())
        used = int(torch.mps.driver_allocated_memory())
        return yirage.MemoryInfo(recommended or total, used, max((recommended or total) - used, 0), "torch.mps")


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [MPSBackend]
