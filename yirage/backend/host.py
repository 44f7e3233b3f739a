"""DeviceInfo and MemoryInfo of the host CPU, for backends that run on it."""

from __future__ import annotations

import psutil

from yirage import system
from yirage.backend.base import DeviceInfo, MemoryInfo


def host_device_info(**extra: object) -> DeviceInfo:
    bits = system.simd_bits()
    return DeviceInfo(
        name=system.cpu_model(),
        vendor=(system.cpuinfo_field("vendor_id") or "unknown"),
        kind="cpu",
        compute_units=psutil.cpu_count(logical=False) or system.usable_cores(),
        memory_bytes=psutil.virtual_memory().total,
        simd_width=bits // 32 if bits else None,
        caches=dict(system.cpu_caches()),
        extra={"logical_cores": psutil.cpu_count(logical=True), "usable_cores": system.usable_cores(), **extra},
    )


def host_memory_info() -> MemoryInfo:
    vm = psutil.virtual_memory()
    return MemoryInfo(total=vm.total, used=vm.total - vm.available, free=vm.available, source="psutil")
