"""How an idle PersistentKernel thread waits: spin, then yield the core, then sleep (llama.cpp's poll levels).

A worker whose next task is not ready yet spins briefly with the CPU's pause
hint (``cpu_relax``): on a quiet machine the task arrives within microseconds
and a sleep would cost more than it saves. When the wait goes on
(``SPIN_CYCLES``), the thread calls ``sched_yield`` so that a thread of this
process (or another one) holding the core can run; after ``YIELD_CYCLES`` it
sleeps ``SLEEP_US`` per round. Without this a spinning worker on a busy
machine burns the time slice the thread it waits for needs (measured: W4
decode fell to 11 tok/s under a load average of 5 on 2 cores while HF eager
ran at 28).

The libc calls are declared as external symbols in the generated code (the
JIT resolves them in the process), not ctypes pointers: numba can cache
code that names a symbol, not code that embeds an address.
"""

from __future__ import annotations

import platform
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

SPIN_CYCLES = 200_000  # ~60 us at 3 GHz (the time-stamp counter): a dependency usually lands well within it
YIELD_CYCLES = 2_000_000  # ~0.6 ms: then sleep, the wait is long (other processes hold the cores)
SLEEP_US = 50

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_POSIX = sys.platform != "win32"


@intrinsic
def cpu_relax(typingctx):  # type: ignore[no-untyped-def]
    """The x86 ``pause`` hint (a no-op elsewhere): kinder to the sibling hyperthread and the memory bus."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def os_yield(typingctx):  # type: ignore[no-untyped-def]
    """``sched_yield()``: let another runnable thread have this core now."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if _POSIX:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def sleep_us(typingctx, micros):  # type: ignore[no-untyped-def]
    """``usleep(micros)``: give the core away for a while."""
    if not isinstance(micros, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if _POSIX:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32)]),
                                                "usleep")
            builder.call(fn, [builder.trunc(context.cast(builder, args[0], signature.args[0], types.int64),
                                            ir.IntType(32))])
        return context.get_dummy_value()

    return types.none(micros), codegen
