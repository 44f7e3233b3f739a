"""The OpenCL stages: render a plan as OpenCL C, write it, build it with pyopencl and launch it.

``render`` prefixes the source with one comment line of JSON that says how to
launch it (buffers, kernels in order, scratch, status checks), so the cache
entry alone is enough to load: ``load`` builds the program once and keeps one
``cl.Kernel`` per launch (re-creating one costs ~250 us). A call wraps every
torch CPU tensor in a ``cl.Buffer``: on a device that shares host memory
(PoCL) with ``USE_HOST_PTR``, so no per-call copy is made, otherwise with a
copy in and a read back; float16 and bfloat16 tensors are passed as they are
(the kernels convert). The torch tensors stay referenced until the call's
one ``finish()``; outputs are synchronized by mapping them (a no-op copy when
the device uses the host pointer).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from yirage.codegen.cstyle import Check, Launch, Scratch, render
from yirage.codegen.dialects.opencl import DIALECT
from yirage.compiler.cache import write_private
from yirage.compiler.kernel_ir import KernelPlan
from yirage.compiler.stages import Artifact
from yirage.errors import BackendError, YirageError

SOURCE_NAME = "kernels.cl"
META_PREFIX = "// yirage-launch: "
BUILD_OPTIONS = ["-cl-std=CL1.2"]  # no -cl-fast-relaxed-math, no -cl-mad-enable: IEEE results


class DeviceSelectionError(YirageError, ValueError):
    """``YIRAGE_OPENCL_DEVICE`` names no device."""


class OpenCLBuildError(BackendError, RuntimeError):
    """The OpenCL compiler rejected a rendered plan: a renderer bug, not a user error."""


@functools.cache
def device() -> Any:
    """``YIRAGE_OPENCL_DEVICE=platform:device`` (indices), else the best device (GPU first)."""
    from yirage_backend_opencl import _devices

    cl = importlib.import_module("pyopencl")
    wanted = os.environ.get("YIRAGE_OPENCL_DEVICE", "").strip()
    if not wanted:
        return _devices()[0][0]
    try:
        p, d = (int(x) for x in wanted.split(":"))
        return cl.get_platforms()[p].get_devices()[d]
    except (ValueError, IndexError) as exc:
        listing = "; ".join(f"{i}:{j} {dev.name.strip()}" for i, pl in enumerate(cl.get_platforms())
                            for j, dev in enumerate(pl.get_devices()))
        raise DeviceSelectionError(
            f"YIRAGE_OPENCL_DEVICE={wanted!r} names no OpenCL device ({exc}); set it to platform:device "
            f"indices, one of: {listing}, or unset it to use the best device") from exc


@functools.cache
def context() -> tuple[Any, Any]:
    """One context and in-order queue per process, on ``device()``."""
    cl = importlib.import_module("pyopencl")
    ctx = cl.Context([device()])
    return ctx, cl.CommandQueue(ctx)


def target() -> str:
    dev = device()
    return f"{dev.platform.name.strip()}|{dev.name.strip()}|{dev.driver_version.strip()}"


def render_source(plan: KernelPlan) -> str:
    """Stage 1: the OpenCL C of ``plan`` behind one JSON comment line describing its launch."""
    rendered = render(plan, DIALECT)
    meta = {
        "inputs": [[n, plan.buffers[n].index, plan.buffers[n].dtype.name] for n in plan.inputs],
        "buffers": [[b.name, list(b.dims), b.dtype.name, b.role] for b in plan.buffers.values() if b.role != "input"],
        "outputs": plan.outputs,
        "launches": [asdict(x) for x in rendered.launches],
        "scratch": [asdict(s) for s in rendered.scratch],
    }
    return META_PREFIX + json.dumps(meta, separators=(",", ":")) + "\n" + rendered.source


def build(source: str, workdir: Path) -> Path:
    """Stage 2: write the source (PoCL keeps its own cache of the compiled binaries)."""
    path = workdir / SOURCE_NAME
    write_private(path, source)
    return path


_PROGRAMS: dict[str, OpenCLProgram] = {}  # cache key -> built program: one build per process and plan
_PROGRAMS_LOCK = threading.Lock()


def load(artifact: Artifact) -> OpenCLProgram:
    """Stage 3: build the program on the selected device (once per process and entry) with its kernels."""
    with _PROGRAMS_LOCK:
        program = _PROGRAMS.get(artifact.key)
        if program is None or artifact.rebuilt:
            program = OpenCLProgram(artifact.path.read_text(encoding="utf-8"), str(artifact.path))
            _PROGRAMS[artifact.key] = program
        return program


class OpenCLProgram:
    """``run(inputs) -> outputs`` over a built program; one launch sequence and one finish per call."""

    def __init__(self, source: str, where: str) -> None:
        cl = importlib.import_module("pyopencl")
        self.cl = cl
        header, _, _ = source.partition("\n")
        meta = json.loads(header.removeprefix(META_PREFIX))
        self.inputs = [(n, i, d) for n, i, d in meta["inputs"]]
        self.buffers = [(n, tuple(dims), d, role) for n, dims, d, role in meta["buffers"]]
        self.outputs = meta["outputs"]
        self.launches = [Launch(**{**x, "check": Check(**x["check"]) if x["check"] else None})
                         for x in meta["launches"]]
        self.scratch = [Scratch(**s) for s in meta["scratch"]]
        self.ctx, self.queue = context()
        try:
            program = cl.Program(self.ctx, source).build(options=BUILD_OPTIONS)
        except cl.RuntimeError as exc:
            raise OpenCLBuildError(
                f"the OpenCL compiler rejected the kernels rendered in {where}: {exc}. This is a bug in yirage's "
                "C-family renderer or the device's compiler; report it with the graph (g.to_json())") from exc
        self.kernels = [getattr(program, x.kernel) for x in self.launches]
        self.zero_copy = bool(device().host_unified_memory)
        self.lock = threading.Lock()  # cl.Kernel arguments are per-object state

    def _buffer(self, t: Any) -> Any:
        """A cl.Buffer over the storage span of CPU tensor ``t`` (checked by the core before the call)."""
        import torch

        cl = self.cl
        extent = 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True) if d > 1)
        flat = torch.as_strided(t, (extent,), (1,))
        flat = (flat.view(torch.int16) if flat.dtype in (torch.float16, torch.bfloat16) else flat).numpy()
        mf = cl.mem_flags
        flags = mf.READ_WRITE | (mf.USE_HOST_PTR if self.zero_copy else mf.COPY_HOST_PTR)
        return cl.Buffer(self.ctx, flags, hostbuf=flat), flat

    def __call__(self, inputs: Any) -> list[Any]:
        import torch

        cl = self.cl
        tensors: dict[str, Any] = {}
        for name, index, _ in self.inputs:
            tensors[name] = inputs[index]  # float16/bfloat16 too: kernels widen them as they load
        for name, dims, dtype, role in self.buffers:
            if role == "output":
                tensors[name] = torch.empty(dims, dtype=getattr(torch, dtype))
            else:  # temporaries are kept at compute type
                tensors[name] = torch.empty(max(1, math.prod(dims)), dtype=getattr(torch, compute_type_name(dtype)))
        for s in self.scratch:
            tensors[s.name] = torch.zeros(s.count, dtype=getattr(torch, s.dtype))
        with self.lock:
            bufs = {name: self._buffer(t) for name, t in tensors.items()}
            for kernel, launch in zip(self.kernels, self.launches, strict=True):
                kernel.set_args(*[bufs[a][0] for a in launch.args])
                cl.enqueue_nd_range_kernel(self.queue, kernel, (launch.global_size,), (launch.local,))
            synced = list(dict.fromkeys(self.outputs + [x.check.status for x in self.launches if x.check]))
            maps = []
            for name in synced:
                buf, flat = bufs[name]
                if self.zero_copy:
                    mapped = cl.enqueue_map_buffer(self.queue, buf, cl.map_flags.READ, 0, flat.shape,
                                                   flat.dtype, is_blocking=False)[0]
                    maps.append((mapped, flat))
                else:
                    cl.enqueue_copy(self.queue, flat, buf, is_blocking=False)
            self.queue.finish()
            for mapped, flat in maps:
                if mapped.ctypes.data != flat.ctypes.data:  # the driver kept its own copy after all
                    flat[...] = mapped
                mapped.base.release(self.queue)
        for launch in self.launches:
            if launch.check is not None:
                self._raise_if_bad(launch.check, tensors, inputs)
        return [tensors[name] for name in self.outputs]

    def _raise_if_bad(self, check: Check, tensors: dict[str, Any], inputs: Any) -> None:
        status = int(tensors[check.status][0])
        if not status:
            return
        pos = status - 1
        value = ""
        if check.value_of:
            value = str(int(tensors[check.value_of].reshape(-1)[pos]))
        error = IndexError if check.error == "IndexError" else ValueError
        raise error(check.message.format(pos=pos, value=value))


def compute_type_name(dtype: str) -> str:
    return "float32" if dtype in ("float16", "bfloat16") else dtype


__all__ = ["OpenCLBuildError", "OpenCLProgram", "build", "context", "device", "load",
           "render_source", "target"]
