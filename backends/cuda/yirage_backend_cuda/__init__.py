"""The CUDA backend, for NVIDIA GPUs only.

MetaX, Iluvatar and Hygon stacks answer ``torch.cuda.is_available()`` too;
this backend claims a device only when its name is NVIDIA's and torch is a
CUDA (not a ROCm/HIP) build, so those devices go to their own backends.
"""

from __future__ import annotations

import re
from pathlib import Path

import yirage
from yirage.backend.probes import TorchCudaFacts, TorchDevice, torch_cuda_facts, torch_cuda_memory

YIRAGE_PLUGIN_API = 1

NVIDIA_NAME = re.compile(r"\b(nvidia|geforce|tesla|quadro|titan|rtx|gtx|jetson|grace)\b", re.IGNORECASE)


def nvidia_driver_loaded() -> bool:
    """The NVIDIA kernel driver announces itself here (Linux)."""
    return Path("/proc/driver/nvidia/version").exists()


def nvidia_devices(facts: TorchCudaFacts) -> list[TorchDevice]:
    """Devices with positive NVIDIA evidence: the NVIDIA driver, or an NVIDIA brand name."""
    if facts.hip_version or not facts.cuda_version:
        return []
    if nvidia_driver_loaded():
        return list(facts.devices)
    return [d for d in facts.devices if NVIDIA_NAME.search(d.name)]


class CUDABackend(yirage.Backend):
    name = "cuda"
    priority = 100
    vendor = "NVIDIA"
    torch_device = "cuda"
    device_kind = "gpu"
    description = "CUDA C kernels (NVRTC/nvcc) on NVIDIA GPUs"

    def probe(self) -> yirage.Availability:
        facts = torch_cuda_facts()
        if facts.error and not facts.torch_version:
            return yirage.Availability(False, facts.error)
        if facts.hip_version:
            return yirage.Availability(
                False,
                f"torch {facts.torch_version} is a ROCm/HIP build (HIP {facts.hip_version}), not CUDA; "
                "its devices are AMD or Hygon DCU, not NVIDIA",
            )
        if not facts.cuda_version:
            driver = "an NVIDIA driver is loaded" if nvidia_driver_loaded() else "no NVIDIA driver is loaded"
            return yirage.Availability(
                False,
                f"torch {facts.torch_version} is a CPU-only build (torch.version.cuda is None) and {driver}; "
                "install a CUDA build of torch on a machine with an NVIDIA GPU",
            )
        if not facts.devices:
            extra = f": {facts.error}" if facts.error else ""
            return yirage.Availability(
                False, f"torch {facts.torch_version} (CUDA {facts.cuda_version}) sees no CUDA device{extra}"
            )
        found = nvidia_devices(facts)
        if not found:
            names = ", ".join(repr(d.name) for d in facts.devices)
            return yirage.Availability(
                False,
                f"torch.cuda devices ({names}) are not recognisably NVIDIA GPUs: no NVIDIA driver is loaded "
                "(/proc/driver/nvidia is missing) and the names carry no NVIDIA brand; CUDA-compatible stacks "
                "of other vendors (MetaX, Iluvatar) look like this: use that vendor's backend",
            )
        best = found[0]
        cap = f" (sm_{best.capability[0]}{best.capability[1]})" if best.capability else ""
        return yirage.Availability(True, f"{best.name}{cap}, CUDA {facts.cuda_version}, {len(found)} device(s)")

    def _devices(self) -> list[TorchDevice]:
        self.require_available()
        return nvidia_devices(torch_cuda_facts())

    def device_count(self) -> int:
        return len(self._devices()) if self.availability().ok else 0

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        device = self._devices()[index]
        return yirage.DeviceInfo(
            name=device.name,
            vendor="NVIDIA",
            kind="gpu",
            compute_units=device.multi_processor_count,
            memory_bytes=device.total_memory,
            simd_width=32,
            extra={"compute_capability": device.capability, "torch_index": device.index},
        )

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        return torch_cuda_memory(self._devices()[index].index)


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [CUDABackend]
