"""Which OpenCL device runs a program, its context and queue, and the dialect rendered for it.

``device()`` is ``YIRAGE_OPENCL_DEVICE`` or the best device (GPU first). On a CPU device the C-family
renderer gets two CPU-shaped choices (``dialect()``): a GEMV over row-major weights splits K over
work-groups, and, where the device shares host memory, matmuls of at least ``HOST_GEMM_MIN_M`` rows go to the
host's BLAS through torch on the very same memory (as the CUDA backend hands them to cuBLAS), unless
``YIRAGE_OPENCL_HOST_GEMM=0``.

``small_device()``: PoCL's in-thread ``basic`` driver, when the platform exposes it (``POCL_DEVICES="pthread
basic"``; yirage never changes the environment, since PoCL reads it once per process and lists ``basic``
first, which would change what other pyopencl code in the process picks). A launch on the ``pthread``
device costs ~30-50 us to wake its worker threads, on ``basic`` ~5 us, single-threaded; plans whose work
(``plan_work``) is at most ``YIRAGE_OPENCL_SMALL_WORK`` (default ``SMALL_WORK``) are built for it.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from dataclasses import replace
from typing import Any

from yirage.codegen.dialect import Dialect
from yirage.codegen.dialects.opencl import DIALECT
from yirage.compiler.kernel_ir import Attention, Embedding, KernelPlan, Matmul
from yirage.errors import YirageError
from yirage_backend_opencl.platforms import all_devices

HOST_GEMM_MIN_M = 4  # rows from which a CPU device's matmul goes to the host BLAS (a GEMV stays a kernel)
#: work units (elements, or multiply-adds) up to which a plan runs on the in-thread device: PoCL's basic
#: device beat its pthread device up to ~256 K elements of a W2-like pointwise kernel here (2 cores)
SMALL_WORK = 1 << 17
SMALL_DRIVER = "basic-"  # PoCL names its devices "<driver>-<cpu name>"


class DeviceSelectionError(YirageError, ValueError):
    """``YIRAGE_OPENCL_DEVICE`` names no device, or an environment setting is malformed."""


@functools.cache
def device() -> Any:
    """``YIRAGE_OPENCL_DEVICE=platform:device`` (indices), else the best device (GPU first)."""
    cl = importlib.import_module("pyopencl")
    wanted = os.environ.get("YIRAGE_OPENCL_DEVICE", "").strip()
    if not wanted:
        return all_devices()[0][0]
    try:
        p, d = _indices(wanted)
        return cl.get_platforms()[p].get_devices()[d]
    except (ValueError, IndexError) as exc:
        listing = "; ".join(f"{i}:{j} {dev.name.strip()}" for i, pl in enumerate(cl.get_platforms())
                            for j, dev in enumerate(pl.get_devices()))
        raise DeviceSelectionError(
            f"YIRAGE_OPENCL_DEVICE={wanted!r} names no OpenCL device ({exc}); set it to platform:device "
            f"indices, one of: {listing}, or unset it to use the best device") from exc


def _indices(wanted: str) -> tuple[int, int]:
    """``platform:device`` as two indices >= 0; a negative one would pick from the end of Python's list."""
    p, d = (int(x) for x in wanted.split(":"))
    if p < 0 or d < 0:
        raise ValueError("the indices must be >= 0")
    return p, d


def is_host_cpu(dev: Any) -> bool:
    cl = importlib.import_module("pyopencl")
    return bool(dev.type & cl.device_type.CPU)


@functools.cache
def small_device() -> Any | None:
    """PoCL's in-thread device beside ``device()`` on its platform, or None (absent, or the limit is 0)."""
    main = device()
    if small_work() <= 0 or not is_host_cpu(main) or main.name.startswith(SMALL_DRIVER):
        return None
    return next((d for d in main.platform.get_devices() if d.name.startswith(SMALL_DRIVER)), None)


@functools.cache
def small_work() -> int:
    text = os.environ.get("YIRAGE_OPENCL_SMALL_WORK", "").strip()
    if not text:
        return SMALL_WORK
    try:
        return int(text)
    except ValueError as exc:
        raise DeviceSelectionError(
            f"YIRAGE_OPENCL_SMALL_WORK={text!r} is not an integer; set it to the work (elements or multiply-adds) "
            "up to which a plan runs on PoCL's in-thread basic device, 0 to never use it, or unset it") from exc


def plan_work(plan: KernelPlan) -> int:
    """A plan's work in elements touched or multiply-adds: what decides whether a launch's fixed cost dominates."""
    total = 0
    for k in plan.kernels:
        if isinstance(k, Matmul):
            total += max(1, math.prod(k.batch)) * k.m * k.n * k.k
        elif isinstance(k, Attention):
            total += 2 * k.batch * k.heads * k.seq * k.head_dim
        elif isinstance(k, Embedding):
            total += k.tokens * k.dim
        else:
            total += math.prod(k.space)
    return total


def context(dev: Any = None) -> tuple[Any, Any]:
    """One context and in-order queue per process and device (default ``device()``)."""
    return _context(dev if dev is not None else device())


@functools.cache
def _context(dev: Any) -> tuple[Any, Any]:
    cl = importlib.import_module("pyopencl")
    ctx = cl.Context([dev])
    return ctx, cl.CommandQueue(ctx)


def target() -> str:
    dev = device()
    return f"{dev.platform.name.strip()}|{dev.name.strip()}|{dev.driver_version.strip()}"


def host_gemm_enabled() -> bool:
    text = os.environ.get("YIRAGE_OPENCL_HOST_GEMM", "1").strip()
    if text not in ("0", "1"):
        raise DeviceSelectionError(f"YIRAGE_OPENCL_HOST_GEMM={text!r}: set it to 1 (large matmuls on a host CPU "
                                   "device use the host BLAS, the default) or 0 (OpenCL kernels only)")
    return text == "1"


def dialect() -> Dialect:
    """The OpenCL dialect with the CPU-shaped choices when ``device()`` is a CPU (module docstring)."""
    dev = device()
    if not is_host_cpu(dev):
        return DIALECT
    host = bool(dev.host_unified_memory) and host_gemm_enabled()
    return replace(DIALECT, gemv_split_k=True, host_gemm=host, host_gemm_min_m=HOST_GEMM_MIN_M)
