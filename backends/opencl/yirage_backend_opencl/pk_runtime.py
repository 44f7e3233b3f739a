"""The OpenCL PersistentKernel runtime: each decode step as enqueued kernels, one small read per step.

Why enqueued kernels and not one persistent kernel with atomics: OpenCL
(1.2 to 3.0) gives no forward-progress guarantee between the work-groups of
one launch. PoCL's CPU device runs a launch's work-groups on a pool of
threads, a GPU runs as many as fit; a persistent kernel whose work-groups
spin on atomics until other groups finish hangs whenever the device holds
fewer groups at once than were launched, and the API cannot tell how many
that is. An in-order queue gives the task graph's order instead: layers run
in index order and each layer reads only earlier layers' outputs. The
kernels come from the core's C-family PersistentKernel renderer
(``yirage.persistent.cstyle``); this module only places buffers and enqueues.

Memory: on a device that shares host memory (PoCL) every buffer wraps the
torch tensor itself (``USE_HOST_PTR``): tokens, step, KV caches and logits are
the caller's memory, nothing is copied. Elsewhere the buffers are device
copies: weights are uploaded once when the kernel is compiled (later
in-place edits of weights are not seen), tokens, step and the KV caches are
uploaded before and read back after every call, other tensors on ``value()``.

A call waits for each step's control read, so Ctrl-C lands between steps:
the step in flight completes (its token is committed) before
KeyboardInterrupt propagates.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from yirage.backend.runtime_contract import LAUNCHED
from yirage.codegen.dialects.opencl import DIALECT
from yirage.compiler.loaded import load_once
from yirage.compiler.stages import cache_key
from yirage.errors import NotSupportedError
from yirage.persistent import cstyle, shutdown
from yirage.persistent.control import Ctl
from yirage.persistent.cstyle import (
    CTL,
    GROUP,
    SCORES,
    STEP,
    XS,
    PKLaunch,
    render_persistent,
    tensor_name,
)
from yirage.persistent.guard import Snapshot, check_tensor, token_out_of_range
from yirage.persistent.program import PersistentProgram
from yirage.persistent.runtime import register_task_bodies
from yirage_backend_opencl import fork
from yirage_backend_opencl.compile import BUILD_OPTIONS, OpenCLBuildError
from yirage_backend_opencl.devices import context, device

LANES = 8  # partial sums per GEMV column on CPU devices (8 measured faster than 16 on PoCL, AVX-512)


def _built(cl: Any, ctx: Any, source: str) -> Any:
    """The cl.Program of ``source`` on ``ctx``: built once per process and rendering (``load_once``)."""

    def build() -> Any:
        try:
            return cl.Program(ctx, source).build(options=BUILD_OPTIONS)
        except cl.RuntimeError as exc:
            raise OpenCLBuildError(
                f"the OpenCL compiler rejected the PersistentKernel source: {exc}. This is a bug in "
                "yirage.persistent.cstyle or the device's compiler; report it with the model's config") from exc

    return load_once(cache_key(source, f"{__name__} {' '.join(BUILD_OPTIONS)}", ""), build, scope=ctx)


def _group(dev: Any) -> int:
    """The reducing kernels' work-group size: GROUP, or the largest power of two the device allows."""
    limit = min(GROUP, int(dev.max_work_group_size))
    return 1 << (limit.bit_length() - 1)


