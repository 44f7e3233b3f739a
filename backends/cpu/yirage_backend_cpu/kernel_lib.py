"""Scalar helpers that generated kernels call; inlined and vectorizable.

numba's ``np.exp``/``math.exp`` is a scalar libm call (SVML is off), which
stops LLVM from vectorizing a loop. ``fexp`` is a Cephes-style float32 exp
(range reduction to [-ln2/2, ln2/2], degree-6 polynomial, 2^n built in the
exponent bits) that vectorizes; relative error < 2e-7.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_F = np.float32

# The LLVM fast-math flags every CPU kernel compiles with (one place, so all agree).
FASTMATH = True


@njit(fastmath=FASTMATH, inline="always", cache=True)
def fexp(x):  # type: ignore[no-untyped-def]
    """exp(x) for float32: inf above 88.72 and 0 below -103.9, as float32 overflows and underflows;
    below -87.33 it returns exp(-87.33) (absolute error < 1.2e-38)."""
    big = x > _F(88.72)
    small = x < _F(-103.9)
    top = x > _F(88.37)  # 2^128 does not fit the exponent: compute exp(x - ln 2) * 2
    x = min(max(x - (_F(0.6931471805599453) if top else _F(0.0)), _F(-87.33)), _F(88.37))
    n = _F(math.floor(x * _F(1.4426950408889634) + _F(0.5)))
    r = x - n * _F(0.693359375) + n * _F(2.12194440e-4)
    p = _F(1.9875691500e-4)
    p = p * r + _F(1.3981999507e-3)
    p = p * r + _F(8.3334519073e-3)
    p = p * r + _F(4.1665795894e-2)
    p = p * r + _F(1.6666665459e-1)
    p = p * r + _F(5.0000001201e-1)
    p = p * r * r + r + _F(1.0)
    p = p + p if top else p  # doubled before scaling, so the product stays below FLT_MAX
    y = p * np.int32((np.int32(n) + np.int32(127)) << 23).view(np.float32)
    return _F(np.inf) if big else (_F(0.0) if small else y)


@njit(fastmath=FASTMATH, inline="always", cache=True)
def fsilu(x):  # type: ignore[no-untyped-def]
    return x / (_F(1.0) + fexp(-x))


@njit(fastmath=FASTMATH, inline="always", cache=True)
def fgelu(x):  # type: ignore[no-untyped-def]
    return _F(0.5) * x * (_F(1.0) + math.erf(x * _F(0.7071067811865476)))


@njit(fastmath=FASTMATH, inline="always", cache=True)
def dsilu(x):  # type: ignore[no-untyped-def]
    return x / (1.0 + math.exp(-x))


@njit(fastmath=FASTMATH, inline="always", cache=True)
def dgelu(x):  # type: ignore[no-untyped-def]
    return 0.5 * x * (1.0 + math.erf(x * 0.7071067811865476))


@intrinsic
def as_pointer(typingctx, address):  # type: ignore[no-untyped-def]
    """An int64 address (``tensor.data_ptr()``) as a void pointer for ``numba.carray``."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(address), codegen


@intrinsic
def half_to_float(typingctx, bits):  # type: ignore[no-untyped-def]
    """IEEE half bits (uint16) to float32 by LLVM's fpext: F16C's vcvtph2ps where the CPU has it."""
    if not isinstance(bits, types.Integer) or bits.bitwidth != 16:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen
