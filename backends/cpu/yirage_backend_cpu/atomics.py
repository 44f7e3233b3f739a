"""Atomic int64 operations on array elements for GIL-free workers (llvmlite intrinsics),
plus the CPU cycle counter the profiler reads."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _element_pointer(context, builder, array_type, array, index):  # type: ignore[no-untyped-def]
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [index], wraparound=False)


@intrinsic
def atomic_add(typingctx, array, index, value):  # type: ignore[no-untyped-def]
    """``array[index] += value`` atomically (sequentially consistent); returns the old value."""
    if not (isinstance(array, types.Array) and array.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return types.int64(array, index, value), codegen


@intrinsic
def atomic_load(typingctx, array, index):  # type: ignore[no-untyped-def]
    if not (isinstance(array, types.Array) and array.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(array, index), codegen


@intrinsic
def atomic_store(typingctx, array, index, value):  # type: ignore[no-untyped-def]
    if not (isinstance(array, types.Array) and array.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(val, ptr, "release", 8)
        return context.get_dummy_value()

    return types.none(array, index, value), codegen


@intrinsic
def atomic_cas(typingctx, array, index, expected, value):  # type: ignore[no-untyped-def]
    """``array[index] = value`` if it holds ``expected``, atomically (sequentially consistent); returns the value
    it held (== expected: this call wrote it)."""
    if not (isinstance(array, types.Array) and array.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        old = context.cast(builder, args[2], signature.args[2], types.int64)
        new = context.cast(builder, args[3], signature.args[3], types.int64)
        return builder.extract_value(builder.cmpxchg(ptr, old, new, "seq_cst", "seq_cst"), 0)

    return types.int64(array, index, expected, value), codegen


@intrinsic
def cycle_counter(typingctx):  # type: ignore[no-untyped-def]
    """The CPU's cycle counter (``llvm.readcyclecounter``); the profiler scales it to ns."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fnty = ir.FunctionType(ir.IntType(64), [])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen
