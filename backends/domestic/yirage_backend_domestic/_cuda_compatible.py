"""Shared probe for accelerators that present themselves through ``torch.cuda`` (MetaX, Iluvatar, Hygon)."""

from __future__ import annotations

import re
from typing import ClassVar

import yirage
from yirage.backend.probes import TorchCudaFacts, TorchDevice, torch_cuda_facts, torch_cuda_memory
from yirage_backend_domestic._kernels import DomesticKernels


class CudaCompatibleBackend(DomesticKernels):
    """A vendor whose devices torch lists under ``torch.cuda``, told apart by name; kernels: see ``_kernels``."""

    torch_device = "cuda"
    device_kind = "gpu"
    device_name: ClassVar[re.Pattern[str]] = re.compile(r"(?!)")
    needs_hip: ClassVar[bool] = False  # Hygon DCU builds are ROCm/HIP builds
    stack: ClassVar[str] = ""

    def matching(self, facts: TorchCudaFacts) -> list[TorchDevice]:
        if self.needs_hip and not facts.hip_version:
            return []
        return [d for d in facts.devices if self.device_name.search(d.name)]

    def probe(self) -> yirage.Availability:
        facts = torch_cuda_facts()
        if not facts.torch_version:
            return yirage.Availability(False, facts.error or "torch is not installed")
        found = self.matching(facts)
        if found:
            note = self.kernels_note(self.settle_path())
            return yirage.Availability(True, f"{found[0].name} ({len(found)} device(s)) via torch.cuda; {note}")
        if not facts.devices:
            if facts.hip_version:
                build = f"built for HIP {facts.hip_version}"
            elif facts.cuda_version:
                build = f"built for CUDA {facts.cuda_version}"
            else:
                build = "a CPU-only build"
            return yirage.Availability(
                False,
                f"no {self.vendor} device: torch {facts.torch_version} ({build}) sees no device; needs {self.stack}",
            )
        names = ", ".join(repr(d.name) for d in facts.devices)
        return yirage.Availability(False, f"torch.cuda devices ({names}) are not {self.vendor} devices")

    def present(self) -> str:
        return f"{self.vendor}'s torch build sees the device"

    def _devices(self) -> list[TorchDevice]:
        self.require_available()
        return self.matching(torch_cuda_facts())

    def device_count(self) -> int:
        return len(self._devices()) if self.availability().ok else 0

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        device = self._devices()[index]
        return yirage.DeviceInfo(
            name=device.name,
            vendor=self.vendor,
            kind="gpu",
            compute_units=device.multi_processor_count,
            memory_bytes=device.total_memory,
            simd_width=64 if self.needs_hip else 32,
            extra={"torch_index": device.index},
        )

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        return torch_cuda_memory(self._devices()[index].index)
