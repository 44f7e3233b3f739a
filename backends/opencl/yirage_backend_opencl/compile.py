"""The OpenCL stages: render a plan as OpenCL C, write it, build it with pyopencl and launch it.

``render`` prefixes the source with its launch header (``yirage.codegen.launch``:
buffers, kernels in order, scratch, status checks, and the plan's ``work``), so
the cache entry alone is enough to load: ``load`` builds the program once per
process (``Artifact.load_once``) and keeps one ``cl.Kernel`` per launch
(re-creating one costs ~250 us). A call wraps its input and output torch CPU
tensors in ``cl.Buffer`` objects (~1-2 us each): on a device that shares host
memory (PoCL) with ``USE_HOST_PTR``, so no per-call copy is made, otherwise with a
copy in and a read back; float16 and bfloat16 tensors are passed as they are
(the kernels convert). Temporaries and scratch buffers are the program's,
allocated once; the torch tensors of a call stay referenced until its one
wait; outputs are synchronized by mapping them (a no-op copy when the device
uses the host pointer). A call not known to be short (<= ``SLICED_AFTER``) is
waited for in short Python sleeps, so Ctrl-C interrupts it (``finish()``
blocks in C); its tensors stay referenced until the queue drains. A ``Gemm``
step (a large matmul on a CPU device that shares host memory: ``devices``)
waits for the kernels before it by mapping its buffers and runs torch's BLAS
on them; that matmul, like any torch op, finishes before Ctrl-C is seen. The
device a program runs on (``devices.small_device()`` for small plans) is
chosen when it is loaded.
"""

from __future__ import annotations

import importlib
import math
import threading
import time
from pathlib import Path
from typing import Any

from yirage.backend.gemm_steps import run_gemm
from yirage.codegen.cstyle import render
from yirage.codegen.launch import C_COMMENT, Check, Gemm, Launch, LaunchHeader
from yirage.compiler.cache import write_private
from yirage.compiler.kernel_ir import KernelPlan
from yirage.compiler.stages import Artifact
from yirage.errors import BackendError
from yirage_backend_opencl import fork
from yirage_backend_opencl.devices import (
    DeviceSelectionError,
    context,
    device,
    dialect,
    plan_work,
    small_device,
    small_work,
    target,
)

SOURCE_NAME = "kernels.cl"
BUILD_OPTIONS = ["-cl-std=CL1.2"]  # no -cl-fast-relaxed-math, no -cl-mad-enable: IEEE results
SLICED_AFTER = 0.05  # seconds: calls that took longer last time are waited for interruptibly
WAIT_SLICE = 0.002  # seconds between status checks of such a call (at most ~4% of its time)


class OpenCLBuildError(BackendError, RuntimeError):
    """The OpenCL compiler rejected a rendered plan: a renderer bug, not a user error."""


class OpenCLLaunchError(BackendError, RuntimeError):
    """The OpenCL device refused to launch a kernel (e.g. a work-group wider than that kernel allows)."""


def render_source(plan: KernelPlan) -> str:
    """Stage 1: the OpenCL C of ``plan`` (in ``dialect()``) behind its launch header (with the plan's work)."""
    rendered = render(plan, dialect())
    header = LaunchHeader.of(plan, rendered.launches, rendered.scratch, rendered.steps, work=plan_work(plan))
    return header.write(rendered.source, C_COMMENT)


def build(source: str, workdir: Path) -> Path:
    """Stage 2: write the source (PoCL keeps its own cache of the compiled binaries)."""
    path = workdir / SOURCE_NAME
    write_private(path, source)
    return path


def load(artifact: Artifact) -> OpenCLProgram:
    """Stage 3: build the program on the selected device (once per process and entry) with its kernels."""
    return artifact.load_once(lambda: OpenCLProgram(artifact.path.read_text(encoding="utf-8"), str(artifact.path)))


