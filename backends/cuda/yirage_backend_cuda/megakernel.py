"""The cuda backend's resident PersistentKernel: a whole decode, every step, in one cooperative kernel launch.

The launched runtime (``pk_runtime.py``) enqueues each step's task kernels and reads the control buffer on the host
after every step. Here the same task bodies (the core's C-family renderer, CUDA dialect) become ``__device__``
functions of one ``__global__`` kernel, ``y_megakernel``, that stays resident for the whole decode:

- its grid is ``num_workers`` thread blocks, never more than the device holds at once (the occupancy query times
  the SM count) and launched with ``cuLaunchCooperativeKernel``, which refuses a grid that could not be
  co-resident; so a block spinning at a barrier can never wait for one that has no SM;
- each task (one layer's kernel of the launched runtime, one "work-group" of it) is a virtual block
  ``vg``: block ``b`` runs ``vg = b, b + grid, ...`` of a layer, then every block meets at a grid-wide barrier
  (``y_grid_sync``: an arrival counter and a generation word in global memory, ``__threadfence`` on both sides,
  as cooperative groups' ``grid.sync`` does) before the next layer reads what this one wrote;
- the step loop that ``LaunchedSteps.run`` runs on the host runs on the device: ``begin``, then while no
  error, a row still decodes, the host has not asked to stop and fewer than ``limit`` steps ran: the layers,
  ``commit``, ``begin``. Every block reads the control buffer right after the same barrier, so all agree
  when to leave;
- the host's stop request (Ctrl-C, the exit hook) is a word in mapped pinned host memory that block 0 copies
  into the control buffer's ``STOP`` slot in each ``begin``: the step in flight completes and commits, as
  in every other runtime.

The task bodies' pointers are neither ``__restrict__`` nor read-only-cache loads: a buffer one block writes in one
layer is read by other blocks in the next, within the same launch. The grid-wide barrier count per step is the
number of the launched runtime's kernels per step; that (not HBM bandwidth) bounds a small model's step time. The
renderer now stages each RMSNorm and silu_mul inside the GEMV after it (where its work-groups are few: not the
LM head's) and stores the new key/value inside the attention (``cstyle``, ``cstyle_gemv.Stage``): 5 barriers per
layer for a SmolLM2 shape at batch 1, down from 8 (the first H100 run: 2.3 ms/token here, 1.7 on the launched
runtime). Next: MPK's finer events per task; ``benchmark/grid_barrier.py`` measures what one barrier costs.
``YIRAGE_CUDA_GRID_SYNC=tree`` swaps the one-counter barrier for a two-level one (32 leaf counters on their own
lines, then a top counter: fewer atomics on one address); ``=events`` drops the barrier for a completion counter
per phase (``EVENTS``; run on CPU threads, verbatim, in tests/test_megakernel_protocol.py); ``make gpu-check``
decodes with all three.

Selected with ``YIRAGE_CUDA_PK_RUNTIME=megakernel`` (``launched`` is the default until a GPU run has checked this
runtime; ``info`` and ``pk.config`` name the kind in use). A profiled run (per-task times need a launch per task)
and ``pick`` use the launched kernels, built beside it.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from yirage.backend.runtime_contract import RESIDENT
from yirage.codegen.dialects.cuda import DIALECT
from yirage.errors import NotSupportedError
from yirage.persistent import shutdown
from yirage.persistent.control import Ctl
from yirage.persistent.cstyle import CTL, GROUP, PKLaunch, PKRendered, render_persistent
from yirage.persistent.guard import token_out_of_range
from yirage.persistent.program import PersistentProgram
from yirage_backend_cuda.driver import CudaModule, DriverError, LaunchError, call
from yirage_backend_cuda.pk_runtime import CudaPersistentRuntime, load_module

#: the environment variable that picks the cuda PersistentKernel runtime, and its values
RUNTIME_ENV = "YIRAGE_CUDA_PK_RUNTIME"
RUNTIMES = ("launched", "megakernel")
KERNEL = "y_megakernel"
SOURCE_NAME = "megakernel.cu"
#: resident blocks per SM by default (64-thread blocks: 8 give each SM 16 warps to keep loads in flight). Every task
#: body runs in blocks of GROUP threads: a GEMV's are GROUP / 32 warps, one output row each (cstyle_gemv), reduced by
#: shuffles, so the GEMVs declare no __shared__ memory at any batch
BLOCKS_PER_SM = 8
#: how long the host sleeps between polls of a running decode (Ctrl-C lands within one poll)
POLL_S = 0.0002

#: the task bodies as device functions: a virtual block index and the body's block size come in as arguments
TASK_DIALECT = replace(
    DIALECT, name="cuda (megakernel task functions)", kernel="static __device__ __noinline__ void",
    launch_bounds=lambda n: "",
    param=lambda i, ctype, name, writable: f"{'' if writable else 'const '}{ctype}* {name}",
    ids={"global": "(y_vg * y_local + threadIdx.x)", "group": "y_vg", "local": "threadIdx.x",
         "local_size": "y_local"},
    id_params=("long long y_vg", "long long y_local"))

GRID_SYNC = """\
// every block of the grid arrives before any leaves; writes before the barrier are seen after it
__device__ __forceinline__ void y_grid_sync(unsigned int* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned int* generation = bar + 1;
        unsigned int seen = *generation;
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*generation == seen) __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}"""


#: two levels: 32 leaf counters, each on its own 128-byte line, then a top counter; the megakernel's barrier with
#: ``YIRAGE_CUDA_GRID_SYNC=tree`` (benchmark/grid_barrier.py times it beside the flat one)
TREE_LEAVES = 32
GRID_SYNC_TREE = f"#define Y_LEAVES {TREE_LEAVES}u\n" + """\
// two levels: block b arrives on leaf b % L (its own 128-byte line); the last of a leaf arrives on the top counter;
// the last there resets it and advances the generation every waiting block watches
__device__ __forceinline__ void y_grid_sync_tree(unsigned int* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned int* generation = bar;
        unsigned int seen = *generation;
        unsigned int leaves = gridDim.x < Y_LEAVES ? gridDim.x : Y_LEAVES;
        unsigned int leaf = blockIdx.x % leaves;
        unsigned int members = gridDim.x / leaves + (leaf < gridDim.x % leaves ? 1u : 0u);
        unsigned int* counter = bar + 32u * (leaf + 1u);
        __threadfence();
        bool last = false;
        if (atomicAdd(counter, 1u) == members - 1u) {
            atomicExch(counter, 0u);
            __threadfence();  // the leaf's reset lands before the top arrival that may release the grid
            if (atomicAdd(bar + 1, 1u) == leaves - 1u) {
                atomicExch(bar + 1, 0u);
                __threadfence();
                atomicAdd(bar, 1u);
                last = true;
            }
        }
        if (!last) {
            while (*generation == seen) __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}
"""
#: ``YIRAGE_CUDA_GRID_SYNC=events``: no grid-wide barrier. Each phase (a task kernel's virtual blocks) has a
#: completion counter on its own 128-byte line; a block that ran n of its virtual blocks adds n once (a block with
#: none adds nothing), and a block starts a phase once the previous phase's counter reaches its virtual blocks times
#: the steps so far (counters only grow within a launch: no reset, no generation word). A barrier makes every block
#: arrive (1056 atomics on one word at 8 blocks per SM); here an attention phase of 9 virtual blocks costs 9.
#: Every block agrees on when to leave: it reads the control buffer after the step's ``begin`` completes, and the
#: next write to it (``commit``) waits for the widest phase, in which every block has work (the grid is never wider
#: than the widest phase), so no block can commit before every block has read.
EVENTS = """\
// this block ran n virtual blocks of a phase: publish them (its writes first) on the phase's counter
__device__ __forceinline__ void y_done(unsigned int* done, int n) {
    __syncthreads();
    if (threadIdx.x == 0 && n > 0) {
        __threadfence();
        atomicAdd(done, (unsigned int)n);
    }
}
// wait until a phase's counter reaches target (wrap-safe), then read what its blocks wrote
__device__ __forceinline__ void y_wait(const unsigned int* done, unsigned int target) {
    if (threadIdx.x == 0) {
        const volatile unsigned int* v = done;
        while ((int)(*v - target) < 0) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
}
"""
#: the environment variable that picks the megakernel's grid-wide synchronization: name -> (barrier function,
#: source, words of its buffer; events: counted per program, one 32-word line per phase)
GRID_SYNC_ENV = "YIRAGE_CUDA_GRID_SYNC"
GRID_SYNCS = {"flat": ("y_grid_sync", GRID_SYNC, 2), "tree": ("y_grid_sync_tree", GRID_SYNC_TREE,
                                                              32 * (TREE_LEAVES + 1)),
              "events": ("", EVENTS, 0)}


def selected_grid_sync() -> str:
    """The synchronization ``$YIRAGE_CUDA_GRID_SYNC`` names: ``flat`` (one counter, the default), ``tree`` or
    ``events``."""
    name = os.environ.get(GRID_SYNC_ENV, "flat").strip().lower() or "flat"
    if name not in GRID_SYNCS:
        raise NotSupportedError(f"{GRID_SYNC_ENV}={name!r} is not a megakernel synchronization; use one of "
                                f"{', '.join(GRID_SYNCS)}")
    return name


def selected_runtime() -> str:
    """The cuda PersistentKernel runtime ``$YIRAGE_CUDA_PK_RUNTIME`` names (default ``launched``)."""
    name = os.environ.get(RUNTIME_ENV, "launched").strip().lower() or "launched"
    if name not in RUNTIMES:
        raise NotSupportedError(f"{RUNTIME_ENV}={name!r} is not a cuda PersistentKernel runtime; use one of "
                                f"{', '.join(RUNTIMES)}")
    return name


@dataclass(frozen=True)
class MegaRendered:
    """The megakernel's source, its buffers in parameter order and the block size every task runs with."""

    source: str
    buffers: tuple[str, ...]
    block: int
    widest: int  # the most virtual blocks one layer has (more resident blocks than this would idle)
    bar_words: int = 2  # unsigned ints of the grid barrier's buffer (zeroed before each launch)


def render_megakernel(program: PersistentProgram, block: int = GROUP, grid_sync: str | None = None) -> MegaRendered:
    """``program``'s task bodies as device functions and the resident kernel that runs them step after step, with
    the grid-wide barrier ``grid_sync`` names (default: ``selected_grid_sync()``)."""
    sync, sync_source, bar_words = GRID_SYNCS[grid_sync or selected_grid_sync()]
    tasks = render_persistent(program, TASK_DIALECT, block, lanes=0)
    for x in tasks.step:
        if x.local > block:
            raise NotSupportedError(f"task {x.kernel} needs {x.local} threads, the megakernel's blocks have {block}")
    shared = _static_shared_bytes(tasks.source)
    if shared > SHARED_LIMIT:
        raise NotSupportedError(f"the megakernel's task functions declare {shared} bytes of __shared__ memory in all "
                                f"(ptxas adds up every function's arrays; a kernel may have {SHARED_LIMIT}) at batch "
                                f"{program.batch}; use {RUNTIME_ENV}=launched")
    buffers: list[str] = []
    for x in (tasks.begin, *tasks.step):
        buffers += [a for a in x.args if a not in buffers]
    params = [f"{tasks.ctypes[b]}* {b}" for b in buffers]
    params += ["unsigned int* y_bar", "const volatile int* y_stop", "long long y_limit"]
    ctl = f"((volatile long long*){CTL})"
    head = f'extern "C" __global__ void __launch_bounds__({block}) {KERNEL}({", ".join(params)}) {{'
    widest = max(x.groups for x in tasks.step)
    if not sync:  # events: a completion counter per phase
        lines = [tasks.source.rstrip(), "", sync_source, "", head, *_event_phases(tasks, block, ctl), "}", ""]
        return MegaRendered("\n".join(lines), tuple(buffers), block, widest, 32 * (len(tasks.step) + 1))
    lines = [tasks.source.rstrip(), "", sync_source, "", head,
             *_phase(tasks.begin, block, tasks), f"    if (blockIdx.x == 0 && threadIdx.x == 0) "
             f"{CTL}[{Ctl.STOP}] = *y_stop;", f"    {sync}(y_bar);",
             "    for (long long y_steps = 0; y_steps < y_limit; y_steps++) {",
             f"        if ({ctl}[{Ctl.ERROR}] != 0 || {ctl}[{Ctl.ALIVE}] == 0 || {ctl}[{Ctl.STOP}] != 0) break;"]
    for x in tasks.step:  # the layers, commit, and the next step's begin, each followed by a grid-wide barrier
        lines += [f"    {line}" for line in _phase(x, block, tasks)]
        if x is tasks.begin:
            lines.append(f"        if (blockIdx.x == 0 && threadIdx.x == 0) {CTL}[{Ctl.STOP}] = *y_stop;")
        lines.append(f"        {sync}(y_bar);")
    lines += ["    }", "}", ""]
    return MegaRendered("\n".join(lines), tuple(buffers), block, widest, bar_words)


def _event_phases(tasks: PKRendered, block: int, ctl: str) -> list[str]:
    """The kernel body with completion counters (``EVENTS``): phase p of the step loop counts on line p of
    ``y_bar``, the first ``begin`` (before the loop) on line len(step)."""
    step, first = list(tasks.step), len(tasks.step)
    stop = f"if (blockIdx.x == 0 && threadIdx.x == 0) {CTL}[{Ctl.STOP}] = *y_stop;"

    def counted(x: PKLaunch, slot: int) -> list[str]:
        body = _phase(x, block, tasks, counted=True)
        return ["{", "    int y_n = 0;", *body, *([f"    {stop}"] if x is tasks.begin else []),
                f"    y_done(y_bar + {32 * slot}, y_n);", "}"]

    lines = [*(f"    {line}" for line in counted(tasks.begin, first)),
             "    for (long long y_steps = 0; y_steps < y_limit; y_steps++) {",
             "        unsigned int y_s = (unsigned int)y_steps;",
             f"        if (y_steps == 0) y_wait(y_bar + {32 * first}, {tasks.begin.groups}u); "
             f"else y_wait(y_bar + {32 * (first - 1)}, {step[-1].groups}u * y_s);",
             f"        if ({ctl}[{Ctl.ERROR}] != 0 || {ctl}[{Ctl.ALIVE}] == 0 || {ctl}[{Ctl.STOP}] != 0) break;"]
    for p, x in enumerate(step):
        if p:
            lines.append(f"        y_wait(y_bar + {32 * (p - 1)}, {step[p - 1].groups}u * (y_s + 1u));")
        lines += [f"        {line}" for line in counted(x, p)]
    return [*lines, "    }"]


def _phase(x: PKLaunch, block: int, tasks: PKRendered, counted: bool = False) -> list[str]:
    """Every virtual block of task kernel ``x``, spread over the resident blocks (``counted``: each adds 1 to the
    enclosing ``y_n``)."""
    call_ = f"{x.kernel}({', '.join(x.args)}, y_vg, {x.local});"
    if x.local < block:
        if _has_barrier(tasks.source, x.kernel):
            raise NotSupportedError(f"task {x.kernel} has a block barrier but runs {x.local} of the megakernel's "
                                    f"{block} threads; the launched runtime runs it (YIRAGE_CUDA_PK_RUNTIME=launched)")
        call_ = f"if (threadIdx.x < {x.local}) {call_}"
    # the barrier after each virtual block: the next one's threads must not overwrite shared memory (a reduction's
    # red[0]) that a slower thread of this one still reads
    # an int loop counter (a layer has fewer than 2**31 virtual blocks): with a long long one ptxas spilled a
    # register of this kernel across the task calls on sm_90 (ptxas -v; the compile-only check refuses spills)
    loop = f"for (int y_vg = blockIdx.x; y_vg < {x.groups}; y_vg += gridDim.x)"
    return [f"    {loop} {{ {call_} __syncthreads();{' y_n++;' if counted else ''} }}"]


#: static __shared__ bytes one kernel may declare (every function it calls counts: ptxas does not overlap them)
SHARED_LIMIT = 48 * 1024
_SHARED_BYTES = {"float": 4, "int": 4, "unsigned int": 4, "double": 8, "long long": 8, "unsigned long long": 8}


def _static_shared_bytes(source: str) -> int:
    """The ``__shared__`` arrays the task functions declare, in bytes (each function's counted once)."""
    total = 0
    for ctype, count in re.findall(r"__shared__ ([a-z ]+?) \w+\[(\d+)\];", source):
        if ctype not in _SHARED_BYTES:
            raise NotSupportedError(f"a task function declares a __shared__ {ctype} array the megakernel cannot size")
        total += _SHARED_BYTES[ctype] * int(count)
    return total


def _has_barrier(source: str, kernel: str) -> bool:
    start = source.index(f" {kernel}(")
    end = source.find("\n}\n", start)
    return DIALECT.barrier in source[start:end]


class CudaMegakernelRuntime(CudaPersistentRuntime):
    """A decode as one resident cooperative launch (module docstring); ``pick`` and a profiled first step use
    the launched kernels of ``CudaPersistentRuntime``."""

    kind = RESIDENT

    def __init__(self, program: PersistentProgram, config: dict[str, int], module: CudaModule,
                 stream: Callable[[], int], rendered: PKRendered, mega_module: CudaModule, mega: MegaRendered,
                 sm_count: int) -> None:
        import torch

        super().__init__(program, config, module, stream, rendered)
        self.mega, self.mega_module = mega, mega_module
        driver = mega_module.driver
        self._fn = mega_module.launchable(KERNEL, 1, mega.block, "yirage_backend_cuda.megakernel")
        with mega_module.current():
            per_sm = int(call(driver, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                              driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._fn, mega.block, 0)))
        if per_sm < 1:
            raise NotSupportedError(f"{KERNEL} cannot be resident on this GPU ({mega.block}-thread blocks: occupancy "
                                    "0); use YIRAGE_CUDA_PK_RUNTIME=launched")
        self.resident = per_sm * sm_count
        wanted = int(config.get("num_workers") or 0) or BLOCKS_PER_SM * sm_count
        #: thread blocks of the launch: as many as asked, never more than can be resident or have work
        self.grid = max(1, min(wanted, self.resident, mega.widest))
        self.bar = torch.zeros(mega.bar_words, dtype=torch.int32, device=self.device)
        self._host_stop = _MappedFlag(driver, mega_module)
        missing = [b for b in mega.buffers if b not in self.buffers]
        if missing:
            raise LaunchError(f"{KERNEL} reads buffers {missing} this runtime does not have: a renderer this runtime "
                              "does not match; report it")
        self._args = tuple(self.buffers[b].data_ptr() for b in mega.buffers) + (
            self.bar.data_ptr(), self._host_stop.device_pointer)
        self._types = (ctypes.c_void_p,) * (len(mega.buffers) + 2) + (ctypes.c_longlong,)

    def stop(self) -> None:
        """Ask the running kernel to stop after its current step (the exit hook; Ctrl-C does the same)."""
        super().stop()
        self._host_stop.set(1)

    def run(self, max_new_tokens: int | None = None) -> int:
        """Decode (PersistentKernel.__call__) in one launch; the kernel's lock serializes calls."""
        program = self.program
        if program.profiler_tensor is not None:  # per-task times need a launch per task: the launched loop
            return super().run(max_new_tokens)
        self.snapshot.verify()
        limit = program.max_seq_length if max_new_tokens is None else int(max_new_tokens)
        self._stop = False
        self._host_stop.set(0)
        self.ctl.zero_()
        self.bar.zero_()
        limit = max(0, limit)
        with shutdown.decoding(self):
            fault = None
            try:
                self._launch(limit)
                self._wait()
            except DriverError as exc:  # the kernel faulted: that error, not torch's sticky echo of it in _sync
                fault = exc
                raise
            except BaseException:  # Ctrl-C anywhere here: the kernel stops after its step, then we wait for it
                self._host_stop.set(1)
                raise
            finally:
                if fault is None:
                    self._sync()
        ctl = self.ctl.tolist()
        steps = int(ctl[Ctl.STEPS])
        if self._stop:  # the launched loop's order: a stop request first, then an error seen before a step
            shutdown.check_not_stopped()
        if ctl[Ctl.ERROR] and steps < limit:
            raise token_out_of_range(ctl[Ctl.ERR_ROW], ctl[Ctl.ERR_VALUE])
        return steps

    def _launch(self, limit: int) -> None:
        driver = self.mega_module.driver
        with self.mega_module.current():
            try:
                call(driver, f"cuLaunchCooperativeKernel({KERNEL}, {self.grid} blocks)",
                     driver.cuLaunchCooperativeKernel(self._fn, self.grid, 1, 1, self.mega.block, 1, 1, 0,
                                                      self._stream(), (self._args + (limit,), self._types)))
            except DriverError as exc:
                raise DriverError(f"{exc}. The grid was {self.grid} blocks of {self.mega.block} threads (num_workers; "
                                  f"at most {self.resident} resident on this GPU as the occupancy query said); pass "
                                  f"fewer num_workers, or use {RUNTIME_ENV}=launched") from exc

    def _wait(self) -> None:
        """Poll the stream, so Ctrl-C lands in Python (``run`` then asks the kernel to stop after its step)."""
        driver = self.mega_module.driver
        not_ready = driver.CUresult.CUDA_ERROR_NOT_READY
        while True:
            with self.mega_module.current():
                (status,) = driver.cuStreamQuery(self._stream())
            if status != not_ready:
                if status != driver.CUresult.CUDA_SUCCESS:
                    call(driver, f"{KERNEL} (cuStreamQuery)", (status,))
                return
            time.sleep(POLL_S)


class _MappedFlag:
    """One int32 in pinned host memory that the device reads through its mapped address (the stop request)."""

    def __init__(self, driver: Any, module: CudaModule) -> None:
        with module.current():
            host = call(driver, "cuMemHostAlloc", driver.cuMemHostAlloc(4, driver.CU_MEMHOSTALLOC_DEVICEMAP))
            weakref.finalize(self, _free_host, driver, module, host)  # freed even if the next call fails
            self.device_pointer = int(call(driver, "cuMemHostGetDevicePointer",
                                           driver.cuMemHostGetDevicePointer(host, 0)))
        self._value = ctypes.c_int32.from_address(int(host))
        self._value.value = 0

    def set(self, value: int) -> None:
        self._value.value = value


def _free_host(driver: Any, module: CudaModule, host: Any) -> None:
    try:
        with module.current():
            call(driver, "cuMemFreeHost", driver.cuMemFreeHost(host))
    except DriverError:  # the context is gone at interpreter exit: the driver freed the memory with it
        pass


def megakernel_runtime(program: PersistentProgram, config: dict[str, int], index: int,
                       stream: Callable[[], int]) -> CudaMegakernelRuntime:
    """The resident runtime of ``program`` on ``cuda:index``; NotSupportedError where the GPU cannot run it."""
    import torch

    from yirage_backend_cuda.pk_runtime import render_cuda

    props = torch.cuda.get_device_properties(index)
    driver_attr = _cooperative(index)
    if not driver_attr:
        raise NotSupportedError(f"cuda:{index} ({props.name}) has no cooperative launch; use "
                                f"{RUNTIME_ENV}=launched")
    rendered = render_cuda(program)
    mega = render_megakernel(program)
    return CudaMegakernelRuntime(program, config, load_module(rendered.source, index), stream, rendered,
                                 load_module(mega.source, index, name=SOURCE_NAME), mega,
                                 props.multi_processor_count)


def _cooperative(index: int) -> bool:
    from yirage_backend_cuda.driver import _driver

    driver = _driver()
    call(driver, "cuInit", driver.cuInit(0))
    device = call(driver, "cuDeviceGet", driver.cuDeviceGet(index))
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
    return bool(call(driver, "cuDeviceGetAttribute", driver.cuDeviceGetAttribute(attr, device)))
