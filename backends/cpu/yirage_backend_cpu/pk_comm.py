"""Collectives inside the CPU PersistentKernel runtime: a communication task and a communication thread.

A tensor-parallel decode step has collective layers (``allreduce_layer`` after
the row-parallel o and down projections, ``allgather_layer`` for the
vocabulary-parallel logits; their LayerSpec names the collective). Each is one
task of the step's task graph, so the event mechanism gates the next layer on
it as on any task (MPK's communication task). The task cannot run a
torch.distributed collective itself (it runs in nogil numba code), so:

1. the task writes its layer number (8 bytes) to a pipe (``write``, declared
   as an external symbol like backoff's libc calls) and counts the request in
   ``flags[REQUESTS]``;
2. the runtime's communication thread, blocked in ``os.read`` on the pipe,
   wakes, runs the layer's collective on the layer's buffers through
   yirage.distributed.collectives (timeouts, errors naming the rank and the
   label), then stores the request count in ``flags[SERVED]``;
3. the task waits for ``flags[SERVED]`` to reach its request like every other
   wait here (spin, yield, sleep: backoff.py), re-checking ``flags[STOP]``.

The layers that need a collective depend on each other through the step's data
(o all-reduce -> gate/up -> down -> down all-reduce -> next layer), so at most
one request is outstanding and the thread issues the collectives in the same
order on every rank, as torch.distributed requires. The collective waits in
slices and gives up when ``flags[STOP]`` is set (Ctrl-C), so a rank stopped
while a peer never answers does not hang. A failed collective (a dead or stuck
rank) sets ``flags[STOP]`` and ``flags[ERROR] = ERR_COMM``; ``run()`` raises the
collective's DistributedError after the decode returns.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from yirage.persistent.control import HEADER, Ctl, CtlError
from yirage_backend_cpu.atomics import atomic_add, atomic_load, atomic_store, cycle_counter
from yirage_backend_cpu.backoff import SLEEP_US, SPIN_CYCLES, YIELD_CYCLES, cpu_relax, os_yield, sleep_us
from yirage_backend_cpu.kernel_lib import FASTMATH
from yirage_backend_cpu.sources import tie_caches_to_sources

OPTS = {"fastmath": FASTMATH, "error_model": "numpy", "nogil": True, "cache": True}
STOP, ERROR = int(Ctl.STOP), int(Ctl.ERROR)  # the control buffer's header (yirage.persistent.control)
# flags slots of the communication protocol, on their own cache line after the header (which every task reads)
REQUESTS, SERVED, PIPE_FD = HEADER, HEADER + 1, HEADER + 2
FLAG_SLOTS = HEADER + 8
ERR_COMM, ERR_PIPE = int(CtlError.COMM), int(CtlError.PIPE)  # flags[ERROR] when a collective fails
SLICE_S = 0.1  # a collective waits in slices this long, re-checking the stop flag


@intrinsic
def pipe_write_i64(typingctx, fd, value):  # type: ignore[no-untyped-def]
    """``write(fd, &value, 8)``; returns what write returned (8 when the whole request went through)."""
    if not (isinstance(fd, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i64 = ir.IntType(64)
        slot = cgutils.alloca_once(builder, i64)
        builder.store(context.cast(builder, args[1], signature.args[1], types.int64), slot)
        fnty = ir.FunctionType(i64, [ir.IntType(32), ir.IntType(8).as_pointer(), i64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "write")
        fd32 = builder.trunc(context.cast(builder, args[0], signature.args[0], types.int64), ir.IntType(32))
        return builder.call(fn, [fd32, builder.bitcast(slot, ir.IntType(8).as_pointer()), ir.Constant(i64, 8)])

    return types.int64(fd, value), codegen


@njit(**OPTS)
def communicate(layer, flags):  # type: ignore[no-untyped-def]
    """The body of a collective layer's task: hand ``layer`` to the communication thread, wait until it is done
    (or the run stops)."""
    ticket = atomic_add(flags, REQUESTS, 1) + 1
    if pipe_write_i64(atomic_load(flags, PIPE_FD), layer) != 8:
        atomic_store(flags, ERROR, ERR_PIPE)
        atomic_store(flags, STOP, 1)
        return
    since = 0
    while atomic_load(flags, SERVED) < ticket:
        if atomic_load(flags, STOP) != 0:
            return
        now = cycle_counter()
        if since == 0:
            since = now
        elif now - since < SPIN_CYCLES:
            cpu_relax()
        elif now - since < YIELD_CYCLES:
            os_yield()
        else:
            sleep_us(SLEEP_US)


class Communicator:
    """The communication thread of one run, and what each collective layer does (see the module docstring)."""

    def __init__(self, program: Any, values: dict[str, Any]) -> None:
        from yirage.distributed.world import current_group

        self.group = current_group()
        self.actions = {layer.index: self._action(layer, values) for layer in program.layers
                        if layer.spec.collective is not None}
        self.read_fd, self.write_fd = os.pipe()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.comm_ns = 0  # time spent inside collectives during the last run (the communication share)
        self.calls = 0

    def _action(self, layer: Any, values: dict[str, Any]) -> Any:
        import torch

        from yirage.distributed.collectives import all_gather_parts, all_reduce_

        src, dst = values[layer.inputs["input"].name], values[layer.output.name]
        label = str(layer.params["label"])
        if layer.spec.collective == "all_reduce":
            def reduce(stop: Any) -> None:
                dst.copy_(src)
                all_reduce_(dst, label, stop=stop)
            return reduce
        if layer.spec.collective == "all_gather":
            width, n = int(layer.params["shard_width"]), self.group.world.world_size
            send = torch.full((src.shape[0], width), float("-inf"))  # the last shard is padded; never picked
            parts = [torch.empty_like(send) for _ in range(n)]
            cols = dst.shape[1]

            def gather(stop: Any) -> None:
                send[:, :src.shape[1]].copy_(src)
                all_gather_parts(parts, send, label, stop=stop)
                for r in range(n):
                    lo = r * width
                    dst[:, lo:min(lo + width, cols)].copy_(parts[r][:, :min(width, cols - lo)])
            return gather
        raise NotImplementedError(f"the CPU runtime has no communication for collective {layer.spec.collective!r} "
                                  f"(layer {layer}); add it to pk_comm.Communicator._action")

    def start(self, flags: np.ndarray) -> None:
        flags[REQUESTS] = flags[SERVED] = 0
        flags[PIPE_FD] = self.write_fd
        self.error, self.comm_ns, self.calls = None, 0, 0
        self.thread = threading.Thread(target=self._serve, args=(flags,), name="yirage-pk-comm", daemon=True)
        self.thread.start()

    def _serve(self, flags: np.ndarray) -> None:
        import time

        stop = lambda: flags[STOP] != 0  # noqa: E731 - a Ctrl-C or another task's error ends the wait
        try:
            while True:
                data = b""
                while len(data) < 8:
                    chunk = os.read(self.read_fd, 8 - len(data))
                    if not chunk:  # the write end is closed: nothing more can come
                        raise OSError("the communication pipe of the CPU runtime was closed during a decode")
                    data += chunk
                layer = int.from_bytes(data, "little", signed=True)
                if layer < 0:
                    return  # the run is over
                start = time.perf_counter_ns()
                self.actions[layer](stop)
                self.comm_ns += time.perf_counter_ns() - start
                self.calls += 1
                flags[SERVED] += 1  # after the result is written: the waiting task reads it next
        except BaseException as exc:  # noqa: BLE001 - handed to run(), which raises it after the decode returns
            self.error = exc
            flags[ERROR] = ERR_COMM
            flags[STOP] = 1

    def finish(self) -> None:
        """End the thread (after the decode returned); it stops within a slice if a collective is in flight."""
        if self.thread is None:
            return
        os.write(self.write_fd, (-1).to_bytes(8, "little", signed=True))
        self.thread.join()
        self.thread = None
        # requests the decode wrote after the thread stopped serving (a failed run): drop them
        os.set_blocking(self.read_fd, False)
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass  # empty
        finally:
            os.set_blocking(self.read_fd, True)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)


tie_caches_to_sources(globals())  # after every cached function above is defined