class OpenCLProgram:
    """``run(inputs) -> outputs`` over a built program; one launch sequence and one wait per call.

    Temporaries and scratch buffers live as long as the program (scratch is zero-filled on the queue before
    each call); outputs are new tensors each call. A call that has run for more than ``SLICED_AFTER`` seconds before is
    waited for in ``WAIT_SLICE`` slices from Python, so Ctrl-C interrupts it: the interrupted call's tensors
    stay referenced until the queue drains (the next call waits for that first).
    """

    def __init__(self, source: str, where: str) -> None:
        import torch

        cl = importlib.import_module("pyopencl")
        self.cl = cl
        meta = LaunchHeader.read(source, where, C_COMMENT)
        self.inputs = list(meta.inputs)
        self.buffers = list(meta.buffers)
        self.outputs = list(meta.outputs)
        self.launches: list[Launch] = list(meta.launches)  # a C header holds Launch records
        self.steps: list[Launch | Gemm] = list(meta.steps)
        work = meta.extra.get("work")
        if type(work) is not int:
            raise OpenCLBuildError(f"the launch header of {where} has no integer work: it was not rendered by the "
                                   "opencl backend; delete its cache entry so it is rendered again")
        self.scratch = list(meta.scratch)
        small = small_device()
        self.device = small if small is not None and work <= small_work() else device()
        self.ctx, self.queue = context(self.device)
        try:
            program = cl.Program(self.ctx, source).build(options=BUILD_OPTIONS)
        except cl.RuntimeError as exc:
            raise OpenCLBuildError(
                f"the OpenCL compiler rejected the kernels rendered in {where}: {exc}. This is a bug in yirage's "
                "C-family renderer or the device's compiler; report it with the graph (g.to_json())") from exc
        self.kernels = {x.kernel: getattr(program, x.kernel) for x in self.launches}
        self.zero_copy = bool(self.device.host_unified_memory)
        self.lock = threading.Lock()  # cl.Kernel arguments, temporaries and scratch are per-program state
        self.new_outputs = [(n, dims, getattr(torch, d)) for n, dims, d, role in self.buffers if role == "output"]
        # temporaries are kept at compute type; they and the scratch buffers are allocated once
        owned = {n: torch.empty(max(1, math.prod(dims)), dtype=getattr(torch, compute_type_name(d)))
                 for n, dims, d, role in self.buffers if role != "output"}
        owned.update({s.name: torch.zeros(s.count, dtype=getattr(torch, s.dtype)) for s in self.scratch})
        self.owned = owned
        self.owned_bufs = {name: self._buffer(t) for name, t in owned.items()}
        self.scratch_zeros = [(s.name, owned[s.name][:1].numpy() * 0) for s in self.scratch]
        self.synced = list(dict.fromkeys(self.outputs + [x.check.status for x in self.launches if x.check]))
        self.last_seconds = math.inf  # how long the previous call took: picks the waiting strategy
        self.pending: tuple[Any, ...] = ()  # an interrupted call's tensors and buffers, until the queue drains

    def _buffer(self, t: Any) -> tuple[Any, Any]:
        """A cl.Buffer over the storage span of CPU tensor ``t`` (checked by the core before the call)."""
        import torch

        cl = self.cl
        if t.is_contiguous():
            flat = t  # numpy shares an N-d contiguous array as well as a flat one
        else:
            extent = 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True) if d > 1)
            flat = torch.as_strided(t, (extent,), (1,))
        flat = (flat.view(torch.int16) if flat.dtype in (torch.float16, torch.bfloat16) else flat).numpy()
        mf = cl.mem_flags
        flags = mf.READ_WRITE | (mf.USE_HOST_PTR if self.zero_copy else mf.COPY_HOST_PTR)
        return cl.Buffer(self.ctx, flags, hostbuf=flat), flat

    def __call__(self, inputs: Any) -> list[Any]:
        import torch

        fork.check()  # a program built before fork() would block forever in the child's enqueue
        tensors: dict[str, Any] = {}
        with self.lock:
            if self.pending:  # an interrupted call may still run on the device: it uses our scratch
                self.queue.finish()
                self.pending = ()
            bufs = dict(self.owned_bufs)
            for name, index, _ in self.inputs:
                tensors[name] = t = inputs[index]  # float16/bfloat16 too: kernels widen them as they load
                bufs[name] = self._buffer(t)
            for name, dims, dtype in self.new_outputs:
                tensors[name] = t = torch.empty(dims, dtype=dtype)
                bufs[name] = self._buffer(t)
            try:
                self._launch(bufs)
            except BaseException:
                self.pending = (tensors, bufs)  # KeyboardInterrupt included: the device may still use them
                raise
            tensors.update(self.owned)
            for launch in self.launches:  # under the lock: the status scratch is the next call's too
                if launch.check is not None:
                    self._raise_if_bad(launch.check, tensors, inputs)
        return [tensors[name] for name in self.outputs]

    def _launch(self, bufs: dict[str, tuple[Any, Any]]) -> None:
        cl, queue = self.cl, self.queue
        start = time.perf_counter()
        for name, zero in self.scratch_zeros:  # on the queue: the device may keep its own copy of a buffer
            cl.enqueue_fill_buffer(queue, bufs[name][0], zero, 0, bufs[name][1].nbytes)
        for step in self.steps:
            if isinstance(step, Gemm):
                self._gemm(step, bufs)
                continue
            kernel = self.kernels[step.kernel]
            kernel.set_args(*[bufs[a][0] for a in step.args])
            try:
                cl.enqueue_nd_range_kernel(queue, kernel, (step.global_size,), (step.local,))
            except cl.Error as exc:
                raise OpenCLLaunchError(
                    f"the OpenCL device refused kernel {step.kernel} with {step.global_size} work-items in groups of "
                    f"{step.local} ({type(exc).__name__}: {exc}); a work-group size chosen by g.superoptimize() that "
                    "this kernel cannot take is rejected by the search; otherwise report it with the graph "
                    "(g.to_json())") from exc
        maps = []
        for name in self.synced:
            buf, flat = bufs[name]
            if self.zero_copy:
                mapped = cl.enqueue_map_buffer(queue, buf, cl.map_flags.READ, 0, flat.shape, flat.dtype,
                                               is_blocking=False)[0]
                maps.append((mapped, flat))
            else:
                cl.enqueue_copy(queue, flat, buf, is_blocking=False)
        if self.last_seconds > SLICED_AFTER:
            self._wait_interruptibly()
        queue.finish()
        self.last_seconds = time.perf_counter() - start
        for mapped, flat in maps:
            if mapped.ctypes.data != flat.ctypes.data:  # the driver kept its own copy after all
                flat[...] = mapped
            mapped.base.release(queue)

    def _gemm(self, step: Gemm, bufs: dict[str, tuple[Any, Any]]) -> None:
        """The host's BLAS (torch) on mapped buffers: no copy where the device uses the host pointers (PoCL).

        The blocking maps wait for the kernels before it; unmapping hands the product back to the device.
        """
        import torch

        cl, mf = self.cl, self.cl.map_flags
        maps: dict[str, Any] = {}
        try:
            for name in dict.fromkeys((step.a, step.b, step.out)):
                _, flat = bufs[name]
                flags = mf.WRITE_INVALIDATE_REGION if name not in (step.a, step.b) else mf.READ | mf.WRITE
                maps[name] = cl.enqueue_map_buffer(self.queue, bufs[name][0], flags, 0, flat.shape, flat.dtype,
                                                   is_blocking=True)[0]
            run_gemm(step, {name: torch.from_numpy(m) for name, m in maps.items()})
        finally:
            for m in maps.values():
                m.base.release(self.queue)

    def _wait_interruptibly(self) -> None:
        """Wait for the queue in short Python-level sleeps (``finish()`` blocks in C, deaf to Ctrl-C)."""
        cl, queue = self.cl, self.queue
        marker = cl.enqueue_marker(queue)
        queue.flush()
        while marker.command_execution_status > 0:  # 0 = complete, < 0 = failed (finish() then raises)
            time.sleep(WAIT_SLICE)

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


__all__ = ["DeviceSelectionError", "OpenCLBuildError", "OpenCLProgram", "build", "context", "device", "load",
           "render_source", "target"]
