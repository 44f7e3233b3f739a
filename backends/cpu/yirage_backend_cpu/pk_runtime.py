"""The CPU PersistentKernel runtime: the whole generation in one nogil numba call.

``num_workers + num_local_schedulers`` loop iterations of one ``prange`` run
every step, meeting at a barrier between steps (pk_team). Workers claim
slots of a task queue (atomic fetch-add), wait for the slot to be filled
with a ready task, run it, and count its events down;
the task that completes an event pushes it onto the event queue. Schedulers
claim event slots and push the tasks the event releases; a thread with
nothing ready spins, then yields its core, then sleeps (backoff.py). A scheduler runs
tasks only while no worker is running (and a worker handles events only
while no scheduler is), which keeps any thread count deadlock-free. Between
steps, one serial section (run by the last thread at the barrier) appends the
picked token and advances ``step``.

``flags`` (the control buffer's header: yirage.persistent.control) lets the
run stop early: ``flags[STOP]`` is checked by
every thread between tasks and by the loop between steps (Ctrl-C sets it
from Python, for a non-main thread through yirage.persistent.shutdown; a
task that finds bad input sets it too, with an error code in ``flags[ERROR]``
that ``run()`` turns into an exception). A stopped step is
not committed: ``tokens``/``step`` hold exactly the steps completed.

A multi-rank kernel's collective layers (all-reduce, all-gather) are tasks
too: their body hands the layer to a communication thread and waits for it
(pk_comm); a failed collective stops the run and ``run()`` raises its error.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numba
import numpy as np
from numba import njit, prange

from yirage.backend.runtime_contract import PERSISTENT
from yirage.errors import NotSupportedError
from yirage.log import working
from yirage.persistent import shutdown
from yirage.persistent.guard import Snapshot, check_tensor, token_out_of_range
from yirage.persistent.program import PersistentProgram
from yirage.persistent.specs import FloatCol, IntCol
from yirage_backend_cpu.atomics import atomic_add, atomic_load, atomic_store, cycle_counter
from yirage_backend_cpu.pk_calls import call_decode
from yirage_backend_cpu.pk_comm import ERR_COMM, ERR_PIPE, FLAG_SLOTS, Communicator
from yirage_backend_cpu.pk_entry import (
    COMPILING,
    ENTRY_COUNT,
    FLOAT_ATTENTION_ENTRY,
    LINEAR_ENTRY,
    NARROW_ATTENTION_ENTRY,
    QUANT_ENTRY,
    SAMPLE_ENTRY,
    compile_ahead,
    compiled,
    pending,
    task_frame,
    wait_ahead,
)
from yirage_backend_cpu.pk_quant import (
    Q4_0,
    Q4_0G,
    Q4_BYTES,
    Q8_0,
    Q8_0G,
    Q8_BYTES,
    dtype_code,
    is_quantized,
    quantized_entry,
)
from yirage_backend_cpu.pk_split import attention_chunks, expand, fold_profile
from yirage_backend_cpu.pk_tasks import (
    ATT_KC,
    ATTN,
    BF16,
    C_ARRIVED,
    C_CHUNKS,
    C_GROUP,
    C_HEAD_DIM,
    C_K,
    C_KIND,
    C_N,
    C_PARTS,
    C_SEQ,
    C_TASKS,
    ERR_ROW,
    ERR_TOKEN,
    ERR_VALUE,
    ERROR,
    F16,
    F32,
    I64,
    LINEAR_WEIGHTS,
    OPTS,
    RUNTIME_COLUMNS,
    SAMPLE,
    SCR_NORM,
    SCREEN,
    STOP,
    TASKS,
    check_compiled_layout,
    execute_entry,
    float_attention_entry,
    i64s,
    linear_blocks_entry,
    linear_entry,
    narrow_attention_entry,
    pick_rows,
    sample_entry,
)
from yirage_backend_cpu.pk_team import (
    ABORT,
    ARRIVED,
    DONE,
    GEN,
    GO,
    SLEEPS,
    STATE,
    STEPS,
    YIELDS,
    begin_step,
    end_step,
    gather,
    pause,
    wait_for_next,
)
from yirage_backend_cpu.quant_group import GROUP
from yirage_backend_cpu.repacked import grouped
from yirage_backend_cpu.sources import tie_caches_to_sources
from yirage_backend_cpu.threads import check_fork, serialized

DTYPES = {"float32": F32, "bfloat16": BF16, "float16": F16, "int64": I64, "q8_0": Q8_0, "q4_0": Q4_0}
QUANTIZED = {"q8_0": Q8_BYTES, "q4_0": Q4_BYTES}  # bytes per block of 32 values


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
             entry, frame, scratch, flags, profile, profiling):  # type: ignore[no-untyped-def]
    n_tasks = task_q.shape[0]
    n_events = trigger.shape[0]
    atomic_add(ctl, 4 + is_sched, 1)
    mine_t = -1
    mine_e = -1
    idle_since = 0  # cycle counter when this thread last found nothing to run (0: it just ran something)
    while True:
        busy = False
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
                entry(task, w, np.int64(frame.ctypes.data), np.int64(scratch.ctypes.data), scratch.shape[0])
                if profiling:
                    profile[3 * task] = start
                    profile[3 * task + 1] = cycle_counter()
                    profile[3 * task + 2] = w
                complete(task, ctl, counts, trigger, ev_ptr, ev_list, ev_q)
                mine_t = -1
                busy = True
        if mine_e < 0 and (is_sched == 1 or atomic_load(ctl, 5) == 0) and atomic_load(ctl, 2) < n_events:
            slot = atomic_add(ctl, 2, 1)
            if slot < n_events:
                mine_e = slot
        if mine_e >= 0:
            e = atomic_load(ev_q, mine_e)
            if e >= 0:
                release(e, ctl, pending, gate_ptr, gate_list, task_q)
                mine_e = -1
                busy = True
        if mine_t < 0 and mine_e < 0 and atomic_load(ctl, 0) >= n_tasks and atomic_load(ctl, 2) >= n_events:
            break
        if busy:
            idle_since = 0
            continue
        idle_since, counter = pause(idle_since)  # nothing ready: spin, then yield the core, then sleep (backoff.py)
        if counter:
            atomic_add(flags, counter, 1)
    atomic_add(ctl, 4 + is_sched, -1)


@njit(**OPTS)
def member(w, total, n_workers, sync, ctl, task_q, ev_q, pending, counts, waits, trigger, ev_ptr, ev_list, gate_ptr,
           gate_list, entry, frame, scratch, batch, step, tokens, tok_cols, flags, profile, picked, active, eos,
           max_seq, max_steps, steps_run, single):  # type: ignore[no-untyped-def]
    """Thread ``w`` of the team for every step of the run (pk_team): its role, then the barrier; the last thread
    to arrive runs the serial section and opens the next step. ``single``: its role in the current step only
    (decode's fallback, one parallel region per step, after the team could not gather)."""
    if single:
        run_role(w, 1 if w >= n_workers else 0, ctl, task_q, ev_q, pending, counts, trigger, ev_ptr, ev_list,
                 gate_ptr, gate_list, entry, frame, scratch, flags, profile,
                 profile.shape[0] > 0 and atomic_load(sync, STEPS) == 0)
        return
    if gather(sync, total, flags) != GO:
        return  # decode() runs the steps one region at a time instead
    gen = np.int64(0)
    while True:
        run_role(w, 1 if w >= n_workers else 0, ctl, task_q, ev_q, pending, counts, trigger, ev_ptr, ev_list,
                 gate_ptr, gate_list, entry, frame, scratch, flags, profile,
                 profile.shape[0] > 0 and atomic_load(sync, STEPS) == 0)
        if atomic_add(sync, ARRIVED, 1) == total - 1:
            atomic_store(sync, ARRIVED, 0)
            more = end_step(sync, flags, batch, tokens, tok_cols, step, picked, active, steps_run) == 1 \
                and atomic_load(sync, STEPS) < max_steps and atomic_load(flags, STOP) == 0 \
                and begin_step(waits, task_q, ev_q, pending, counts, ctl, eos, max_seq, batch, tokens, tok_cols,
                               step, active) == 1
            if not more:
                atomic_store(sync, DONE, 1)
            atomic_store(sync, GEN, gen + 1)  # releases the waiting threads into the next step (or out)
        else:
            wait_for_next(sync, gen, flags)
        gen += 1
        if atomic_load(sync, DONE) != 0:
            return


#: numba's parallel options with only ``prange`` on: decode's np.zeros calls would each become a parallel region of
#: their own (3 of its 4), waking the thread pool three more times per call for arrays of a few elements
PRANGE_ONLY = {"comprehension": False, "reduction": False, "inplace_binop": False, "setitem": False, "numpy": False,
               "stencil": False, "fusion": False, "prange": True}


@njit(parallel=PRANGE_ONLY, fastmath=OPTS["fastmath"], error_model="numpy", nogil=True, cache=True)
def decode(addr, tdt, tnum, lp, lf, task_layer, task_index, ev_ptr, ev_list, waits, trigger, gate_ptr, gate_list,
           n_workers, n_sched, max_steps, eos, max_seq, batch, tokens_id, tok_cols, step_id, pick_id,
           scratch, scr, profile, steps_run, flags, entry, entries):  # type: ignore[no-untyped-def]
    """The run: one team of threads for every step; each task goes through ``entry`` (pk_entry: the task bodies
    are compiled once, behind a C entry point, not into this loop); ``entries``: the addresses of the bodies
    compiled apart (pk_entry.ENTRY_COUNT of them, 0 where the model needs none). One parallel region in the
    code, run once for the team, or once per step where the team could not gather: a second region would
    compile the threads' code a second time (1-2 s on a cold cache)."""
    n_tasks = task_layer.shape[0]
    n_events = trigger.shape[0]
    task_q = np.empty(n_tasks, np.int64)
    ev_q = np.empty(max(n_events, 1), np.int64)
    pending = np.empty(n_tasks, np.int64)
    counts = np.empty(max(n_events, 1), np.int64)
    ctl = np.zeros(8, np.int64)  # the step's queue counters (claimed / filled slots, running roles); not ``flags``
    sync = np.zeros(8, np.int64)
    tokens = i64s(addr[tokens_id], batch * tok_cols)
    step = i64s(addr[step_id], batch)
    picked = i64s(addr[pick_id], batch)
    frame = task_frame(addr, tdt, tnum, lp, lf, task_layer, task_index, batch, step, tokens, tok_cols, flags,
                       entries)
    active = np.zeros(batch, np.bool_)
    if max_steps <= 0 or atomic_load(flags, STOP) != 0 or begin_step(
            waits, task_q, ev_q, pending, counts, ctl, eos, max_seq, batch, tokens, tok_cols, step, active) == 0:
        return 0
    total = n_workers + n_sched
    single = False  # the team first (pk_team); after an ABORT, one region per step
    while True:
        for w in prange(total):
            member(np.int64(w), total, n_workers, sync, ctl, task_q, ev_q, pending, counts, waits, trigger, ev_ptr,
                   ev_list, gate_ptr, gate_list, entry, frame, scratch[w * scr:(w + 1) * scr], batch, step, tokens,
                   tok_cols, flags, profile, picked, active, eos, max_seq, max_steps, steps_run, single)
        # sync is read through atomic loads after the region: numba's parfor pass moved plain reads of it (an
        # array it does not see written in the loop body, only passed to a call) to before the region
        if not single:
            if atomic_load(sync, STATE) != ABORT:
                break  # the team ran every step
            single = True  # the threads did not all run at once: the step begun above runs next, alone
            continue
        if end_step(sync, flags, batch, tokens, tok_cols, step, picked, active, steps_run) == 0 \
                or atomic_load(sync, STEPS) >= max_steps or atomic_load(flags, STOP) != 0 or begin_step(
                    waits, task_q, ev_q, pending, counts, ctl, eos, max_seq, batch, tokens, tok_cols, step,
                    active) == 0:
            break
    return atomic_load(sync, STEPS)


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    flat = np.array([v for x in lists for v in x], np.int64)
    return ptr, flat


class CPUPersistentRuntime:
    """Lays the frozen program's tensors, descriptors and task graph out as arrays for ``decode``.

    ``PERSISTENT``: it honours ``num_workers`` and ``num_local_schedulers`` (capped at numba's threads).
    """

    kind = PERSISTENT

    def __init__(self, program: PersistentProgram, config: dict[str, int]) -> None:
        import torch

        check_compiled_layout(globals())
        graph = program.task_graph
        self.program, self.config = program, config
        if program.tokens.dtype != torch.int64 or program.step.dtype != torch.int64:
            raise NotSupportedError("the CPU PersistentKernel runtime needs int64 step and tokens tensors; "
                                    "create them with dtype=torch.int64")
        TASKS.require(layer.kind for layer in program.layers)
        self.keep: list[Any] = []
        # buffers made here from the user's tensors (float copies of norms, Q4_0 repacked in 8-row groups):
        # remade before a run when torch's version counter says the source changed in place
        self.derived: list[list[Any]] = []
        names = [t.name for t in program.tensors]  # position = PKTensor.index, the numbers descriptors hold
        addr, tdt, tnum = [], [], []
        for t in program.tensors:
            if t.attached:
                value = program.values[t.name]
                if value.dim() == 1 and value.dtype != torch.float32:
                    value = self._derive(t.name, value, torch.Tensor.float)  # norms and biases: tiny
            else:  # device="cpu": an ambient torch.device("meta") context must not move the kernel's memory
                value = torch.zeros(t.dims, dtype=torch.int64 if t.dtype.startswith("int") else torch.float32,
                                    device="cpu")
            dtype = t.dtype if t.dtype in QUANTIZED else str(value.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise NotSupportedError(f"tensor {t.name!r} has dtype {value.dtype}, which the CPU runtime cannot "
                                        "read")
            if dtype in QUANTIZED and (value.dtype != torch.uint8 or value.numel() != t.dims[0] * t.dims[1] // 32
                                       * QUANTIZED[dtype]):  # the PKTensor came from a QuantizedTensor; re-check
                raise NotSupportedError(f"tensor {t.name!r}: {dtype} blocks of {t.dims} must be "
                                        f"{t.dims[0] * t.dims[1] // 32 * QUANTIZED[dtype]} uint8 bytes, got "
                                        f"{value.numel()} {value.dtype}")
            code = dtype_code(dtype, value) if dtype in QUANTIZED else DTYPES[dtype]
            if code in (Q4_0, Q8_0) and t.dims[0] % GROUP == 0:  # one pass reads 8 rows (quant_group)
                q8, code = code == Q8_0, Q8_0G if code == Q8_0 else Q4_0G
                value = self._derive(t.name, value, lambda src, rows=t.dims[0], q8=q8: grouped(src, rows, q8))
            if value is not program.values.get(t.name):  # made here: the same checks as the user's tensors
                check_tensor(value, f"the CPU runtime's buffer for {t.name!r}", "cpu", written=not t.attached)
            self.keep.append(value)
            addr.append(value.data_ptr())
            tdt.append(code)
            tnum.append(value.numel())
        self.values = dict(zip(names, self.keep, strict=True))
        self.addr, self.tdt, self.tnum = (np.array(v, np.int64) for v in (addr, tdt, tnum))
        # the core encoder's rows, copied: decode reads them, and the program stays untouched
        self.lp = np.full((len(program.layers), len(IntCol) + RUNTIME_COLUMNS), -1, np.int64)
        self.lp[:, :len(IntCol)] = np.array(program.descriptors.ints, np.int64).reshape(len(program.layers),
                                                                                         len(IntCol))
        self.lp[:, C_CHUNKS] = 1
        self.lf = np.array(program.descriptors.floats, np.float64).reshape(len(program.layers), len(FloatCol))
        scratch = 1
        for row in self.lp:
            if row[C_KIND] == ATTN:  # per query head of a group: its rotated query, a score per cached position
                # and the softmax's sum; then the rotated new key (pk_tasks.attention)
                scratch = max(scratch, int(row[C_GROUP]) * int(row[C_HEAD_DIM] + row[C_SEQ] + 1)
                              + int(row[C_HEAD_DIM]))
            else:  # the normalized / gated input rows and a quantized GEMV's work space, or an embed row
                scratch = max(scratch, 2 * program.batch * max(int(row[C_K]), 1), int(row[C_N]))
            if row[C_KIND] == SCREEN:  # its normalized hidden row (pk_tasks.screened_rows)
                scratch = max(scratch, int(self.tnum[row[SCR_NORM]]) + 1)
        self.workers = int(config["num_workers"])
        self.schedulers = int(config["num_local_schedulers"])
        self.ids = (program.tokens_id, program.tokens.shape[1], self._step_id(), program.pick_id)
        chunks = self._split_attention()
        expanded = expand(graph.task_layer, graph.task_index, graph.task_events, graph.task_waits,
                          graph.event_trigger, graph.event_gates, chunks)
        self.task_origin = expanded.origin
        self.graph_arrays = (expanded.task_layer, expanded.task_index, *_csr(expanded.task_events),
                             expanded.task_waits, expanded.event_trigger, *_csr(expanded.event_gates))
        self.scr = scratch
        self.scratch = np.zeros(max(1, self.workers + self.schedulers) * scratch, np.float32)
        self.steps_run = np.zeros(1, np.int64)
        # the control buffer's header (yirage.persistent.control: STOP, ERROR, ERR_ROW, ERR_VALUE; its spares
        # YIELDS, SLEEPS), then pk_comm's line; the row flags live in decode's own ``active`` array
        self.flags = np.zeros(FLAG_SLOTS, np.int64)
        # the communication thread of a multi-rank kernel (collective layers), None for one rank
        self.comm = Communicator(program, self.values) if any(
            layer.spec.collective is not None for layer in program.layers) else None
        if self.comm is not None:
            weakref.finalize(self, self.comm.close)
        self.last_comm = {"calls": 0, "comm_s": 0.0, "decode_s": 0.0}  # of the last run: the communication share
        self.last_profile: np.ndarray | None = None
        self.entries: np.ndarray | None = None  # _entries(), on the first run
        self.ahead_asked = False  # compiling() has started what it needs compiled
        self.last_backoff = {"yields": 0, "sleeps": 0}  # of the last run: idle threads that gave their core away
        # every address in the table, re-checked before each run (the kernel checks the user's tensors too)
        self.snapshot = Snapshot([*zip([*names, "step"], self.keep, strict=True)])

    def _derive(self, name: str, source: Any, make: Any) -> Any:
        target = make(source)
        self.derived.append([name, source, source._version, target, make])
        return target

    def refresh_derived(self) -> None:
        """Remake the buffers whose source torch changed in place since (weights updated between runs)."""
        for entry in self.derived:
            name, source, version, target, make = entry
            if source._version == version:
                continue
            fresh = make(source)
            if fresh.shape != target.shape or fresh.dtype != target.dtype:
                raise NotSupportedError(f"tensor {name!r} changed shape or dtype after the PersistentKernel was "
                                        "built; build a new PersistentKernel with the new tensor")
            target.copy_(fresh)
            entry[2] = source._version

    def _step_id(self) -> int:
        """The step meta tensor is not a named PK tensor: give the kernel its address."""
        self.keep.append(self.program.step)
        return self._add_address(self.program.step, I64)

    def _add_address(self, value: Any, code: int) -> int:
        """Put a runtime-owned buffer in the address table (kept alive by the caller); returns its index."""
        self.addr = np.append(self.addr, value.data_ptr())
        self.tdt = np.append(self.tdt, code)
        self.tnum = np.append(self.tnum, value.numel())
        return len(self.addr) - 1

    def _split_attention(self) -> dict[int, int]:
        """Chunks per KV head for each attention layer (pk_split), with the buffers its chunks meet in: partial
        sums (group * (head_dim + 2) floats per chunk) and an arrival count per KV head. Returns layer -> chunks
        for the layers split."""
        import torch

        workers = self.effective()[1]
        split: dict[int, int] = {}
        self.split_buffers: list[Any] = []
        for layer, row in enumerate(self.lp):
            if row[C_KIND] != ATTN:
                continue
            chunks = attention_chunks(int(row[C_TASKS]), workers, int(row[C_SEQ]))
            if chunks == 1:
                continue
            heads = int(row[C_TASKS])
            parts = torch.zeros(heads * chunks * int(row[C_GROUP]) * (int(row[C_HEAD_DIM]) + 2), dtype=torch.float32)
            arrived = torch.zeros(heads, dtype=torch.int64)
            self.split_buffers += [parts, arrived]
            self.lp[layer, C_CHUNKS] = chunks
            self.lp[layer, C_PARTS] = self._add_address(parts, F32)
            self.lp[layer, C_ARRIVED] = self._add_address(arrived, I64)
            split[layer] = chunks
        return split

    def _needs(self) -> tuple[bool, bool, bool, bool]:
        """(quantized matrices, attention over 16-bit caches, over float32 caches, a sampling picker)."""
        attention = [self.tdt[row[ATT_KC]] for row in self.lp if row[C_KIND] == ATTN]
        return (any(is_quantized.py_func(int(c)) for c in self.tdt), any(c != F32 for c in attention),
                any(c == F32 for c in attention), any(row[C_KIND] == SAMPLE for row in self.lp))

    def _float_matrices(self) -> bool:
        """Whether a task multiplies a float32 / bf16 / f16 matrix (the float tiles, linear_entry), not only Q8_0 /
        Q4_0 blocks (linear_blocks_entry, without them)."""
        return any(not is_quantized.py_func(int(self.tdt[row[col]])) for row in self.lp
                   for kind, col in LINEAR_WEIGHTS if row[C_KIND] == kind)

    def _entries(self) -> np.ndarray:
        """The addresses of the task bodies compiled apart (pk_entry.ENTRY_COUNT), each compiled now if this
        program needs it (the float projections; quantized ones; attention over 16-bit or float32 caches; a
        sampling picker), else 0. Worked out on the first run and kept: a generation stepped one token per call
        runs this once, not per token."""
        if self.entries is not None:
            return self.entries
        quant, narrow, wide, samples = self._needs()
        entries = np.zeros(ENTRY_COUNT, np.int64)
        entries[LINEAR_ENTRY] = int(compiled(linear_entry if self._float_matrices() else linear_blocks_entry).address)
        entries[QUANT_ENTRY] = quantized_entry(self.tdt)
        entries[NARROW_ATTENTION_ENTRY] = int(compiled(narrow_attention_entry).address) if narrow else 0
        entries[FLOAT_ATTENTION_ENTRY] = int(compiled(float_attention_entry).address) if wide else 0
        entries[SAMPLE_ENTRY] = self._sample_entry()
        self.entries = entries
        return entries

    def _jobs(self) -> list[Any]:
        """What ``run``'s first call compiles where it is not cached (a float or quantized program's projections
        entry, ``ahead``'s jobs); not the quantized and sampling bodies, which an eager start never waits for."""
        _, narrow, wide, _ = self._needs()
        return [*ahead(narrow, wide), linear_entry if self._float_matrices() else linear_blocks_entry]

    def compiling(self) -> bool:
        """PersistentRuntime.compiling: on its first call, a child starts compiling every job of ``_jobs`` not
        cached or on a child's list already (pk_entry.compile_ahead; Backend.prepare_decode's child has most of
        them); True while one of them is left. False once this process has the code, and where no child compiles
        (``YIRAGE_CPU_COMPILE_APART=0``, no cache): ``run`` then compiles here, as without an eager start."""
        if execute_entry.address is not None and self.entries is not None:
            return False
        jobs = self._jobs()
        if not self.ahead_asked:
            self.ahead_asked = True
            compile_ahead(jobs)
        return any(pending(job) for job in jobs)

    def prepare(self) -> None:
        """PersistentRuntime.prepare: the decode's code compiled, or loaded from the cache, as ``run``'s first call
        would (waiting for the children that have it)."""
        self._execute(self._args(self.program.max_seq_length, np.zeros(0, np.int64)))
        self._entries()

    def _sample_entry(self) -> int:
        return int(compiled(sample_entry).address) if self._needs()[3] else 0

    def _execute(self, args: tuple[Any, ...]) -> Any:
        """``execute``'s entry point, compiled, and the decode loop compiled for ``args``. On a cold cache a child
        process compiles both (``ahead``; started by Backend.prepare_decode, or here) while this one compiles the
        projections, the attention and the other bodies this model needs (``_entries``): on 2 cores the first
        decode's compile takes about the larger share, not the sum."""
        if execute_entry.address is None:
            _, narrow, wide, _ = self._needs()
            started = compile_ahead(ahead(narrow, wide))
            try:
                with working(COMPILING):
                    self._entries()
                    wait_ahead(compile_decode)
                    decode.compile(decode_types((*args, execute_entry, self.entries)))  # the child's, from the cache
                    compiled(execute_entry)
            except BaseException:  # Ctrl-C or a compile error here: the child's work is not waited for
                if started is not None:
                    started.kill()
                raise
        return compiled(execute_entry)

    def value(self, name: str) -> Any:
        return self.values[name]

    def pick(self, logits: Any) -> Any:
        """The picker layer alone on ``logits`` at the current positions (PersistentRuntime.pick), with the decode
        step's own sampler (``pk_tasks.pick_rows``)."""
        picker = self.program.picker
        x, out = self.values[picker.inputs["input"].name], self.values[picker.output.name]
        x.copy_(logits)
        pick_rows(self.lp, self.lf, picker.index, x.view(-1).numpy(), self.program.step.numpy(),
                  out.view(-1).numpy(), self.program.batch, self._sample_entry())
        return out[:, 0]

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

    def _args(self, limit: int, profile: np.ndarray) -> tuple[Any, ...]:
        """``decode``'s arguments up to its entry points, for ``limit`` steps."""
        program = self.program
        _, workers, schedulers = self.effective()
        tokens_id, tok_cols, step_id, pick_id = self.ids
        return (self.addr, self.tdt, self.tnum, self.lp, self.lf, *self.graph_arrays, workers, schedulers, limit,
                np.array(program.eos_token_ids or [-1], np.int64), program.max_seq_length, program.batch, tokens_id,
                tok_cols, step_id, pick_id, self.scratch, self.scr, profile, self.steps_run, self.flags)

    def run(self, max_new_tokens: int | None = None) -> int:
        """Decode (see PersistentKernel.__call__); the caller serializes calls (the kernel's lock).

        Ctrl-C stops the run between tasks and raises KeyboardInterrupt here
        within milliseconds (pk_calls).
        """
        program = self.program
        self.snapshot.verify()
        self.refresh_derived()
        profile = np.zeros(0, np.int64)
        if program.profiler_tensor is not None:
            profile = np.zeros(3 * len(self.task_origin), np.int64)
        threads = self.effective()[0]
        limit = program.max_seq_length if max_new_tokens is None else int(max_new_tokens)
        self.flags[:] = 0
        for arrived in self.split_buffers[1::2]:  # a run stopped mid-step may have left chunks counted
            arrived.zero_()
        args = self._args(limit, profile)
        args += (self._execute(args), self._entries())
        check_fork()
        comm = self.comm
        if comm is not None:
            comm.start(self.flags)  # the thread that runs the collective layers' collectives (pk_comm)
        try:
            # registered while in flight: if the main thread dies (Ctrl-C), the exit hook stops this decode
            with shutdown.decoding(self), serialized():  # serialized: only on a threading layer that needs it
                wall = time.perf_counter_ns()
                cycles = _cycles()
                steps = call_decode(decode, threads, args, self.flags)  # Ctrl-C stops it (pk_calls)
            ns_per_cycle = (time.perf_counter_ns() - wall) / max(1, _cycles() - cycles)
        finally:
            if comm is not None:
                comm.finish()  # a collective in flight (a stopped run) gives up within one slice
        self.last_backoff = {"yields": int(self.flags[YIELDS]), "sleeps": int(self.flags[SLEEPS])}
        if comm is not None:
            self.last_comm = {"calls": comm.calls, "comm_s": comm.comm_ns / 1e9,
                              "decode_s": (time.perf_counter_ns() - wall) / 1e9}
            if self.flags[ERROR] == ERR_PIPE:
                raise NotSupportedError("the CPU runtime could not hand a collective to its communication thread "
                                        "(write to its pipe failed); the run cannot go on: restart every rank")
            if self.flags[ERROR] == ERR_COMM and comm.error is not None:
                raise comm.error
        if self.flags[ERROR] == ERR_TOKEN:
            row, tok = int(self.flags[ERR_ROW]), int(self.flags[ERR_VALUE])
            raise token_out_of_range(row, tok)
        if self.flags[STOP]:
            shutdown.check_not_stopped()  # stopped by the exit hook: an incomplete result is an error
        if profile.shape[0]:
            profile = fold_profile(profile, self.task_origin, program.task_graph.num_tasks)
            starts = profile[0::3]
            origin = int(starts[starts > 0].min()) if (starts > 0).any() else 0
            out = program.profiler_tensor.view(-1)
            n = program.task_graph.num_tasks
            for task in range(min(n, out.numel() // 3)):
                out[3 * task] = int((profile[3 * task] - origin) * ns_per_cycle)
                out[3 * task + 1] = int((profile[3 * task + 1] - origin) * ns_per_cycle)
                out[3 * task + 2] = int(profile[3 * task + 2])
        return int(steps)


def decode_types(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """numba's types of ``decode``'s arguments: what it is compiled for."""
    from numba.experimental import function_type  # noqa: F401 - registers numba.typeof for C callbacks (entry)

    return tuple(numba.typeof(a) for a in args)


def decode_signature() -> tuple[Any, ...]:
    """The types every runtime calls ``decode`` with (tests/test_compile_apart.py checks a real run's), so that a
    child can compile it before any runtime exists (``compile_decode``)."""
    ints, n = np.zeros(1, np.int64), 0
    return decode_types((ints, ints, ints, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float64), *(ints,) * 8,
                         n, n, n, ints, n, n, n, n, n, n, np.zeros(1, np.float32), n, ints, ints, ints, execute_entry,
                         np.zeros(ENTRY_COUNT, np.int64)))


def compile_decode() -> None:
    """The decode loop, compiled for ``decode_signature`` (a ``compile_ahead`` job)."""
    decode.compile(decode_signature())


def ahead(narrow: bool, wide: bool) -> list[Any]:
    """What a child compiles ahead for a decode (pk_entry.compile_ahead): the decode loop and execute, then the
    attention over 16-bit (``narrow``) or float32 (``wide``) caches, which the process takes back where the child
    has not reached it when it is needed (pk_entry.Ahead). The process keeps the projections (the prompt's prefill
    needs them first), the quantized and sampling bodies and the picker."""
    return [compile_decode, execute_entry] + [e for e, need in ((float_attention_entry, wide),
                                                                (narrow_attention_entry, narrow)) if need]


def compile_ahead_for(kv_dtype: Any) -> None:
    """Backend.prepare_decode: the child of ``ahead`` for KV caches of ``kv_dtype`` (None: float32)."""
    import torch

    wide = kv_dtype in (None, torch.float32)
    compile_ahead(ahead(not wide, wide))


@njit(cache=True)
def _cycles():  # type: ignore[no-untyped-def]
    return cycle_counter()


tie_caches_to_sources(globals())  # after every cached function above is defined
