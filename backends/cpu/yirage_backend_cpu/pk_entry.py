"""Task bodies behind a C entry point, so numba compiles them once instead of once per caller.

numba links a called function's whole optimized module into its caller's and
runs LLVM's full pipeline and code generation over it again; the decode loop
called ``execute`` through five levels (run_role, member, two parfor bodies,
their wrappers, decode), so every task body was optimized and emitted about
eight times: 100 of the runtime's 127 s of cold compile (2 cores). Called
through a C callback's address instead, ``execute`` is compiled once, the loop
above it is small, and the indirect call costs nanoseconds against a task's
microseconds.

A C callback takes scalars only, so the arrays ``execute`` reads travel as one
int64 *frame* of (address, extent) slots that the decode loop fills once per
call (``task_frame``) and ``run_task`` turns back into arrays.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.caching import NullCache
from numba.core.ccallback import CFunc
from numba.core.sigutils import normalize_signature
from numba.extending import intrinsic

from yirage.log import working
from yirage_backend_cpu.kernel_lib import FASTMATH, as_pointer
from yirage_backend_cpu.sources import tie_caches_to_sources

# task, worker, frame address, the worker's scratch address, its scratch floats
ENTRY_SIGNATURE = types.void(types.int64, types.int64, types.int64, types.int64, types.int64)
# the frame's slots: every array execute reads, each as address then extent(s); then batch and tok_cols
ADDR, TDT, TNUM, LP, LF, LAYER, INDEX, STEP, TOKENS, FLAGS, ENTRIES = 0, 2, 4, 6, 9, 12, 14, 16, 18, 20, 22
BATCH, TOK_COLS = 24, 25
FRAME_SLOTS = 26
# ``entries``: the addresses of the task bodies compiled apart, on first use, only for a model that needs them
# (0: not needed): Q8_0 / Q4_0 projections (pk_quant.linear_q_entry), attention over 16-bit KV caches
# (pk_tasks.narrow_attention_entry), sampling (pk_tasks.sample_entry), attention over float32 caches
# (pk_tasks.float_attention_entry: apart so that it is compiled beside execute, not into it). A float
# model that decodes greedily compiles none of the first three: 42 -> 31 s cold, then about 3 s less. The
# projections (pk_tasks.linear_entry), which every model needs, are an entry point of their own so that their code
# is compiled once for the decode's execute and the prompt's projections (prompt_linear), not into both.
QUANT_ENTRY, NARROW_ATTENTION_ENTRY, SAMPLE_ENTRY, FLOAT_ATTENTION_ENTRY, LINEAR_ENTRY = 0, 1, 2, 3, 4
ENTRY_COUNT = 5
_lock = threading.Lock()
logger = logging.getLogger("yirage.cpu")


def task_entry(pyfunc: Any, signature: Any = ENTRY_SIGNATURE) -> CFunc:
    """``pyfunc(task, w, frame, scratch, scratch_len)`` (or ``signature``'s scalars) as a C callback, cached on
    disk and compiled on first use (``compiled``), not at import: the module's ``tie_caches_to_sources`` must see
    it before it loads."""
    entry = CFunc(pyfunc, normalize_signature(signature), locals={},
                  options={"nopython": True, "fastmath": FASTMATH, "error_model": "numpy"})
    entry.enable_caching()
    entry.__module__ = pyfunc.__module__  # what tie_caches_to_sources / check_compiled_layout match on
    return entry


def compiled(entry: CFunc) -> CFunc:
    """``entry``, compiled (or loaded from numba's cache) once per process; where a ``compile_ahead`` child is on it,
    after that child has put it in the cache (or failed: then it is compiled here)."""
    if entry.address is None:
        with working(COMPILING):
            wait_ahead(entry)
            with _lock:
                if entry.address is None:
                    entry.compile()
    return entry


#: what a terminal shows while the cpu backend compiles (yirage.log.working: nothing within a warm cache's time)
COMPILING = "compiling the cpu backend's decode kernels (numba; once per machine, then loaded from its cache)"


def cached(entry: CFunc) -> bool:
    """Whether ``entry`` is compiled in this process, or its code is in numba's cache (then ``compiled`` loads it
    in milliseconds: numba keeps what this probe read)."""
    with _lock:
        if entry.address is not None:
            return True
        return entry._cache.load_overload(entry._sig, entry._targetdescr.target_context) is not None


#: ``YIRAGE_CPU_COMPILE_APART=0``: compile every entry point in the process that needs it (no child process)
COMPILE_APART_ENV = "YIRAGE_CPU_COMPILE_APART"
#: how much lower a compile-ahead child's scheduling priority is than this process's (os.nice)
CHILD_NICENESS = 10
_ahead: dict[int, Ahead] = {}  # id(job) -> the child compiling it (jobs are module globals: ids are stable)
_starting = threading.Lock()


class Ahead:
    """A child process compiling jobs one after another into numba's cache, saying ``start:NAME`` and ``done:NAME``
    on its stdout (a thread here reads them). ``wait_for(job)`` waits for a job the child has started; a job it has
    not reached yet is taken back (``wait_for`` returns False: the caller compiles it, both cores stay busy), and
    a child whose remaining jobs were all taken back is stopped. Started by ``compile_ahead``."""

    def __init__(self, process: subprocess.Popen, names: dict[int, str], errors: Any) -> None:
        self.process, self.names, self.errors = process, names, errors
        self.started: set[str] = set()
        self.done: set[str] = set()
        self.taken: set[str] = set()
        self.ended = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="yirage-compile-ahead", daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            word, _, name = line.decode(errors="replace").strip().partition(":")
            with self._changed:
                (self.started if word == "start" else self.done).add(name)
                if word == "start" and name in self.taken and self._idle():
                    self.process.kill()  # what it would compile from here on is compiled here already
                self._changed.notify_all()
        self.process.wait()  # reaped, not left a zombie
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def _idle(self) -> bool:
        return set(self.names.values()) <= self.done | self.taken

    def wait_for(self, job: Any) -> bool:
        """True once the child has ``job`` in the cache; False where the caller must compile it: the child has not
        started it (it is taken back) or it ended without it (a failure is logged). Interrupted (Ctrl-C), the
        child is killed."""
        name = self.names[id(job)]
        try:
            with self._changed:
                if name not in self.started and not self.ended:
                    self.taken.add(name)
                    if self._idle():
                        self.process.kill()
                    return False
                while name not in self.done and not self.ended:
                    self._changed.wait()
                if name in self.done:
                    return True
            self._failed(name)
            return False
        except BaseException:
            self.kill()
            raise

    def busy_with(self, job: Any) -> bool:
        """Whether this child still has ``job`` to compile: on its list, not done, not taken back, not ended."""
        name = self.names[id(job)]
        with self._changed:
            return name not in self.done and name not in self.taken and not self.ended

    def _failed(self, name: str) -> None:
        self.errors.seek(0)
        logger.warning("compiling %s in a child process failed (exit %s); compiling it here instead: %s", name,
                       self.process.returncode, self.errors.read().decode(errors="replace")[-2000:])

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        with _lock:
            for key in [k for k, v in _ahead.items() if v is self]:
                del _ahead[key]


def _forget_children() -> None:
    """In a forked process: the compile-ahead children are the parent's, and their reader threads did not survive
    the fork, so waiting for one would wait forever; this process compiles what it needs (and its locks are new:
    another thread may have held them at the fork)."""
    global _lock, _starting
    _ahead.clear()
    _lock, _starting = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_children)


def wait_ahead(job: Any) -> None:
    """Where a ``compile_ahead`` child has ``job`` (an entry point or a compile function) on its list: wait for it
    if the child has started it (or take it back, see ``Ahead.wait_for``); else return at once."""
    with _lock:
        ahead = _ahead.pop(id(job), None)
    if ahead is not None:
        ahead.wait_for(job)


def pending(job: Any) -> bool:
    """Whether a ``compile_ahead`` child is compiling ``job`` or has it still to do (it neither finished it nor
    ended): at once, without waiting or taking it back. A caller that must not wait runs something else meanwhile
    (the prompt's projections in torch, a decode's first steps in torch: yirage's ``eager_start``)."""
    with _lock:
        ahead = _ahead.get(id(job))
    return ahead is not None and ahead.busy_with(job)


def compile_ahead(jobs: list[Any]) -> Ahead | None:
    """Start ``jobs``, in this order, in a child process that writes numba's cache, so this process can compile the
    rest at the same time: on a cold cache two cores compile at once. A job is an entry point (``task_entry``),
    compiled there, or a function of no arguments that compiles something cached (a numba function for a fixed
    signature), called there. The child imports the modules that define the jobs, on this process's import path;
    ``compiled(entry)`` (or ``wait_ahead(job)``) then waits for the child's word and loads its code from the cache.
    Skipped: entries compiled or cached already, jobs already on a child's list, and jobs no module attribute
    holds. None (nothing started) where no entry point of the list is left to compile (the functions' code is
    then cached too: they are compiled together), where numba caches nothing (the child's work would be lost),
    or where ``YIRAGE_CPU_COMPILE_APART=0``."""
    if os.environ.get(COMPILE_APART_ENV, "1").strip() == "0":
        return None
    with _starting:  # two threads making engines at once start one child, not two for the same jobs
        return _start(jobs)


def _start(jobs: list[Any]) -> Ahead | None:
    todo: dict[int, tuple[str, str, bool]] = {}
    for job in jobs:
        module = sys.modules.get(job.__module__)
        name = next((k for k, v in vars(module).items() if v is job), None) if module is not None else None
        entry = isinstance(job, CFunc)
        if name is None or id(job) in _ahead or (entry and (isinstance(job._cache, NullCache) or cached(job))):
            continue
        todo[id(job)] = (job.__module__, name, entry)
    if not any(entry for _, _, entry in todo.values()):
        return None
    # niced: where this process runs something the user waits for (a prompt, a decode's first steps in torch) and
    # two children compile, its torch threads would otherwise queue behind them for whole scheduler periods
    lines = ["import os", f"getattr(os, 'nice', abs)({CHILD_NICENESS})",  # os.nice: POSIX only
             "from yirage_backend_cpu.pk_entry import compiled"]
    for module, name, entry in todo.values():
        lines += [f"from {module} import {name}", f"print('start:{module}:{name}', flush=True)",
                  f"compiled({name})" if entry else f"{name}()", f"print('done:{module}:{name}', flush=True)"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    errors = tempfile.TemporaryFile()  # not a pipe: a child writing more than a pipe holds would block on it
    process = subprocess.Popen([sys.executable, "-c", "\n".join(lines)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=errors, env=env)
    ahead = Ahead(process, {key: f"{module}:{name}" for key, (module, name, _) in todo.items()}, errors)
    with _lock:
        for key in todo:
            _ahead[key] = ahead
    return ahead


def recompile(entry: CFunc) -> None:
    """Drop ``entry``'s cached code and compile it again (a changed descriptor layout)."""
    with _lock:
        entry._cache.flush()
        entry.compile()


@intrinsic
def call_c(typingctx, address, args):  # type: ignore[no-untyped-def]
    """Call the C function at ``address`` (a compiled entry point's, ``CFunc.address``) with ``args``, a tuple of
    integers passed as int64: code compiled apart (on first use) called from code compiled without it."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple) or not all(
            isinstance(t, types.Integer) for t in args):
        return None

    def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
        kinds = signature.args[1]
        ints = [context.cast(builder, builder.extract_value(values[1], i), kinds[i], types.int64)
                for i in range(len(kinds))]
        i64 = ir.IntType(64)
        target = builder.inttoptr(context.cast(builder, values[0], signature.args[0], types.int64),
                                  ir.FunctionType(ir.VoidType(), [i64] * len(ints)).as_pointer())
        builder.call(target, ints)
        return context.get_dummy_value()

    return types.void(address, args), codegen


@njit(cache=True, error_model="numpy", nogil=True)
def task_frame(addr, tdt, tnum, lp, lf, task_layer, task_index, batch, step, tokens, tok_cols, flags, entries):
    """The frame ``run_task`` reads: the arrays stay owned (and alive) by the caller for the whole call."""
    frame = np.empty(FRAME_SLOTS, np.int64)
    _put(frame, ADDR, addr)
    _put(frame, TDT, tdt)
    _put(frame, TNUM, tnum)
    _put(frame, LAYER, task_layer)
    _put(frame, INDEX, task_index)
    _put(frame, STEP, step)
    _put(frame, TOKENS, tokens)
    _put(frame, FLAGS, flags)
    _put(frame, ENTRIES, entries)
    frame[LP], frame[LP + 1], frame[LP + 2] = lp.ctypes.data, lp.shape[0], lp.shape[1]
    frame[LF], frame[LF + 1], frame[LF + 2] = lf.ctypes.data, lf.shape[0], lf.shape[1]
    frame[BATCH], frame[TOK_COLS] = batch, tok_cols
    return frame


@njit(inline="always", error_model="numpy", nogil=True)
def _put(frame, slot, a):  # type: ignore[no-untyped-def]
    frame[slot] = a.ctypes.data
    frame[slot + 1] = a.shape[0]


@njit(inline="always", fastmath=FASTMATH, error_model="numpy", nogil=True)
def run_task(body, task, w, frame_addr, scratch_addr, scratch_len):  # type: ignore[no-untyped-def]
    """``body(task, w, addr, tdt, tnum, lp, lf, task_layer, task_index, batch, scratch, step, tokens, tok_cols,
    none, flags, entries)`` on the arrays of the frame at ``frame_addr``."""
    f = numba.carray(as_pointer(frame_addr), (FRAME_SLOTS,), np.int64)
    lp = numba.carray(as_pointer(f[LP]), (f[LP + 1], f[LP + 2]), np.int64)
    lf = numba.carray(as_pointer(f[LF]), (f[LF + 1], f[LF + 2]), np.float64)
    body(task, w, _i64(f, ADDR), _i64(f, TDT), _i64(f, TNUM), lp, lf, _i64(f, LAYER), _i64(f, INDEX), f[BATCH],
         numba.carray(as_pointer(scratch_addr), (scratch_len,), np.float32), _i64(f, STEP), _i64(f, TOKENS),
         f[TOK_COLS], numba.carray(as_pointer(scratch_addr), (0,), np.float32), _i64(f, FLAGS), _i64(f, ENTRIES))


@njit(inline="always", error_model="numpy", nogil=True)
def _i64(frame, slot):  # type: ignore[no-untyped-def]
    return numba.carray(as_pointer(frame[slot]), (frame[slot + 1],), np.int64)


tie_caches_to_sources(globals())
