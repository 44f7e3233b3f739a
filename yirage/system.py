"""Facts about the host: CPU model, cores, caches, SIMD width, RAM.

Read from the OS (``/proc``, ``/sys``, ``sysctl``) and psutil, memoized; the
CPU backends and ``yirage_backend_manager info`` describe the host with them.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil

_SIMD_BITS = (("avx512f", 512), ("avx2", 256), ("avx", 256), ("sse2", 128), ("asimd", 128), ("neon", 128))


def cpuinfo_field(name: str) -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


@functools.cache
def cpu_model() -> str:
    return (
        cpuinfo_field("model name")
        or cpuinfo_field("Model")
        or (_sysctl("machdep.cpu.brand_string") if platform.system() == "Darwin" else None)
        or platform.processor()
        or platform.machine()
    )


@functools.cache
def cpu_flags() -> frozenset[str]:
    flags = cpuinfo_field("flags") or cpuinfo_field("Features") or ""
    return frozenset(flags.split())


def simd_bits() -> int | None:
    flags = cpu_flags()
    for flag, bits in _SIMD_BITS:
        if flag in flags:
            return bits
    if platform.machine() in {"arm64", "aarch64"}:
        return 128  # every AArch64 core has 128-bit NEON
    return None


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


@functools.cache
def cpu_caches() -> dict[str, int]:
    """Per-core (L1, L2) or shared (L3) cache sizes in bytes, e.g. {'L1d': 49152}."""
    caches: dict[str, int] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[f"L{level}{suffix}"] = size
    if not caches and platform.system() == "Darwin":
        for key, name in (("hw.l1dcachesize", "L1d"), ("hw.l2cachesize", "L2"), ("hw.l3cachesize", "L3")):
            value = _sysctl(key)
            if value and value.isdigit() and int(value) > 0:
                caches[name] = int(value)
    return caches


def usable_cores() -> int:
    """Logical CPUs this process may run on (affinity, cgroup-pinned sets)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def host_facts() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "usable_cores": usable_cores(),
        "simd_bits": simd_bits(),
        "caches": cpu_caches(),
        "ram_total": vm.total,
        "ram_available": vm.available,
    }
