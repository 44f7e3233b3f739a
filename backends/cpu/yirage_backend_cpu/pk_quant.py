"""GEMV task bodies over Q8_0 / Q4_0 weights (GGUF blocks, yirage.quant), dequantized in registers.

A row of an (N, K) matrix is K/32 blocks: an IEEE half scale, then the quants
(Q8_0: 32 int8; Q4_0: 16 bytes, element i in the low nibble of byte i and
element i + 16 in its high nibble, value = nibble - 8). Block and row sizes
are even, so every scale is a 2-byte-aligned uint16 of the same buffer.

Like the float tile (pk_tasks.linear_f32), a task walks its rows one after
another (one sequential stream) and dots each with every batch row of x.
Each block's 32 products are summed, then scaled once: ``s += d * (x . q)``.
Matrices whose row count is a multiple of 8 arrive repacked in groups of 8
rows (quant_group, codes Q4_0G and Q8_0G): a task then walks its groups,
eight rows per pass.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import njit, types

from yirage_backend_cpu.kernel_lib import FASTMATH, as_pointer, half_to_float
from yirage_backend_cpu.pk_entry import task_entry
from yirage_backend_cpu.quant_dot import (
    dot_q4,
    dot_q4_x16_row,
    dot_q8,
    dot_q8_x16_row,
    quantize_x16,
)
from yirage_backend_cpu.quant_group import (
    GROUP,
    GROUP_X,
    Q4_GROUP_BYTES,
    Q8_GROUP_BYTES,
    dot_q4_group,
    dot_q4_group4,
    dot_q8_group,
    dot_q8_group4,
    quantize_x16_split,
)
from yirage_backend_cpu.sources import tie_caches_to_sources

U = np.uint64
F = np.float32
OPTS = {"fastmath": FASTMATH, "error_model": "numpy", "nogil": True, "cache": True}  # as pk_tasks.OPTS

# dtype codes of the CPU runtime's address table (after pk_tasks' F32, BF16, F16, I64); the X codes are the
# same formats with a non-finite block scale somewhere (hand-made blocks): their rows take the float path,
# which keeps torch's inf/NaN results (integer partial sums times an inf scale could turn inf into NaN);
# Q4_0G / Q8_0G: Q4_0 / Q8_0 with finite scales, repacked in 8-row groups (quant_group.repack)
Q8_0, Q4_0, Q8_0X, Q4_0X, Q4_0G, Q8_0G = 4, 5, 6, 7, 8, 9
BLOCK = 32
Q8_BYTES, Q4_BYTES = 34, 18


@njit(inline="always", **OPTS)
def u8s(address, n):  # type: ignore[no-untyped-def]
    return numba.carray(as_pointer(address), (n,), np.uint8)


@njit(inline="always", **OPTS)
def block_bytes(dtype):  # type: ignore[no-untyped-def]
    return Q8_BYTES if dtype == Q8_0 or dtype == Q8_0X or dtype == Q8_0G else Q4_BYTES


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
    if dtype == Q4_0G or dtype == Q8_0G:
        linear_groups(xs, batch, k, w_addr, dtype, n0, n1, out, out_cols, res, bias, work)
        return
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
            out[U(b) * U(out_cols) + U(n)] = s
    finish_rows(out, out_cols, batch, n0, n1, res, bias)


def _linear_q_c(x, batch, k, w_addr, dtype, n0, n1, out, out_len, out_cols, res, res_len, bias, bias_len, work,
                work_len):  # type: ignore[no-untyped-def]
    linear_q(_f32s(x, batch * k), batch, k, w_addr, dtype, n0, n1, _f32s(out, out_len), out_cols, _f32s(res, res_len),
             _f32s(bias, bias_len), _f32s(work, work_len))


# linear_q behind a C entry point, compiled on first use (pk_entry): a float model never compiles the quantized
# kernels (a third of the decode runtime's cold compile); pk_tasks.linear calls it by address (call_c)
linear_q_entry = task_entry(_linear_q_c, types.void(*(types.int64,) * 16))


def quantized_entry(codes: Any) -> int:
    """The address ``linear`` calls for quantized matrices: ``linear_q_entry``'s, compiled now, where any of the
    dtype ``codes`` (an address table's) is a quantized format; else 0 (never called)."""
    from yirage_backend_cpu.pk_entry import compiled

    return int(compiled(linear_q_entry).address) if any(is_quantized.py_func(int(c)) for c in codes) else 0


@njit(inline="always", **OPTS)
def _f32s(address, n):  # type: ignore[no-untyped-def]
    return numba.carray(as_pointer(address), (n,), np.float32)


@njit(inline="always", **OPTS)
def group_dot(q8, four, lo, hi, sx, dx, group, nb, out, ahead):  # type: ignore[no-untyped-def]
    """quant_group's dot of one 8-row group with one x row or four (``four``), Q8_0 or Q4_0 (``q8``)."""
    if q8 and four:
        dot_q8_group4(lo, hi, sx, dx, group, nb, out, ahead)
    elif q8:
        dot_q8_group(lo, hi, sx, dx, group, nb, out, ahead)
    elif four:
        dot_q4_group4(lo, hi, sx, dx, group, nb, out, ahead)
    else:
        dot_q4_group(lo, hi, sx, dx, group, nb, out, ahead)


@njit(**OPTS)
def linear_groups(xs, batch, k, w_addr, dtype, n0, n1, out, out_cols, res, bias, work):  # type: ignore[no-untyped-def]
    """linear_q on a Q4_0G or Q8_0G matrix: every group that holds a row of n0..n1, whole, eight rows per pass; rows
    outside the task's range are computed and dropped (tasks of 8-aligned rows drop none)."""
    nb = k // BLOCK
    lo0 = work.ctypes.data  # x's low bytes, high bytes, block scales and sums of high bytes (quant_group)
    hi0 = lo0 + batch * k
    dx0 = hi0 + batch * k
    sx0 = dx0 + batch * nb * 4
    if quantize_x16_split(xs.ctypes.data, batch * nb, lo0, hi0, sx0, dx0) == 1:
        gb = nb * (Q8_GROUP_BYTES if dtype == Q8_0G else Q4_GROUP_BYTES)
        g1 = (n1 + GROUP - 1) // GROUP
        # the dots' outputs (8 per x row, 4 rows at most), past x's 2.25 batch k bytes (batch k >= 128 when 4 rows
        # are dotted at once; one row's 8 fit past them for any k >= 32)
        eights = work[batch * k - GROUP * GROUP_X:batch * k] if batch >= GROUP_X else work[batch * k - GROUP:batch * k]
        for g in range(n0 // GROUP, g1):
            b = 0
            while b < batch:  # batch decode: four x rows per pass over the group while four are left
                rows = GROUP_X if b + GROUP_X <= batch else 1
                ahead = w_addr + g1 * gb if b == 0 else 0  # prefetch while reading the first batch row
                group_dot(dtype == Q8_0G, rows == GROUP_X, lo0 + b * k, hi0 + b * k, sx0 + b * nb * 4,
                          dx0 + b * nb * 4, w_addr + g * gb, nb, eights.ctypes.data, ahead)
                for q in range(rows):
                    for r in range(max(n0 - g * GROUP, 0), min(n1 - g * GROUP, GROUP)):
                        out[U(b + q) * U(out_cols) + U(g * GROUP + r)] = eights[q * GROUP + r]
                b += rows
        finish_rows(out, out_cols, batch, n0, n1, res, bias)
        return
    row = work[:k]  # x holds inf or NaN: each row dequantized, then a float32 dot, so results are torch's
    for n in range(n0, n1):
        dequantize_row(w_addr, dtype, k, n, 0, k, row)
        for b in range(batch):
            s = F(0)
            for i in range(k):
                s += xs[b * k + i] * row[i]
            out[U(b) * U(out_cols) + U(n)] = s
    finish_rows(out, out_cols, batch, n0, n1, res, bias)


@njit(inline="always", **OPTS)
def _float_row(x_addr, row, nb, dtype):  # type: ignore[no-untyped-def]
    """x with NaN or inf: float32 all the way, so the row's result is torch's."""
    return dot_q8(x_addr, row, nb) if dtype == Q8_0 else dot_q4(x_addr, row, nb)


@njit(**OPTS)
def finish_rows(out, out_cols, batch, n0, n1, res, bias):  # type: ignore[no-untyped-def]
    """out[b, n] += bias[n], then += res[b, n], for rows n0..n1: the epilogue of every GEMV task body (pk_tasks'
    too), once per task after its dots. Per row it measured 10 ns a call (numba counts references of the arrays
    passed in, even inlined), as much as the dot of a whole Q4_0 row at K = 576."""
    if bias.shape[0] == 0 and res.shape[0] == 0:
        return
    cols = U(out_cols)
    for b in range(U(batch)):
        for n in range(U(n0), U(n1)):
            i = b * cols + n
            s = out[i]
            if bias.shape[0]:
                s += bias[n]
            if res.shape[0]:
                s += res[i]
            out[i] = s


@njit(**OPTS)
def dequantize_row(w_addr, dtype, k, row, c0, count, dst):  # type: ignore[no-untyped-def]
    """Columns [c0, c0 + count) of one row as float32 (the embed lookup: any column range, any block)."""
    bb = block_bytes(dtype)
    rb = row_bytes(dtype, k)
    if dtype == Q4_0G or dtype == Q8_0G:  # block j of row 8g + r: scale at 2r of the group's block, then the
        g, r = row // GROUP, row % GROUP  # quants in chunks of 4 bytes per row (quant_group)
        raw = u8s(w_addr, (g + 1) * GROUP * rb)
        for c in range(c0, c0 + count):
            j, i = c // BLOCK, c % BLOCK
            at = g * GROUP * rb + j * GROUP * bb
            d = half_to_float(np.uint16(np.uint32(raw[at + 2 * r]) | (np.uint32(raw[at + 2 * r + 1]) << np.uint32(8))))
            if dtype == Q8_0G:
                v = F(np.int8(raw[at + 16 + 32 * (i // 4) + 4 * r + i % 4]))
            else:
                e = i % (BLOCK // 2)
                byte = raw[at + 16 + 32 * (e // 4) + 4 * r + e % 4]
                v = F((byte & 15) if i < BLOCK // 2 else (byte >> 4)) - F(8)
            dst[c - c0] = v * d
        return
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
