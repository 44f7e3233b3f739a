"""The ``@triton.jit`` helper functions a rendered module may call, as source text.

Each helper spells one piece of the semantics every yirage backend shares, in the
Triton 3.0-3.5 language subset (``tl.where``, bit casts, shifts; no
``libdevice``, which Triton's interpreter cannot run and whose module path
differs between vendor forks):

- ``y_max``/``y_min``: NaN-propagating, ties (and -0.0 against 0.0) keep the first operand;
- ``y_exp32``: float32 exp within 1 ulp on any device (Cody-Waite reduction, Cephes' degree-6
  polynomial, 2^n as two exact scalings), the same algorithm as the C-family renderer's;
- ``y_bf16``/``y_widen_bf16``: float32 -> bfloat16 rounded to nearest even and back, exactly (Triton's
  interpreter truncates the one and flushes subnormals in the other);
- ``y_pow32``/``y_pow64``: C ``pow`` with its special cases, as exp2(y log2 |x|) in float64;
- ``y_silu*``, ``y_gelu*``, ``y_square``.

Booleans of different shapes are never combined with ``&``/``|`` (nested ``tl.where``
instead): Triton's interpreter cannot broadcast a scalar boolean into a block one.

The renderer records which helpers a plan uses and emits only those (``HELPERS[name]``), in
dependency order (``NEEDS``).
"""

from __future__ import annotations

HELPERS: dict[str, str] = {}

HELPERS["y_max"] = '''
@triton.jit
def y_max(a, b):
    """max(a, b), NaN if either is NaN; on ties (0.0 and -0.0 too) the first operand."""
    return tl.where(b != b, b, tl.where(b > a, b, a))
'''

HELPERS["y_min"] = '''
@triton.jit
def y_min(a, b):
    """min(a, b), NaN if either is NaN; on ties (0.0 and -0.0 too) the first operand."""
    return tl.where(b != b, b, tl.where(b < a, b, a))
'''

HELPERS["y_relu"] = '''
@triton.jit
def y_relu(a):
    """max(a, 0) with y_max's rules: NaN and -0.0 pass through."""
    return tl.where(a < 0, 0, a)
'''

HELPERS["y_neg_where"] = '''
@triton.jit
def y_neg_where(c, a):
    """-a where c, else a: rotate_half's sign."""
    return tl.where(c, -a, a)
'''

HELPERS["y_square"] = '''
@triton.jit
def y_square(a):
    return a * a
'''

HELPERS["y_exp32"] = '''
@triton.jit
def y_exp32(x):
    """float32 exp within 1 ulp on [-104, 89]; +inf above 88.7228394, +0 below -103.972084, NaN stays NaN."""
    t = x * 1.4426950408889634
    t = tl.where(t < 160.0, t, 160.0)  # NaN lands here too: no NaN reaches the int conversion
    t = tl.where(t > -160.0, t, -160.0)
    n = (t + 12582912.0) - 12582912.0  # round to nearest integer
    g = (x - n * 0.693359375) - n * -2.1219444e-4
    p = g * 1.98756915e-4 + 1.3981999507e-3
    p = p * g + 8.3334519073e-3
    p = p * g + 4.1665795894e-2
    p = p * g + 1.6666665459e-1
    p = p * g + 5.0000001201e-1
    p = p * g * g + g + 1.0
    ni = n.to(tl.int32)
    h = ni >> 1
    y = p * ((h + 127) << 23).to(tl.float32, bitcast=True) * ((ni - h + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.where(x > 88.72283935546875, float("inf"), y)
    y = tl.where(x < -103.97208404541016, 0.0, y)
    return tl.where(x != x, x + x, y)
'''

HELPERS["y_bf16"] = '''
@triton.jit
def y_bf16(x):
    """float32 -> bfloat16, rounded to nearest even; NaN stays a (quiet) NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
'''

HELPERS["y_widen_bf16"] = '''
@triton.jit
def y_widen_bf16(x):
    """bfloat16 -> float32 exactly, subnormals included (Triton's interpreter flushes them)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
'''

HELPERS["y_silu32"] = '''
@triton.jit
def y_silu32(x):
    return tl.div_rn(x, 1.0 + y_exp32(-x))
'''

HELPERS["y_silu64"] = '''
@triton.jit
def y_silu64(x):
    return x / (1.0 + tl.exp(-x))
'''

HELPERS["y_gelu32"] = '''
@triton.jit
def y_gelu32(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
'''

HELPERS["y_gelu64"] = '''
@triton.jit
def y_gelu64(x):
    return 0.5 * x * (1.0 + tl.erf(x * tl.full([], 0.7071067811865476, tl.float64)))
'''

HELPERS["y_pow64"] = '''
@triton.jit
def y_pow64(x, y):
    """C pow on float64: exp2(y * log2|x|) with the sign of odd integer powers and IEEE's special cases."""
    ax = tl.abs(x)
    r = tl.exp2(y * tl.log2(ax))
    y_int = tl.floor(y) == y
    half = y * 0.5
    odd = tl.where(y_int, tl.floor(half) != half, y_int)
    r = tl.where(x.to(tl.int64, bitcast=True) < 0, tl.where(odd, -r, r), r)  # the sign bit: -0.0 counts
    # a finite negative base to a finite non-integer power has no real value
    r = tl.where(x < 0, tl.where(ax != float("inf"), tl.where(tl.abs(y) != float("inf"), tl.where(
        y_int, r, float("nan")), r), r), r)
    r = tl.where(ax == 1.0, tl.where(tl.abs(y) == float("inf"), 1.0, r), r)
    r = tl.where(y == 0.0, 1.0, r)
    return tl.where(x == 1.0, 1.0, r)
'''

HELPERS["y_pow32"] = '''
@triton.jit
def y_pow32(x, y):
    """C powf: computed in float64 (y_pow64), rounded once to float32."""
    return y_pow64(x.to(tl.float64), y.to(tl.float64)).to(tl.float32)
'''

#: helpers that call other helpers
NEEDS: dict[str, tuple[str, ...]] = {"y_silu32": ("y_exp32",), "y_pow32": ("y_pow64",)}


def helper_source(names: set[str]) -> str:
    """The source of ``names`` and what they call, in a fixed order."""
    wanted = set(names)
    for name in list(wanted):
        wanted.update(NEEDS.get(name, ()))
    return "".join("\n" + HELPERS[n] for n in HELPERS if n in wanted)
