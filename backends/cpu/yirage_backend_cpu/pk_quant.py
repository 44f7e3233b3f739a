"""GEMV task bodies over Q8_0 / Q4_0 weights (GGUF blocks, yirage.quant), dequantized in registers.

A row of an (N, K) matrix is K/32 blocks: an IEEE half scale, then the quants
(Q8_0: 32 int8; Q4_0: 16 bytes, element i in the low nibble of byte i and
element i + 16 in its high nibble, value = nibble - 8). Block and row sizes
are even, so every scale is a 2-byte-aligned uint16 of the same buffer.

Like the float tile (pk_tasks.linear_f32), a task walks its rows one after
another (one sequential stream) and dots each with every batch row of x.
Each block's 32 products are summed, then scaled once: ``s += d * (x . q)``.
Q4_0 folds the -8 offset out of the inner loop: ``x . (q - 8) = x . q - 8 sum(x)``,
with the per-block sums of x computed once per task.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import njit

from yirage_backend_cpu.kernel_lib import FASTMATH, as_pointer, half_to_float
from yirage_backend_cpu.quant_dot import (
    dot_q4,
    dot_q4_x16_row,
    dot_q8,
    dot_q8_x16_row,
    quantize_x16,
)
from yirage_backend_cpu.sources import tie_caches_to_sources

U = np.uint64
F = np.float32
OPTS = {"fastmath": FASTMATH, "error_model": "numpy", "nogil": True, "cache": True}  # as pk_tasks.OPTS

# dtype codes of the CPU runtime's address table (after pk_tasks' F32, BF16, F16, I64); the X codes are the
# same formats with a non-finite block scale somewhere (hand-made blocks): their rows take the float path,
# which keeps torch's inf/NaN results (integer partial sums times an inf scale could turn inf into NaN)
Q8_0, Q4_0, Q8_0X, Q4_0X = 4, 5, 6, 7
BLOCK = 32
Q8_BYTES, Q4_BYTES = 34, 18


@njit(inline="always", **OPTS)
def u8s(address, n):  # type: ignore[no-untyped-def]
    return numba.carray(as_pointer(address), (n,), np.uint8)


@njit(inline="always", **OPTS)
def block_bytes(dtype):  # type: ignore[no-untyped-def]
    return Q8_BYTES if dtype == Q8_0 or dtype == Q8_0X else Q4_BYTES


@njit(inline="always", **OPTS)
def is_quantized(dtype):  # type: ignore[no-untyped-def]
    return dtype >= Q8_0


def dtype_code(fmt: str, blocks: Any) -> int:
    """The address-table code of a QuantizedTensor's blocks (uint8 torch tensor of ``fmt``)."""
    import torch

    bb = Q8_BYTES if fmt == "q8_0" else Q4_BYTES
    scales = blocks.reshape(-1, bb)[:, :2].contiguous().view(torch.float16)
    finite = bool(torch.isfinite(scales).all())
    return (Q8_0 if fmt == "q8_0" else Q4_0) + (0 if finite else 2)


@njit(inline="always", **OPTS)
def row_bytes(dtype, k):  # type: ignore[no-untyped-def]
    return (k // BLOCK) * block_bytes(dtype)


@njit(**OPTS)
def linear_q(xs, batch, k, w_addr, dtype, n0, n1, out, out_cols, res, bias, work):  # type: ignore[no-untyped-def]
    """out[b, n] = x[b] . W[n] (+ bias[n]) (+ res[b, n]) for rows n0..n1 of a Q8_0 / Q4_0 matrix.

    ``work``: float32 scratch of at least batch * k values (x as int16 and its block scales).
    """
    nb = k // BLOCK
    rb = row_bytes(dtype, k)
    x0 = xs.ctypes.data
    xq0 = work.ctypes.data
    dx0 = xq0 + batch * k * 2
    exact = dtype >= Q8_0X
    dtype = dtype - 2 if exact else dtype
    ints = not exact and quantize_x16(x0, batch * nb, xq0, dx0) == 1
    for n in range(n0, n1):  # one row at a time: a single sequential stream (two interleaved rows
        # measured half the DRAM bandwidth: 7.5 against 13.8 GB/s on one thread)
        row = w_addr + n * rb
        for b in range(batch):
            if ints and dtype == Q8_0:
                s = dot_q8_x16_row(xq0 + b * k * 2, dx0 + b * nb * 4, row, nb)
            elif ints:
                s = dot_q4_x16_row(xq0 + b * k * 2, dx0 + b * nb * 4, row, nb)
            else:
                s = _float_row(x0 + b * k * 4, row, nb, dtype)
            store_row(out, out_cols, U(b), U(n), s, res, bias)


@njit(inline="always", **OPTS)
def _float_row(x_addr, row, nb, dtype):  # type: ignore[no-untyped-def]
    """x with NaN or inf: float32 all the way, so the row's result is torch's."""
    return dot_q8(x_addr, row, nb) if dtype == Q8_0 else dot_q4(x_addr, row, nb)


@njit(inline="always", **OPTS)
def store_row(out, out_cols, b, n, s, res, bias):  # type: ignore[no-untyped-def]
    """out[b, n] = s (+ bias[n]) (+ res[b, n]): the epilogue of every GEMV task body (pk_tasks' too)."""
    if bias.shape[0]:
        s += bias[n]
    if res.shape[0]:
        s += res[b * U(out_cols) + n]
    out[b * U(out_cols) + n] = s


@njit(**OPTS)
def dequantize_row(w_addr, dtype, k, row, c0, count, dst):  # type: ignore[no-untyped-def]
    """Columns [c0, c0 + count) of one row as float32 (the embed lookup: any column range, any block)."""
    bb = block_bytes(dtype)
    rb = row_bytes(dtype, k)
    dtype = dtype - 2 if dtype >= Q8_0X else dtype
    base = row * rb
    raw = u8s(w_addr, base + rb)
    for c in range(c0, c0 + count):
        j, i = c // BLOCK, c % BLOCK
        at = base + j * bb
        d = half_to_float(np.uint16(np.uint32(raw[at]) | (np.uint32(raw[at + 1]) << np.uint32(8))))
        if dtype == Q8_0:
            v = F(np.int8(raw[at + 2 + i]))
        else:
            byte = raw[at + 2 + i % (BLOCK // 2)]
            v = F((byte & 15) if i < BLOCK // 2 else (byte >> 4)) - F(8)
        dst[c - c0] = v * d


tie_caches_to_sources(globals())  # after every cached function above is defined
