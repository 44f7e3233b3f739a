"""Scalar helpers that generated kernels call; inlined and vectorizable.

numba's ``np.exp``/``math.exp`` is a scalar libm call (SVML is off), which
stops LLVM from vectorizing a loop. ``fexp`` is a Cephes-style float32 exp
(range reduction to [-ln2/2, ln2/2], degree-6 polynomial, 2^n built in the
exponent bits) that vectorizes; relative error < 2e-7.

Special values follow IEEE and torch exactly. Every CPU kernel compiles with
``FASTMATH``, which holds no LLVM fast-math flag: nnan/ninf/nsz/arcp/afn let
LLVM assume no NaN or infinity ever occurs (``silu(-100)``, ``3 / inf`` and
``exp(nan)`` came out as garbage once a loop ran vectorized), and even
``reassoc``/``contract`` change special values in pointwise code: ``a / d *
b`` reassociated to ``a * b / d`` overflows where torch does not, and an FMA
keeps an overflowing product finite (``1e30 * 1e30 + -inf`` gives -inf, torch
NaN). Reductions, whose order is unspecified anyway, opt in per instruction:
``racc``/``rfma`` emit a reassociable add (and contractable multiply), which
is all the loop vectorizer needs for sums and dot products; ``rmax`` is
``llvm.maximum``. numba's builtin ``max``/``min`` drop a NaN, so kernels use
``fmax``/``fmin``, which propagate it like ``torch.maximum``/``torch.clamp``.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from yirage_backend_cpu.sources import tie_caches_to_sources

_F = np.float32

# The LLVM fast-math flags every CPU kernel compiles with (one place, so all agree): none, so every
# float operation rounds as IEEE says; reductions opt in to reassociation with racc/rfma/rmax.
FASTMATH: set[str] = set()
_REDUCE = ("reassoc", "contract")  # the flags racc and rfma put on their own instructions



def _floats(*ts: types.Type) -> bool:
    return isinstance(ts[0], types.Float) and all(t == ts[0] for t in ts)


@intrinsic
def fmuladd(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c, fused where the CPU has FMA (``llvm.fmuladd``); only for operands that cannot overflow."""
    if not _floats(a, b, c):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ty = args[0].type
        name = f"llvm.fmuladd.{'f32' if isinstance(ty, ir.FloatType) else 'f64'}"
        return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * 3), name), args)

    return a(a, b, c), codegen


@intrinsic
def racc(typingctx, acc, x):  # type: ignore[no-untyped-def]
    """acc + x that LLVM may reassociate: a sum over a loop written with it vectorizes."""
    if not _floats(acc, x):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fadd(args[0], args[1], flags=_REDUCE)

    return acc(acc, x), codegen


@intrinsic
def rfma(typingctx, acc, x, y):  # type: ignore[no-untyped-def]
    """acc + x * y for dot products: reassociable (vectorizes) and contractable (one FMA)."""
    if not _floats(acc, x, y):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fadd(args[0], builder.fmul(args[1], args[2], flags=_REDUCE), flags=_REDUCE)

    return acc(acc, x, y), codegen


@intrinsic
def rmax(typingctx, a, b):  # type: ignore[no-untyped-def]
    """LLVM's ``llvm.maximum`` for a max-reduction: NaN-propagating like ``fmax`` (it orders -0.0 below
    +0.0, which a reduction cannot tell apart) and, unlike a compare-and-select, vectorizable without
    the no-NaN fast-math flag."""
    if not _floats(a, b):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ty = args[0].type
        name = f"llvm.maximum.{'f32' if isinstance(ty, ir.FloatType) else 'f64'}"
        return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty]), name), args)

    return a(a, b), codegen


@njit(fastmath=FASTMATH, inline="always", cache=True)
def fmax(a, b):  # type: ignore[no-untyped-def]
    """max(a, b) that returns NaN if either is NaN, and ``a`` on ties (torch.clamp(-0.0, min=0.0) is -0.0)."""
    return b if (b > a or b != b) else a


@njit(fastmath=FASTMATH, inline="always", cache=True)
def fmin(a, b):  # type: ignore[no-untyped-def]
    """min(a, b) that returns NaN if either is NaN, and ``a`` on ties."""
    return b if (b < a or b != b) else a


@intrinsic
def pow2(typingctx, n):  # type: ignore[no-untyped-def]
    """2^n for an integral float32 ``n`` in [-126, 127], its exponent bits built in int32. numba types scalar
    int32 arithmetic as int64, and ``np.int32(...).view(np.float32)`` vectorized as <8 x i64> conversions:
    this keeps every lane 32 bits wide."""
    if n != types.float32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(n), codegen


