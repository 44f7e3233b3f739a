"""The MPS backend: Apple silicon GPUs through Metal and torch's "mps" device.

Kernel plans are rendered by the core's C-family renderer in the Metal dialect
and compiled and launched through ``torch.mps.compile_shader`` on MPS tensors
(``compile.py``). Dtypes: float32, int32 and int64 are computed as they are;
float16 and bfloat16 tensors are loaded as float32 and stored rounded to
nearest even (``bfloat`` needs Metal Shading Language 3.1, i.e. macOS 14: on an
older macOS a bfloat16 graph is refused at load with that reason). Metal has
no double, so float64 is not claimed; nor is its math library's ``erf``
spelled, so graphs with gelu are refused by the renderer with the reason.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

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

    # -- compile stages (yirage_backend_mps.compile), cached by the core's compile_cached --
    kernel_dtypes = frozenset({"float32", "float16", "bfloat16", "int32", "int64"})

    def render(self, plan: Any) -> str:
        """The plan's kernels as MSL behind a one-line JSON launch header."""
        from yirage_backend_mps.compile import render_source

        return render_source(plan)

    def build(self, source: str, workdir: Path) -> Path:
        from yirage_backend_mps.compile import build

        return build(source, workdir)

    def load(self, artifact: Any) -> Any:
        from yirage_backend_mps.compile import load

        return load(artifact)

    def target(self) -> str:
        """The GPU name and the macOS version (the Metal compiler comes with the OS)."""
        from yirage_backend_mps.compile import target

        self.require_available()
        return target()


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [MPSBackend]
