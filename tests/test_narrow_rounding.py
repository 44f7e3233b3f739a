"""The OpenCL dialect's bfloat16 / float16 stores round to nearest, ties to even, like torch.

The store and load spellings of yirage/codegen/dialects/opencl.py (``y_to_bf16``, ``vstore_half_rte``, and the
widening loads), compiled into one kernel with pyopencl and run on the OpenCL device (PoCL here). Oracle: torch's
``.to(torch.bfloat16)`` and ``.half()`` of the same float32 values, bit for bit. The values sit exactly halfway
between two representable narrow values (with an even and an odd lower neighbour), one float32 ulp above and
below halfway, at the overflow edge, in float16's subnormal range, and at the IEEE specials: a truncating or
ties-away round fails on them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import yirage as yr
from yirage.codegen.dialects import dialect

SEED = 20260511


def neighbours(halfway: np.ndarray) -> np.ndarray:
    """Each float32 value, the next one below and the next one above."""
    return np.concatenate([halfway, np.nextafter(halfway, np.float32(-np.inf)),
                           np.nextafter(halfway, np.float32(np.inf))]).astype(np.float32)


def bf16_cases() -> np.ndarray:
    """float32 values around the midpoints of random bfloat16 pairs (lower neighbour even and odd), both signs."""
    gen = np.random.default_rng(SEED)
    high = gen.integers(0x0080, 0x7F7F, 64, dtype=np.uint32)  # normal bfloat16 bit patterns below the largest
    high = np.concatenate([high & ~np.uint32(1), high | np.uint32(1), [0x0000, 0x0001, 0x7F7E, 0x7F7F]])
    halfway = ((high << np.uint32(16)) | np.uint32(0x8000)).view(np.float32)  # 0x7F7F8000: rounds up to inf
    values = neighbours(np.concatenate([halfway, -halfway]))
    return np.concatenate([values, np.float32([0.0, -0.0, np.inf, -np.inf, 1.0, 3.0e38])])


def f16_cases() -> np.ndarray:
    """float32 values around the midpoints of float16 pairs: normal (even and odd lower neighbour), subnormal,
    the overflow edge (65504 and 65520, halfway to inf), both signs."""
    gen = np.random.default_rng(SEED + 1)
    bits = gen.integers(0x0001, 0x7BFF, 96, dtype=np.uint16)  # finite float16 patterns below the largest
    bits = np.concatenate([bits & ~np.uint16(1), bits | np.uint16(1), [0x0000, 0x0001, 0x03FF, 0x0400, 0x7BFE,
                                                                       0x7BFF]]).astype(np.uint16)
    low = bits.view(np.float16).astype(np.float32)
    high = (bits + np.uint16(1)).view(np.float16).astype(np.float32)  # 0x7BFF + 1 is inf: the midpoint is 65520
    high[np.isinf(high)] = np.float32(65536.0)
    halfway = (low + high) / np.float32(2)  # exact in float32 (13 more mantissa bits)
    values = neighbours(np.concatenate([halfway, -halfway]))
    return np.concatenate([values, np.float32([0.0, -0.0, np.inf, -np.inf, 1.0, 1e6, 2.0**-30])])


def run_stores(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(bfloat16 bits, float16 bits, the bfloat16 values widened back, the float16 values widened back) of the
    dialect's stores and loads, run on the OpenCL device."""
    import pyopencl as cl
    from yirage_backend_opencl.compile import BUILD_OPTIONS
    from yirage_backend_opencl.devices import context

    d = dialect("opencl")
    bf_type, bf_load, bf_store = d.narrow["bfloat16"]
    h_type, h_load, h_store = d.narrow["float16"]
    params = ", ".join([d.param(0, "float", "x", False), d.param(1, bf_type, "b", True), d.param(2, h_type, "h", True),
                        d.param(3, "float", "wb", True), d.param(4, "float", "wh", True)])
    source = "\n".join([
        d.preamble, d.narrow_helpers["bfloat16"],
        f"{d.kernel} narrow({params}) {{",
        f"    long i = {d.ids['global']};",
        "    float v = x[i];",
        f"    {bf_store.format(p='b', i='i', v='v')};",
        f"    {h_store.format(p='h', i='i', v='v')};",
        f"    wb[i] = {bf_load.format(p='b', i='i')};",
        f"    wh[i] = {h_load.format(p='h', i='i')};",
        "}",
    ])
    ctx, queue = context()
    program = cl.Program(ctx, source).build(options=BUILD_OPTIONS)
    n = x.size
    mf = cl.mem_flags
    xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    outs = [np.zeros(n, np.uint16), np.zeros(n, np.uint16), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    bufs = [cl.Buffer(ctx, mf.WRITE_ONLY, o.nbytes) for o in outs]
    program.narrow(queue, (n,), None, xb, *bufs)
    for buf, out in zip(bufs, outs, strict=True):
        cl.enqueue_copy(queue, out, buf)
    queue.finish()
    return tuple(outs)  # type: ignore[return-value]


def assert_bits_equal(ours: np.ndarray, theirs: torch.Tensor, x: np.ndarray, what: str) -> None:
    want = theirs.view(torch.int16).numpy().view(np.uint16)
    bad = np.flatnonzero(ours != want)
    assert bad.size == 0, f"{what}: {bad.size} of {x.size} differ from torch, e.g. " + "; ".join(
        f"{float(x[i])!r} (0x{x[i:i + 1].view(np.uint32)[0]:08x}) -> 0x{ours[i]:04x}, torch 0x{want[i]:04x}"
        for i in bad[:4])


@pytest.mark.parametrize("kind", ("bfloat16", "float16"))
def test_opencl_narrow_stores_round_half_to_even_like_torch(kind: str) -> None:
    """Each float32 value stored as ``kind`` by the dialect's spelling has torch's bits (round to nearest, ties to
    even; overflow to inf), and the dialect's load widens it back to torch's float32 value."""
    if not yr.is_backend_available("opencl"):
        pytest.skip("the opencl backend is not available here")
    x = bf16_cases() if kind == "bfloat16" else f16_cases()
    b_bits, h_bits, b_wide, h_wide = run_stores(x)
    t = torch.from_numpy(x)
    theirs = t.to(torch.bfloat16) if kind == "bfloat16" else t.half()
    ours, wide = (b_bits, b_wide) if kind == "bfloat16" else (h_bits, h_wide)
    ties = (x.view(np.uint32) & 0xFFFF) == 0x8000 if kind == "bfloat16" else None
    assert ties is None or ties.sum() >= 100  # the halfway values are really there
    assert_bits_equal(ours, theirs, x, f"{kind} stores")
    np.testing.assert_array_equal(wide, theirs.float().numpy())


def test_opencl_bfloat16_store_keeps_nan_a_nan() -> None:
    """NaN stores as a quiet bfloat16 NaN (a rounding carry must not turn it into inf), float16 NaN stays NaN."""
    if not yr.is_backend_available("opencl"):
        pytest.skip("the opencl backend is not available here")
    x = np.array([0x7FFFFFFF, 0x7F800001, 0xFFFFFFFF, 0x7FC00000], np.uint32).view(np.float32)
    _, _, b_wide, h_wide = run_stores(x)
    assert np.isnan(b_wide).all() and np.isnan(h_wide).all()
