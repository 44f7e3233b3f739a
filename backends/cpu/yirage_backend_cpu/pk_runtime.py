"""The CPU PersistentKernel runtime: the whole generation in one nogil numba call.

Per step, ``num_workers + num_local_schedulers`` loop iterations run in a
``prange``. Workers claim slots of a task queue (atomic fetch-add), wait for
the slot to be filled with a ready task, run it, and count its events down;
the task that completes an event pushes it onto the event queue. Schedulers
claim event slots and push the tasks the event releases. A scheduler runs
tasks only while no worker is running (and a worker handles events only
while no scheduler is), which keeps any thread count deadlock-free. Between
steps, one serial section appends the picked token and advances ``step``.

``flags`` (int64[4]) lets the run stop early: ``flags[STOP]`` is checked by
every thread between tasks and by the loop between steps (Ctrl-C sets it
from Python, for a non-main thread through yirage.persistent.shutdown; a
task that finds bad input sets it too, with an error code in ``flags[ERROR]``
that ``run()`` turns into an exception). A stopped step is
not committed: ``tokens``/``step`` hold exactly the steps completed.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from typing import Any

import numba
import numpy as np
from numba import njit, prange

from yirage.persistent import shutdown
from yirage.persistent.guard import Snapshot, check_tensor
from yirage_backend_cpu.atomics import atomic_add, atomic_load, atomic_store, cycle_counter
from yirage_backend_cpu.kernel_lib import fsilu, rfma
from yirage_backend_cpu.pk_tasks import (
    BF16,
    F16,
    F32,
    I64,
    OPTS,
    argmax_row,
    attention,
    f32s,
    i64s,
    linear,
    load,
    sample_row,
)
from yirage_backend_cpu.sources import tie_caches_to_sources
from yirage_backend_cpu.threads import check_fork, serialized

EMBED, RMSLIN, ATTN, LINRES, SILURES, ARGMAX, SAMPLE = range(7)
KINDS = {"embed": EMBED, "rmsnorm_linear": RMSLIN, "attention": ATTN, "linear_with_residual": LINRES,
         "silu_mul_linear_with_residual": SILURES, "argmax": ARGMAX, "sample": SAMPLE}
DTYPES = {"float32": F32, "bfloat16": BF16, "float16": F16, "int64": I64}
STOP, ERROR, ERR_VALUE, ERR_ROW = range(4)  # flags slots
ERR_TOKEN = 1  # flags[ERROR]: a token id outside the embed table


@njit(**OPTS)
def execute(task, w, addr, tdt, tnum, lp, lf, task_layer, task_index, batch, scratch, step, tokens, tok_cols,
            none, flags):  # type: ignore[no-untyped-def]
    layer = task_layer[task]
    t = task_index[task]
    kind = lp[layer, 0]
    out_id = lp[layer, 1]
    n = lp[layer, 8]
    tasks = lp[layer, 9]
    k = lp[layer, 7]
    if kind == ARGMAX or kind == SAMPLE:
        logits = f32s(addr[lp[layer, 2]], tnum[lp[layer, 2]])
        picked = i64s(addr[out_id], batch)
        for b in range(batch):
            if kind == ARGMAX:
                picked[b] = argmax_row(logits, b * k, k)
            else:
                # seeded by position, so a run repeats whatever ran before it
                state = np.uint64(lp[layer, 15] * 1000003 + step[b] * 7919 + b * 104729 + 1)
                picked[b] = sample_row(logits, b * k, k, lf[layer, 1], lp[layer, 14], lf[layer, 2], state)
        return
    out = f32s(addr[out_id], tnum[out_id])
    cols = n // tasks
    n0 = t * cols
    if kind == EMBED:
        wid = lp[layer, 3]
        rows = tnum[wid] // n
        for b in range(batch):
            tok = tokens[b * tok_cols + step[b]]
            if tok < 0 or tok >= rows:  # never read outside the table: stop the run with an error instead
                flags[ERR_VALUE] = tok
                flags[ERR_ROW] = b
                flags[ERROR] = ERR_TOKEN
                atomic_store(flags, STOP, 1)
                continue
            if tdt[wid] == F32:
                src = f32s(addr[wid], tnum[wid])
                for i in range(cols):
                    out[b * n + n0 + i] = src[tok * n + n0 + i]
            else:
                xs = scratch[:cols]
                linear_widen(addr[wid], tdt[wid], tok * n + n0, cols, xs)
                for i in range(cols):
                    out[b * n + n0 + i] = xs[i]
    elif kind == RMSLIN:
        x = f32s(addr[lp[layer, 2]], batch * k)
        g = f32s(addr[lp[layer, 4]], k)
        xs = scratch[:batch * k]
        eps = lf[layer, 0]
        for b in range(batch):
            ss = np.float32(0)
            for i in range(k):
                v = x[b * k + i]
                ss = rfma(ss, v, v)
            inv = np.float32(1.0) / math.sqrt(ss / np.float32(k) + np.float32(eps))
            for i in range(k):
                xs[b * k + i] = x[b * k + i] * inv * g[i]
        bias = f32s(addr[lp[layer, 5]], n) if lp[layer, 5] >= 0 else none
        linear(xs, batch, k, addr[lp[layer, 3]], tdt[lp[layer, 3]], n0, n0 + cols, out, n, none, bias)
    elif kind == LINRES:
        x = f32s(addr[lp[layer, 2]], batch * k)
        res = f32s(addr[lp[layer, 4]], batch * n)
        linear(x, batch, k, addr[lp[layer, 3]], tdt[lp[layer, 3]], n0, n0 + cols, out, n, res, none)
    elif kind == SILURES:
        gu = f32s(addr[lp[layer, 2]], batch * 2 * k)
        res = f32s(addr[lp[layer, 4]], batch * n)
        xs = scratch[:batch * k]
        for b in range(batch):
            for i in range(k):
                a = gu[b * 2 * k + i]
                xs[b * k + i] = fsilu(a) * gu[b * 2 * k + k + i]
        linear(xs, batch, k, addr[lp[layer, 3]], tdt[lp[layer, 3]], n0, n0 + cols, out, n, res, none)
    else:  # ATTN
        kv_heads, group, d, seq = lp[layer, 10], lp[layer, 11], lp[layer, 12], lp[layer, 13]
        b = t // kv_heads
        g = t - b * kv_heads
        qkv = f32s(addr[lp[layer, 2]], tnum[lp[layer, 2]])
        kc = f32s(addr[lp[layer, 3]], tnum[lp[layer, 3]])
        vc = f32s(addr[lp[layer, 4]], tnum[lp[layer, 4]])
        cos = f32s(addr[lp[layer, 5]], tnum[lp[layer, 5]])
        sin = f32s(addr[lp[layer, 6]], tnum[lp[layer, 6]])
        attention(qkv, b, g, group, d, step[b], kc, vc, seq, kv_heads, cos, sin, out, n, scratch)


@njit(**OPTS)
def linear_widen(address, dtype, start, count, dst):  # type: ignore[no-untyped-def]
    for i in range(count):
        dst[i] = load(address, start + i, dtype)


@njit(**OPTS)
def complete(task, ctl, counts, trigger, ev_ptr, ev_list, ev_q):  # type: ignore[no-untyped-def]
    for j in range(ev_ptr[task], ev_ptr[task + 1]):
        e = ev_list[j]
        if atomic_add(counts, e, 1) == trigger[e] - 1:
            atomic_store(ev_q, atomic_add(ctl, 3, 1), e)


@njit(**OPTS)
def release(e, ctl, pending, gate_ptr, gate_list, task_q):  # type: ignore[no-untyped-def]
    for j in range(gate_ptr[e], gate_ptr[e + 1]):
        g = gate_list[j]
        if atomic_add(pending, g, -1) == 1:
            atomic_store(task_q, atomic_add(ctl, 1, 1), g)


@njit(**OPTS)
def run_role(w, is_sched, ctl, task_q, ev_q, pending, counts, trigger, ev_ptr, ev_list, gate_ptr, gate_list,
             addr, tdt, tnum, lp, lf, task_layer, task_index, batch, scratch, step, tokens, tok_cols, none,
             flags, profile, profiling):  # type: ignore[no-untyped-def]
    n_tasks = task_q.shape[0]
    n_events = trigger.shape[0]
    atomic_add(ctl, 4 + is_sched, 1)
    mine_t = -1
    mine_e = -1
    while True:
        if atomic_load(flags, STOP) != 0:
            break  # the step is abandoned; decode() does not commit it
        if mine_t < 0 and (is_sched == 0 or atomic_load(ctl, 4) == 0) and atomic_load(ctl, 0) < n_tasks:
            slot = atomic_add(ctl, 0, 1)
            if slot < n_tasks:
                mine_t = slot
        if mine_t >= 0:
            task = atomic_load(task_q, mine_t)
            if task >= 0:
                start = cycle_counter()
                execute(task, w, addr, tdt, tnum, lp, lf, task_layer, task_index, batch, scratch, step, tokens,
                        tok_cols, none, flags)
                if profiling:
                    profile[3 * task] = start
                    profile[3 * task + 1] = cycle_counter()
                    profile[3 * task + 2] = w
                complete(task, ctl, counts, trigger, ev_ptr, ev_list, ev_q)
                mine_t = -1
        if mine_e < 0 and (is_sched == 1 or atomic_load(ctl, 5) == 0) and atomic_load(ctl, 2) < n_events:
            slot = atomic_add(ctl, 2, 1)
            if slot < n_events:
                mine_e = slot
        if mine_e >= 0:
            e = atomic_load(ev_q, mine_e)
            if e >= 0:
                release(e, ctl, pending, gate_ptr, gate_list, task_q)
                mine_e = -1
        if mine_t < 0 and mine_e < 0 and atomic_load(ctl, 0) >= n_tasks and atomic_load(ctl, 2) >= n_events:
            break
    atomic_add(ctl, 4 + is_sched, -1)


@njit(parallel=True, fastmath=OPTS["fastmath"], error_model="numpy", nogil=True, cache=True)
def decode(addr, tdt, tnum, lp, lf, task_layer, task_index, ev_ptr, ev_list, waits, trigger, gate_ptr, gate_list,
           n_workers, n_sched, max_steps, eos, max_seq, batch, tokens_id, tok_cols, step_id, pick_id,
           scratch, scr, profile, steps_run, flags):  # type: ignore[no-untyped-def]
    n_tasks = task_layer.shape[0]
    n_events = trigger.shape[0]
    task_q = np.empty(n_tasks, np.int64)
    ev_q = np.empty(max(n_events, 1), np.int64)
    pending = np.empty(n_tasks, np.int64)
    counts = np.empty(max(n_events, 1), np.int64)
    ctl = np.zeros(8, np.int64)
    tokens = i64s(addr[tokens_id], batch * tok_cols)
    step = i64s(addr[step_id], batch)
    picked = i64s(addr[pick_id], batch)
    none = np.empty(0, np.float32)
    active = np.zeros(batch, np.bool_)
    steps = 0
    while steps < max_steps and atomic_load(flags, STOP) == 0:
        alive = 0
        for b in range(batch):
            ok = step[b] + 1 < max_seq
            tok = tokens[b * tok_cols + step[b]]
            for e in eos:
                if tok == e:
                    ok = False
            active[b] = ok
            alive += ok
        if alive == 0:
            break
        task_q[:] = -1
        ev_q[:] = -1
        counts[:] = 0
        ctl[:] = 0
        for t in range(n_tasks):
            pending[t] = waits[t]
            if waits[t] == 0:
                task_q[ctl[1]] = t
                ctl[1] += 1
        profiling = profile.shape[0] > 0 and steps == 0
        total = n_workers + n_sched
        for w in prange(total):
            run_role(w, 1 if w >= n_workers else 0, ctl, task_q, ev_q, pending, counts, trigger, ev_ptr, ev_list,
                     gate_ptr, gate_list, addr, tdt, tnum, lp, lf, task_layer, task_index, batch,
                     scratch[w * scr:(w + 1) * scr], step, tokens, tok_cols, none, flags, profile, profiling)
        if atomic_load(flags, STOP) != 0:
            break
        for b in range(batch):
            if active[b]:
                tokens[b * tok_cols + step[b] + 1] = picked[b]
                step[b] += 1
        steps += 1
        steps_run[0] += 1
    return steps


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    flat = np.array([v for x in lists for v in x], np.int64)
    return ptr, flat


class CPUPersistentRuntime:
    """Lays the PersistentKernel's tensors and task graph out as arrays for ``decode``."""

    def __init__(self, pk: Any, config: dict[str, int]) -> None:
        import torch

        from yirage.errors import NotSupportedError

        graph = pk.task_graph
        self.pk, self.config = pk, config
        if pk.tokens.dtype != torch.int64 or pk.step.dtype != torch.int64:
            raise NotSupportedError("the CPU PersistentKernel runtime needs int64 step and tokens tensors; "
                                    "create them with dtype=torch.int64")
        self.keep: list[Any] = []
        names = list(pk.tensors)
        addr, tdt, tnum = [], [], []
        for name in names:
            t = pk.tensors[name]
            if t.attached:
                value = pk.torch_tensors[name]
                if value.dim() == 1 and value.dtype != torch.float32:
                    value = value.float()  # norms and biases: tiny, read once per task
            else:  # device="cpu": an ambient torch.device("meta") context must not move the kernel's memory
                value = torch.zeros(t.dims, dtype=torch.int64 if t.dtype.startswith("int") else torch.float32,
                                    device="cpu")
            if str(value.dtype).removeprefix("torch.") not in DTYPES:
                raise NotSupportedError(f"tensor {name!r} has dtype {value.dtype}, which the CPU runtime cannot read")
            if value is not pk.torch_tensors.get(name):  # made here: the same checks as the user's tensors
                check_tensor(value, f"the CPU runtime's buffer for {name!r}", "cpu", written=not t.attached)
            self.keep.append(value)
            addr.append(value.data_ptr())
            tdt.append(DTYPES[str(value.dtype).removeprefix("torch.")])
            tnum.append(value.numel())
        self.values = dict(zip(names, self.keep, strict=True))
        index = {name: i for i, name in enumerate(names)}
        self.addr, self.tdt, self.tnum = (np.array(v, np.int64) for v in (addr, tdt, tnum))
        self.lp = np.full((len(pk.layers), 16), -1, np.int64)
        self.lf = np.zeros((len(pk.layers), 4), np.float64)
        scratch = 1
        for layer in pk.layers:
            row, ins = self.lp[layer.index], layer.inputs
            row[0], row[1], row[9] = KINDS[layer.kind], index[layer.output.name], layer.tasks
            row[8] = layer.output.dims[1]
            roles = {"embed": ("input", "weight"), "rmsnorm_linear": ("input", "weight_linear", "weight_norm", "bias"),
                     "linear_with_residual": ("input", "weight", "residual"),
                     "silu_mul_linear_with_residual": ("input", "weight", "residual"),
                     "attention": ("input", "k_cache", "v_cache", "cos", "sin"),
                     "argmax": ("input",), "sample": ("input",)}[layer.kind]
            for col, role in zip((2, 3, 4, 5, 6), roles, strict=False):
                if role in ins:
                    row[col] = index[ins[role].name]
            if layer.kind in ("rmsnorm_linear", "linear_with_residual"):
                row[7] = ins["input"].dims[1]
            elif layer.kind == "silu_mul_linear_with_residual":
                row[7] = ins["input"].dims[1] // 2
            elif layer.kind in ("argmax", "sample"):
                row[7] = ins["input"].dims[1]
            if layer.kind == "attention":
                p = layer.params
                row[10], row[11], row[12], row[13] = p["kv_heads"], p["group"], p["head_dim"], ins["k_cache"].dims[2]
                scratch = max(scratch, p["head_dim"] + ins["k_cache"].dims[2])
            else:
                scratch = max(scratch, pk.batch * max(int(row[7]), 1), int(row[8]))
            if layer.kind == "sample":
                row[14], row[15] = layer.params["top_k"], layer.params["seed"]
                self.lf[layer.index, 1], self.lf[layer.index, 2] = layer.params["temperature"], layer.params["top_p"]
            self.lf[layer.index, 0] = layer.params.get("eps", 0.0)
        self.graph_arrays = (
            np.array(graph.task_layer, np.int64), np.array(graph.task_index, np.int64), *_csr(graph.task_events),
            np.array(graph.task_waits, np.int64), np.array(graph.event_trigger, np.int64), *_csr(graph.event_gates),
        )
        self.workers = int(config["num_workers"])
        self.schedulers = int(config["num_local_schedulers"])
        self.scr = scratch
        self.scratch = np.zeros(max(1, self.workers + self.schedulers) * scratch, np.float32)
        self.ids = (index["tokens"], pk.tokens.shape[1], self._step_id(index), index[pk.layers[-1].output.name])
        self.steps_run = np.zeros(1, np.int64)
        self.flags = np.zeros(4, np.int64)  # STOP, ERROR, ERR_VALUE, ERR_ROW (see the module docstring)
        self.last_profile: np.ndarray | None = None
        # every address in the table, re-checked before each run (the kernel checks the user's tensors too)
        self.snapshot = Snapshot([*zip([*names, "step"], self.keep, strict=True)])

    def _step_id(self, index: dict[str, int]) -> int:
        """The step meta tensor is not a named PK tensor: give the kernel its address."""
        self.keep.append(self.pk.step)
        self.addr = np.append(self.addr, self.pk.step.data_ptr())
        self.tdt = np.append(self.tdt, I64)
        self.tnum = np.append(self.tnum, self.pk.step.numel())
        return len(self.addr) - 1

    def value(self, name: str) -> Any:
        return self.values[name]

    def stop(self) -> None:
        """Ask the decode in flight to stop between tasks (committed steps stay in tokens/step)."""
        self.flags[STOP] = 1

    def effective(self) -> tuple[int, int, int]:
        """(threads, workers, schedulers) actually run: one thread each, capped at numba's threads.

        Schedulers only move released tasks to the queue; with fewer threads
        than asked for, at least one thread stays a worker.
        """
        threads = max(1, min(self.workers + self.schedulers, numba.config.NUMBA_NUM_THREADS))
        share = round(threads * self.schedulers / (self.workers + self.schedulers))
        schedulers = min(share if self.schedulers else 0, threads // 2)  # at least half the threads work
        return threads, threads - schedulers, schedulers

    def run(self, max_new_tokens: int | None = None) -> int:
        """Decode (see PersistentKernel.__call__); the caller serializes calls (the kernel's lock).

        From the main thread, ``decode`` runs in a helper thread (it holds no
        GIL) while this thread waits in short slices, so Ctrl-C stops the run
        between tasks and raises KeyboardInterrupt here within milliseconds.
        """
        pk = self.pk
        self.snapshot.verify()
        profile = np.zeros(0, np.int64)
        if pk.profiler_tensor is not None:
            profile = np.zeros(3 * pk.task_graph.num_tasks, np.int64)
        threads, workers, schedulers = self.effective()
        tokens_id, tok_cols, step_id, pick_id = self.ids
        limit = pk.max_seq_length if max_new_tokens is None else int(max_new_tokens)
        self.flags[:] = 0
        args = (self.addr, self.tdt, self.tnum, self.lp, self.lf, *self.graph_arrays, workers, schedulers, limit,
                np.array(pk.eos_token_ids or [-1], np.int64), pk.max_seq_length, pk.batch, tokens_id, tok_cols,
                step_id, pick_id, self.scratch, self.scr, profile, self.steps_run, self.flags)
        check_fork()
        # registered while in flight: if the main thread dies (Ctrl-C), the exit hook stops this decode
        with shutdown.decoding(self), serialized():  # serialized: only on a threading layer that needs it
            wall = time.perf_counter_ns()
            cycles = _cycles()
            if threading.current_thread() is threading.main_thread():
                steps = _decode_interruptibly(threads, args, self.flags)
            else:  # signals reach only the main thread: Ctrl-C there reaches this run through the exit hook
                steps = _decode_with_threads(threads, args)
        ns_per_cycle = (time.perf_counter_ns() - wall) / max(1, _cycles() - cycles)
        if self.flags[ERROR] == ERR_TOKEN:
            from yirage.persistent.layers import LayerError

            row, tok = int(self.flags[ERR_ROW]), int(self.flags[ERR_VALUE])
            raise LayerError(f"tokens[{row}, step[{row}]] = {tok} is not a row of the embed table; decoding stopped "
                             "before reading it (tokens/step hold the steps completed). Keep token ids within the "
                             "embed table (the picker's logits must not be wider than it)")
        if self.flags[STOP]:
            shutdown.check_not_stopped()  # stopped by the exit hook: an incomplete result is an error
        if profile.shape[0]:
            starts = profile[0::3]
            origin = int(starts[starts > 0].min()) if (starts > 0).any() else 0
            out = pk.profiler_tensor.view(-1)
            n = pk.task_graph.num_tasks
            for task in range(min(n, out.numel() // 3)):
                out[3 * task] = int((profile[3 * task] - origin) * ns_per_cycle)
                out[3 * task + 1] = int((profile[3 * task + 1] - origin) * ns_per_cycle)
                out[3 * task + 2] = int(profile[3 * task + 2])
        return int(steps)


def _decode_with_threads(threads: int, args: tuple[Any, ...]) -> int:
    """``decode`` on ``threads`` numba threads (numba's thread count is per calling thread)."""
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        return int(decode(*args))
    finally:
        numba.set_num_threads(previous)


class _Job:
    def __init__(self, threads: int, args: tuple[Any, ...]) -> None:
        self.threads, self.args = threads, args
        self.done = threading.Event()
        self.steps = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.steps = _decode_with_threads(self.threads, self.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which re-raises it
            self.error = exc
        finally:
            self.done.set()

    def wait(self) -> None:
        """Wait until the job ends, even through further Ctrl-C presses: its memory must outlive it."""
        while not self.done.is_set():
            try:
                self.done.wait(0.05)
            except KeyboardInterrupt:
                continue  # already stopping; the first KeyboardInterrupt is re-raised by the caller


class _Helper:
    """One long-lived thread that runs ``decode`` for the main thread (a new one per call costs ~0.25 ms).

    Re-created in a forked child (threads do not survive fork). Only the
    main thread submits, and it waits for each job, so one thread suffices.
    """

    def __init__(self) -> None:
        self.pid = -1
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()

    def submit(self, job: _Job) -> None:
        if self.pid != os.getpid():
            self.pid, self.jobs = os.getpid(), queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self.jobs,), name="yirage-pk-decode", daemon=True).start()
        self.jobs.put(job)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
        while True:
            jobs.get().run()


_HELPER = _Helper()


def _decode_interruptibly(threads: int, args: tuple[Any, ...], flags: np.ndarray) -> int:
    """``decode`` in the helper thread; on KeyboardInterrupt set ``flags[STOP]``, wait for it, re-raise."""
    job = _Job(threads, args)
    _HELPER.submit(job)
    try:
        while not job.done.wait(0.05):
            pass
    except KeyboardInterrupt:
        flags[STOP] = 1  # every decode thread checks it between tasks, so the wait below is short
        job.wait()
        raise
    if job.error is not None:
        raise job.error
    return job.steps


@njit(cache=True)
def _cycles():  # type: ignore[no-untyped-def]
    return cycle_counter()


tie_caches_to_sources(globals())  # after every cached function above is defined