@njit(fastmath=FASTMATH, inline="always", cache=True)
def fexp(x):  # type: ignore[no-untyped-def]
    """exp(x) for float32 with float32's own special values: NaN for NaN, inf above 88.7228 and for +inf,
    denormals down to 2^-149, +0.0 below -103.97 and for -inf.

    x is clamped to [-104, 89], where the results already round to +0 and +inf (NaN clamps to a finite value
    too: fptosi of NaN is poison; it is put back at the end). 2^n, n in [-150, 128], is applied as 2^h * 2^(n-h)
    with both halves normal: the first product is exact, the second rounds once, into the denormals or to inf
    as IEEE says. No branch and no 64-bit lane: 1.6-1.9x faster than the earlier form (one that special-cased
    n = 128 and n < -125 with selects and built 2^n in int64), bit for bit equal to it on 22M samples."""
    xr = x if x > _F(-104.0) else _F(-104.0)
    xr = xr if xr < _F(89.0) else _F(89.0)
    n = np.floor(fmuladd(xr, _F(1.4426950408889634), _F(0.5)))
    r = fmuladd(n, _F(2.12194440e-4), fmuladd(n, _F(-0.693359375), xr))  # Cody-Waite: n * ln 2 in two parts
    p = fmuladd(_F(1.9875691500e-4), r, _F(1.3981999507e-3))  # |r| <= 0.35: no product can overflow
    p = fmuladd(p, r, _F(8.3334519073e-3))
    p = fmuladd(p, r, _F(4.1665795894e-2))
    p = fmuladd(p, r, _F(1.6666665459e-1))
    p = fmuladd(p, r, _F(5.0000001201e-1))
    p = fmuladd(p * r, r, r) + _F(1.0)
    h = np.floor(n * _F(0.5))
    y = p * pow2(h) * pow2(n - h)
    return x if x != x else y


@njit(fastmath=FASTMATH, inline="always", cache=True)
def fsilu(x):  # type: ignore[no-untyped-def]
    """x * sigmoid(x) spelled as torch's float32 kernel does: -0.0 for x <= -88.8, NaN for -inf and NaN."""
    return x / (_F(1.0) + fexp(-x))


# erf's minimax coefficients from Arm's optimized-routines (math/erff_data.c, MIT): erf(x) = x + x * A(x^2) for
# |x| < 0.875, 1 - exp(-(a + a * B(a))) for 0.875 <= a = |x| < 4 (worst case 1.09 ulp there), +-1 beyond
_ERF_A = tuple(float.fromhex(h) for h in ("0x1.06eba6p-03", "-0x1.8126e0p-02", "0x1.ce1a46p-04", "-0x1.b68bd2p-06",
                                          "0x1.473f48p-08", "-0x1.3a1a82p-11"))
_ERF_B = tuple(float.fromhex(h) for h in ("0x1.079d0cp-3", "0x1.450aa0p-1", "0x1.b55cb0p-4", "-0x1.8d6300p-6",
                                          "0x1.fd1336p-9", "-0x1.91d2ccp-12", "0x1.222900p-16"))
A0, A1, A2, A3, A4, A5 = (_F(c) for c in _ERF_A)
B0, B1, B2, B3, B4, B5, B6 = (_F(c) for c in _ERF_B)


@njit(fastmath=FASTMATH, inline="always", cache=True)
def ferf(x):  # type: ignore[no-untyped-def]
    """erf for float32 without a libm call, so loops over it vectorize (math.erf is a scalar call: a GELU
    chain ran 4-12x slower than torch). Both pieces are computed and one is selected: no branch.
    NaN gives NaN, +-inf gives +-1."""
    a = abs(x)
    x2 = x * x
    small = fmuladd(fmuladd(fmuladd(fmuladd(fmuladd(fmuladd(A5, x2, A4), x2, A3), x2, A2), x2, A1), x2, A0), x, x)
    q = fmuladd(fmuladd(B6, a, B5), x2, fmuladd(B4, a, B3))  # Estrin on the small high-order terms, then Horner
    q = fmuladd(fmuladd(fmuladd(fmuladd(q, a, B2), a, B1), a, B0), a, a)
    e = fexp(-q)
    mid = e - _F(1.0) if x < _F(0.0) else _F(1.0) - e
    one = _F(-1.0) if x < _F(0.0) else _F(1.0)
    y = small if a < _F(0.875) else (mid if a < _F(4.0) else one)
    return x if x != x else y


@njit(fastmath=FASTMATH, inline="always", cache=True)
def fgelu(x):  # type: ignore[no-untyped-def]
    return _F(0.5) * x * (_F(1.0) + ferf(x * _F(0.7071067811865476)))


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


@intrinsic
def float_to_half(typingctx, x):  # type: ignore[no-untyped-def]
    """float32 to IEEE half bits (uint16) by LLVM's fptrunc: rounded to nearest even like torch's .half(),
    overflow to inf, NaN kept NaN (F16C's vcvtps2ph where the CPU has it)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@njit(fastmath=FASTMATH, inline="always", cache=True)
def float_to_bf16(x):  # type: ignore[no-untyped-def]
    """float32 to bfloat16 bits (uint16), rounded to nearest even like torch's .bfloat16(); NaN gives 0x7fc0."""
    u = np.float32(x).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(0x7FC0) if x != x else np.uint16(rounded)


tie_caches_to_sources(globals())  # after every cached function above is defined
