"""The OpenCL backend: OpenCL C through pyopencl, on any ICD (PoCL included).

``set_backend('auto')`` passes over it when its best device is the host CPU
(PoCL's pthread device): the cpu backend is the better choice there.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yirage
from yirage.backend.host import host_memory_info
from yirage.backend.probes import distribution_version, module_installed
from yirage.backend.runtime_contract import LAUNCHED, PersistentRuntime
from yirage_backend_opencl import fork
from yirage_backend_opencl.platforms import all_devices as _devices
from yirage_backend_opencl.platforms import type_name as _type_name

YIRAGE_PLUGIN_API = 1


class OpenCLBackend(yirage.Backend):
    name = "opencl"
    priority = 50
    vendor = "Khronos OpenCL"
    torch_device = "cpu"
    description = "OpenCL C kernels through pyopencl; runs on PoCL, GPU and accelerator ICDs"

    @property
    def device_kind(self) -> str:  # type: ignore[override]
        if not self.availability().ok:
            return "gpu"
        cl = importlib.import_module("pyopencl")
        return "cpu" if _type_name(cl, _devices()[0][0]) == "CPU" else "gpu"

    def probe(self) -> yirage.Availability:
        if not module_installed("pyopencl"):
            return yirage.Availability(False, "pyopencl is not installed: pip install 'yirage-backend-opencl[pocl]'")
        try:
            cl = importlib.import_module("pyopencl")
        except ImportError as exc:
            return yirage.Availability(False, f"pyopencl is installed but does not import: {exc}")
        devices, why = _devices()
        if not devices:
            return yirage.Availability(False, why)
        best = devices[0]
        kind = _type_name(cl, best)
        where = f"{best.name.strip()} ({kind}, {best.platform.name.strip()})"
        if kind == "CPU":
            return yirage.Availability(
                True,
                f"only a host-CPU OpenCL device: {where}; auto prefers the cpu backend there",
                auto=False,
            )
        return yirage.Availability(True, f"OpenCL device {where}")

    def forget_probe(self) -> None:
        super().forget_probe()
        _devices.cache_clear()

    def device_count(self) -> int:
        return len(_devices()[0]) if self.availability().ok else 0

    def _device(self, index: int) -> Any:
        self.require_available()
        devices = _devices()[0]
        if not 0 <= index < len(devices):
            raise IndexError(f"OpenCL device index {index} is out of range: there are {len(devices)} device(s)")
        return devices[index]

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        cl = importlib.import_module("pyopencl")
        device = self._device(index)
        kind = _type_name(cl, device)
        return yirage.DeviceInfo(
            name=device.name.strip(),
            vendor=device.vendor.strip(),
            kind={"GPU": "gpu", "CPU": "cpu"}.get(kind, "accelerator"),
            compute_units=device.max_compute_units,
            memory_bytes=device.global_mem_size,
            simd_width=device.preferred_vector_width_float,
            caches={"local_mem": device.local_mem_size, "global_mem_cache": device.global_mem_cache_size},
            extra={
                "platform": device.platform.name.strip(),
                "opencl_version": device.version.strip(),
                "driver_version": device.driver_version.strip(),
                "max_work_group_size": device.max_work_group_size,
                "fp16": "cl_khr_fp16" in device.extensions,
                "fp64": "cl_khr_fp64" in device.extensions,
                "pyopencl": distribution_version("pyopencl"),
            },
        )

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        cl = importlib.import_module("pyopencl")
        device = self._device(index)
        if _type_name(cl, device) == "CPU":
            # PoCL's global memory is a cap on host RAM: what is free is what the host has free
            total = device.global_mem_size
            free = min(host_memory_info().free or 0, total)
            return yirage.MemoryInfo(total, total - free, free, "CL_DEVICE_GLOBAL_MEM_SIZE capped by host RAM (psutil)")
        # core OpenCL has no query for free device memory
        return yirage.MemoryInfo(device.global_mem_size, None, None, "CL_DEVICE_GLOBAL_MEM_SIZE")

    # -- compile stages (yirage_backend_opencl.compile), cached by the core's compile_cached --
    kernel_dtypes = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64"})

    def schedule_knobs(self, plan: Any) -> list[Any]:
        """The C-family renderer's knobs (row work-group sizes up to the largest work-group of the devices a plan
        may run on; a kernel that takes fewer fails its launch with OpenCLLaunchError, which the search rejects)."""
        from yirage.codegen.cstyle import schedule_knobs
        from yirage_backend_opencl.compile import dialect
        from yirage_backend_opencl.devices import device, small_device

        widest = min(int(dev.max_work_group_size) for dev in (device(), small_device()) if dev is not None)
        return schedule_knobs(plan, dialect(), widest)

    def render(self, plan: Any) -> str:
        fork.check()
        from yirage_backend_opencl.compile import render_source

        return render_source(plan)

    def build(self, source: str, workdir: Path) -> Path:
        fork.check()
        from yirage_backend_opencl.compile import build

        return build(source, workdir)

    def load(self, artifact: Any) -> Any:
        fork.check()
        from yirage_backend_opencl.compile import load

        return load(artifact)

    def target(self) -> str:
        """The device (platform, name, driver) the program is built for."""
        from yirage_backend_opencl.compile import target

        fork.check()
        return target()

    persistent_kind = LAUNCHED  # one in-order queue per step (pk_runtime: why not a persistent kernel)

    def persistent_runtime(self, program: Any, config: Any) -> PersistentRuntime:
        """One decode step as enqueued kernels on the selected device (why not a persistent kernel: pk_runtime)."""
        from yirage_backend_opencl.pk_runtime import OpenCLPersistentRuntime

        fork.check()
        return OpenCLPersistentRuntime(program, config)

    def check_process(self) -> None:
        """OpenCL runtimes do not survive fork(): refuse in a child forked after OpenCL was loaded (fork.py)."""
        fork.check()


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [OpenCLBackend]