class OpenCLPersistentRuntime:
    """Runs a frozen PersistentProgram on the selected OpenCL device (see the module docstring).

    It ignores ``num_workers``/``num_local_schedulers`` (``LAUNCHED``): one in-order queue runs a step.
    """

    kind = LAUNCHED

    def __init__(self, program: PersistentProgram, config: dict[str, int], *, zero_copy: bool | None = None,
                 lanes: int | None = None) -> None:
        """``zero_copy`` and ``lanes`` default to what suits the device; tests force the other paths."""
        import torch

        cl = importlib.import_module("pyopencl")
        self.cl, self.program, self.config = cl, program, config
        if program.tokens.dtype != torch.int64 or program.step.dtype != torch.int64:
            raise NotSupportedError("the OpenCL PersistentKernel runtime needs int64 step and tokens tensors; "
                                    "create them with dtype=torch.int64")
        TASKS.require(layer.kind for layer in program.layers)
        dev = device()
        self.ctx, _ = context()
        self.zero_copy = bool(dev.host_unified_memory) if zero_copy is None else zero_copy
        if lanes is None:  # CPU: a GEMV column per work-item, else a slice of a work-group per row (cstyle_gemv)
            lanes = LANES if dev.type & cl.device_type.CPU else 0
        self.rendered = render_persistent(program, DIALECT, _group(dev), lanes)
        built = _built(cl, self.ctx, self.rendered.source)
        profiling = program.profiler_tensor is not None
        props = cl.command_queue_properties.PROFILING_ENABLE if profiling else 0
        self.queue = cl.CommandQueue(self.ctx, dev, properties=props)  # own queue: finish() waits for us only

        self.tensors: dict[str, Any] = {}  # buffer name -> torch CPU tensor (the caller's, or made here)
        self.names: dict[str, str] = {}  # PK tensor name -> buffer name
        for t in program.tensors:
            name = tensor_name(t.index)
            self.names[t.name] = name
            if t.attached:
                value = program.values[t.name]
            else:  # device="cpu": an ambient torch.device("meta") context must not move the kernel's memory
                value = torch.zeros(t.dims, dtype=getattr(torch, t.dtype), device="cpu")
            if str(value.dtype).removeprefix("torch.") != t.dtype:
                raise NotSupportedError(f"tensor {t.name!r} is {value.dtype} but was declared {t.dtype}")
            check_tensor(value, f"the OpenCL runtime's tensor {t.name!r}", "cpu", written=not t.attached)
            self.tensors[name] = value
        self.tensors[STEP] = program.step
        self.tensors[CTL] = torch.zeros(self.rendered.ctl_size, dtype=torch.int64)
        for scratch in (XS, SCORES):
            self.tensors[scratch] = torch.zeros(self.rendered.scratch[scratch], dtype=torch.float32)
        written = {tensor_name(program.tokens_id), STEP}
        written |= {self.names[layer.inputs[r].name] for layer in program.layers for r in layer.spec.writes}
        self.synced = sorted(written)  # what a non-zero-copy call uploads and reads back
        self.host: dict[str, np.ndarray] = {}
        self.buffers = {name: self._buffer(name, t) for name, t in self.tensors.items()}
        self.ctl = np.zeros(self.rendered.ctl_size, np.int64)
        self.launches = [(self._kernel(built, x), x) for x in (self.rendered.begin, *self.rendered.step)]
        self.snapshot = Snapshot([(name, t) for name, t in self.tensors.items()])
        self._stop = False
        self.steps_run = 0

    def _buffer(self, name: str, t: Any) -> Any:
        """A cl.Buffer over ``t``'s storage (zero-copy) or a device copy of it."""
        import torch

        flat = t.reshape(-1)
        host = (flat.view(torch.int16) if flat.dtype in (torch.float16, torch.bfloat16) else flat).numpy()
        self.host[name] = host  # shares t's memory: transfers read and write the tensor itself
        mf = self.cl.mem_flags
        flags = mf.READ_WRITE | (mf.USE_HOST_PTR if self.zero_copy else mf.COPY_HOST_PTR)
        return self.cl.Buffer(self.ctx, flags, hostbuf=host if host.size else np.zeros(1, host.dtype))

    def _kernel(self, built: Any, launch: PKLaunch) -> Any:
        kernel = self.cl.Kernel(built, launch.kernel)  # one per launch: its arguments are set once, here
        kernel.set_args(*[self.buffers[a] for a in launch.args])
        return kernel

    def value(self, name: str) -> Any:
        buffer = self.names[name]
        if not self.zero_copy:
            self.cl.enqueue_copy(self.queue, self.host[buffer], self.buffers[buffer], is_blocking=True)
        return self.tensors[buffer]

    def pick(self, logits: Any) -> Any:
        """The picker layer's kernels alone on ``logits`` at the current positions (PersistentRuntime.pick)."""
        picker = self.program.picker
        x, out = self.names[picker.inputs["input"].name], self.names[picker.output.name]
        self.tensors[x].copy_(logits)
        cl = self.cl
        try:
            if not self.zero_copy:  # the positions (step) and the logits go up; nothing else is read
                for name in (x, STEP):
                    cl.enqueue_copy(self.queue, self.buffers[name], self.host[name], is_blocking=False)
            self._enqueue([(k, launch) for k, launch in self.launches[1:] if launch.layer == picker.index])
            if not self.zero_copy:
                cl.enqueue_copy(self.queue, self.host[out], self.buffers[out], is_blocking=False)
        finally:
            self.queue.finish()
        return self.tensors[out][:, 0]

    def stop(self) -> None:
        """Ask the decode in flight to stop after its current step (the exit hook calls it)."""
        self._stop = True

    def _enqueue(self, launches: list[tuple[Any, PKLaunch]]) -> list[Any]:
        cl = self.cl
        return [cl.enqueue_nd_range_kernel(self.queue, kernel, (x.global_size,), (x.local,)) for kernel, x in launches]

    def _read_ctl(self) -> np.ndarray:
        self.cl.enqueue_copy(self.queue, self.ctl, self.buffers[CTL], is_blocking=True)
        return self.ctl

    def run(self, max_new_tokens: int | None = None) -> int:
        """Decode (see PersistentKernel.__call__); the kernel's lock serializes calls."""
        fork.check()  # a runtime built before fork() would block forever in the child's enqueue
        program = self.program
        self.snapshot.verify()
        limit = program.max_seq_length if max_new_tokens is None else int(max_new_tokens)
        cl = self.cl
        self._stop = False
        self.tensors[CTL].zero_()
        uploads = [] if self.zero_copy else [CTL, *self.synced]  # zero-copy: zeroed in place above
        steps = 0
        profile: list[Any] | None = None
        with shutdown.decoding(self):
            try:
                for name in uploads:
                    cl.enqueue_copy(self.queue, self.buffers[name], self.host[name], is_blocking=False)
                self._enqueue(self.launches[:1])  # begin: which rows decode, token ids in range
                ctl = self._read_ctl()
                while steps < limit and not self._stop:
                    if ctl[Ctl.ERROR]:
                        row, tok = int(ctl[Ctl.ERR_ROW]), int(ctl[Ctl.ERR_VALUE])
                        raise token_out_of_range(row, tok)
                    if ctl[Ctl.ALIVE] == 0:
                        break
                    events = self._enqueue(self.launches[1:])  # the layers, commit, the next step's begin
                    if profile is None and program.profiler_tensor is not None:
                        profile = events
                    ctl = self._read_ctl()
                    steps += 1
            finally:
                self.queue.finish()  # nothing of ours may still run when this returns or raises
                if not self.zero_copy:
                    for name in self.synced:
                        cl.enqueue_copy(self.queue, self.host[name], self.buffers[name], is_blocking=True)
        if self._stop:
            shutdown.check_not_stopped()  # stopped by the exit hook: an incomplete result is an error
        if profile is not None:
            self._write_profile(profile)
        self.steps_run += steps
        return steps

    def _write_profile(self, events: list[Any]) -> None:
        """Each task gets its layer's kernels' span (start of the first, end of the last), relative ns."""
        program = self.program
        spans: dict[int, tuple[int, int]] = {}
        for (_, launch), event in zip(self.launches[1:], events, strict=True):
            if launch.layer >= 0:
                start, end = int(event.profile.start), int(event.profile.end)
                lo, hi = spans.get(launch.layer, (start, end))
                spans[launch.layer] = (min(lo, start), max(hi, end))
        origin = min(lo for lo, _ in spans.values())
        out = program.profiler_tensor.view(-1)
        graph = program.task_graph
        for task in range(min(graph.num_tasks, out.numel() // 3)):
            lo, hi = spans[graph.task_layer[task]]
            out[3 * task] = lo - origin
            out[3 * task + 1] = hi - origin
            out[3 * task + 2] = 0  # one in-order queue: every task's "worker" is the device


#: the C-family renderer's task bodies (yirage.persistent.cstyle), enqueued by this runtime
TASKS = register_task_bodies("opencl", cstyle.TASKS.bodies, declined=cstyle.TASKS.declined, where=cstyle.TASKS.where)

__all__ = ["TASKS", "OpenCLPersistentRuntime"]
