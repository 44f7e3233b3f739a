"""Task bodies of the CPU PersistentKernel runtime, as numba functions over raw addresses.

Every tensor is reached through its address (``tensor.data_ptr()``) in one
table, so one compiled function can touch every weight, activation and the
KV caches. Weights may be float32, bfloat16 or float16; narrow ones are
widened to float32 in registers, so a decode step streams half the bytes.
Matrices may also be Q8_0 / Q4_0 blocks, dequantized in registers (pk_quant).

``execute`` runs one task: it reads its layer through the core encoder's
descriptor row (``lp``/``lf``, columns named by yirage.persistent.specs) and
calls the kind's body. This file is what the CPU backend adds to the core's
LayerSpec table; the scheduling loop lives in pk_runtime.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import njit, types
from numba.core.ccallback import CFunc
from numba.core.registry import CPUDispatcher
from numba.extending import overload

from yirage.persistent.control import Ctl, CtlError
from yirage.persistent.runtime import register_task_bodies
from yirage.persistent.specs import (
    LAYER_SPECS,
    SCREEN_OVERFLOW,
    SCREEN_UNDERFLOW,
    FloatCol,
    IntCol,
    kind_code,
    layout_fingerprint,
)
from yirage_backend_cpu.atomics import atomic_add, atomic_store
from yirage_backend_cpu.float_dot import (
    CHUNK,
    TILE_W,
    TILE_X,
    dot_bf16_quad,
    dot_bf16_row,
    dot_bf16_tile,
    dot_f16_quad,
    dot_f16_row,
    dot_f16_tile,
    dot_f32_quad,
    dot_f32_row,
    dot_f32_tile,
)
from yirage_backend_cpu.kernel_lib import (
    FASTMATH,
    as_pointer,
    fexp,
    float_to_bf16,
    float_to_half,
    fmax,
    fsilu,
    half_to_float,
    racc,
    rfma,
)
from yirage_backend_cpu.pk_comm import communicate
from yirage_backend_cpu.pk_entry import (
    FLOAT_ATTENTION_ENTRY,
    LINEAR_ENTRY,
    NARROW_ATTENTION_ENTRY,
    QUANT_ENTRY,
    SAMPLE_ENTRY,
    call_c,
    recompile,
    run_task,
    task_entry,
)
from yirage_backend_cpu.pk_quant import dequantize_row, finish_rows, is_quantized, row_bytes
from yirage_backend_cpu.sources import tie_caches_to_sources

U = np.uint64
F = np.float32
OPTS = {"fastmath": FASTMATH, "error_model": "numpy", "nogil": True, "cache": True}
CACHED = {"jit_options": {"fastmath": FASTMATH, "error_model": "numpy"}}  # an @overload's body: OPTS' semantics

F32, BF16, F16, I64 = 0, 1, 2, 3  # tensor dtype codes of the address table (quantized: pk_quant's Q8_0, Q4_0)
# flags: the control buffer's header (yirage.persistent.control), as plain ints numba freezes into the code
STOP, ERROR, ERR_VALUE, ERR_ROW = (int(s) for s in (Ctl.STOP, Ctl.ERROR, Ctl.ERR_VALUE, Ctl.ERR_ROW))
ERR_TOKEN = int(CtlError.TOKEN)  # flags[ERROR]: a token id outside the embed table (pk_comm: a failed collective)

# Kind codes and descriptor columns come from the core's LayerSpec table (yirage.persistent.specs); numba
# freezes these module globals into the compiled code, and LAYOUT makes a changed table recompile it.
EMBED, RMSLIN, ATTN, LINRES, SILURES, ARGMAX, SAMPLE, ALLRED, ALLGAT, SCREEN = (kind_code(k) for k in (
    "embed", "rmsnorm_linear", "attention", "linear_with_residual", "silu_mul_linear_with_residual", "argmax",
    "sample", "allreduce", "allgather", "screened_logits"))
# the kinds execute() has a branch for, by the kind code it tests (the collectives' branch hands the layer to
# pk_comm's thread); checked against the core's LayerSpec table at import
TASKS = register_task_bodies("cpu", {
    "embed": EMBED, "rmsnorm_linear": RMSLIN, "attention": ATTN, "linear_with_residual": LINRES,
    "silu_mul_linear_with_residual": SILURES, "argmax": ARGMAX, "sample": SAMPLE, "allreduce": ALLRED,
    "allgather": ALLGAT, "screened_logits": SCREEN,
}, where="yirage_backend_cpu.pk_tasks (a branch of execute, its kind code named in pk_tasks.TASKS)")
C_KIND, C_OUT, C_K, C_N, C_TASKS = (int(c) for c in (IntCol.KIND, IntCol.OUTPUT, IntCol.K, IntCol.N, IntCol.TASKS))
C_KV_HEADS, C_GROUP, C_HEAD_DIM, C_SEQ = (int(c) for c in (IntCol.KV_HEADS, IntCol.GROUP, IntCol.HEAD_DIM,
                                                           IntCol.CACHE_SEQ))
C_TOP_K, C_SEED = int(IntCol.TOP_K), int(IntCol.SEED)
# the CPU runtime's own columns after the core's (pk_runtime fills them): an attention layer's chunks per KV head,
# and the address-table indices of its partial sums and its per-KV-head arrival counts (1, -1, -1: no split)
C_CHUNKS, C_PARTS, C_ARRIVED = len(IntCol), len(IntCol) + 1, len(IntCol) + 2
RUNTIME_COLUMNS = 3
F_EPS, F_TEMPERATURE, F_TOP_P = (int(c) for c in (FloatCol.EPS, FloatCol.TEMPERATURE, FloatCol.TOP_P))


def _columns(kind: str, *roles: str) -> tuple[int, ...]:
    return tuple(int(LAYER_SPECS[kind].column(role)) for role in roles)


(PICK_X,) = _columns("argmax", "input")
if _columns("sample", "input") != (PICK_X,):
    raise AssertionError("argmax and sample must keep their input in the same descriptor column")
(EMB_W,) = _columns("embed", "weight")
RMS_X, RMS_W, RMS_NORM, RMS_BIAS = _columns("rmsnorm_linear", "input", "weight_linear", "weight_norm", "bias")
LIN_X, LIN_W, LIN_RES = _columns("linear_with_residual", "input", "weight", "residual")
SILU_X, SILU_W, SILU_RES = _columns("silu_mul_linear_with_residual", "input", "weight", "residual")
ATT_QKV, ATT_KC, ATT_VC, ATT_COS, ATT_SIN = _columns("attention", "input", "k_cache", "v_cache", "cos", "sin")
SCR_IN, SCR_X, SCR_NORM, SCR_W, SCR_BOUND = _columns("screened_logits", "input", "hidden", "weight_norm", "weight",
                                                     "row_bound")
LAYOUT = layout_fingerprint()


@njit(inline="always", **OPTS)
def f32s(address, n):  # type: ignore[no-untyped-def]
    return numba.carray(as_pointer(address), (n,), np.float32)


@njit(inline="always", **OPTS)
def u16s(address, n):  # type: ignore[no-untyped-def]
    return numba.carray(as_pointer(address), (n,), np.uint16)


@njit(inline="always", **OPTS)
def i64s(address, n):  # type: ignore[no-untyped-def]
    return numba.carray(as_pointer(address), (n,), np.int64)


@njit(inline="always", **OPTS)
def bf16(bits):  # type: ignore[no-untyped-def]
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(inline="always", **OPTS)
def f16(bits):  # type: ignore[no-untyped-def]
    return half_to_float(np.uint16(bits))


@njit(inline="always", **OPTS)
def load(address, index, dtype):  # type: ignore[no-untyped-def]
    """One element of any float tensor, as float32 (for small, non-hot reads)."""
    if dtype == F32:
        return f32s(address, index + 1)[index]
    bits = u16s(address, index + 1)[index]
    return bf16(bits) if dtype == BF16 else f16(bits)


# -- the GEMV tile: out[b, n] = x[b] . W[n] (+ bias[n]) (+ residual[b, n]) ------------------------


# linear_float walks W one row at a time: a task's rows are one contiguous block, so the loads form a single
# sequential stream. A tile of 4 rows (4 interleaved streams, fewer horizontal sums) measured 1.4-2.1x
# slower at K = 512-1536 on the W6 lm_head shape (20 GB/s against 33-37 GB/s for one row at a time, a torch
# sum reading 33 GB/s). The row (K elements) stays in L1 while the batch's rows of x are dotted with it.
# The dot over whole lines is float_dot's (prefetching ahead as it reads, for the first batch row), the
# last K % 32 values a scalar loop.


@njit(**OPTS)
def linear_float(xs, batch, k, w_addr, w_dtype, n0, n1, out, out_cols, res, bias):  # type: ignore[no-untyped-def]
    size = 4 if w_dtype == F32 else 2
    chunks = k // CHUNK
    limit = w_addr + n1 * k * size
    x0 = xs.ctypes.data
    quads = batch - batch % TILE_X
    nn = n0
    while quads > 0 and nn + TILE_W <= n1:  # batch decode: tiles of 2 weight rows x 4 batch rows
        row = w_addr + nn * k * size
        for b in range(0, quads, TILE_X):
            x = x0 + b * k * 4
            ahead = limit if b == 0 else 0
            if w_dtype == F32:
                t = dot_f32_tile(x, k * 4, row, k * size, chunks, ahead)
            elif w_dtype == BF16:
                t = dot_bf16_tile(x, k * 4, row, k * size, chunks, ahead)
            else:
                t = dot_f16_tile(x, k * 4, row, k * size, chunks, ahead)
            for r in range(TILE_W):
                for q in range(TILE_X):
                    out[U(b + q) * U(out_cols) + U(nn + r)] = row_tail(xs, b + q, k, w_addr, w_dtype, nn + r, chunks,
                                                                       t[r * TILE_X + q])
        for r in range(TILE_W):
            row_dots(xs, quads, batch, k, w_addr, w_dtype, nn + r, chunks, 0, out, out_cols)
        nn += TILE_W
    for n in range(nn, n1):
        row_dots(xs, 0, batch, k, w_addr, w_dtype, n, chunks, limit, out, out_cols)
    finish_rows(out, out_cols, batch, n0, n1, res, bias)


@njit(inline="always", **OPTS)
def row_dots(xs, b0, b1, k, w_addr, w_dtype, nn, chunks, limit, out, out_cols):  # type: ignore[no-untyped-def]
    """out[b, nn] = x[b] . W[nn] for batch rows b0..b1: four at a time (one weight load for the four), then
    one by one; the first prefetches up to ``limit`` (0: none)."""
    size = 4 if w_dtype == F32 else 2
    row = w_addr + nn * k * size
    x0 = xs.ctypes.data
    quads = b0 + (b1 - b0) - (b1 - b0) % TILE_X
    for b in range(b0, quads, TILE_X):
        x = x0 + b * k * 4
        ahead = limit if b == b0 else 0
        if w_dtype == F32:
            t = dot_f32_quad(x, k * 4, row, 0, chunks, ahead)
        elif w_dtype == BF16:
            t = dot_bf16_quad(x, k * 4, row, 0, chunks, ahead)
        else:
            t = dot_f16_quad(x, k * 4, row, 0, chunks, ahead)
        for q in range(TILE_X):
            out[U(b + q) * U(out_cols) + U(nn)] = row_tail(xs, b + q, k, w_addr, w_dtype, nn, chunks, t[q])
    for b in range(quads, b1):
        x = x0 + b * k * 4
        ahead = limit if b == b0 else 0
        if w_dtype == F32:
            s0 = dot_f32_row(x, row, chunks, ahead)
        elif w_dtype == BF16:
            s0 = dot_bf16_row(x, row, chunks, ahead)
        else:
            s0 = dot_f16_row(x, row, chunks, ahead)
        out[U(b) * U(out_cols) + U(nn)] = row_tail(xs, b, k, w_addr, w_dtype, nn, chunks, s0)


@njit(inline="always", **OPTS)
def row_tail(xs, b, k, w_addr, w_dtype, nn, chunks, s):  # type: ignore[no-untyped-def]
    """``s`` (the dot over whole chunks) plus the last K % 32 terms of batch row ``b`` and weight row ``nn``."""
    for i in range(chunks * CHUNK, k):
        s += xs[b * k + i] * load(w_addr, nn * k + i, w_dtype)
    return s


@njit(inline="always", **OPTS)
def rms_rows(x, g, xs, batch, k, eps):  # type: ignore[no-untyped-def]
    """xs[b] = x[b] / sqrt(mean(x[b]^2) + eps) * g for ``batch`` rows of ``k``: the rows an rmsnorm_linear task
    multiplies, and the ones ``screened_rows`` recomputes exact logits from (the same code: the same bits)."""
    kk = U(k)  # unsigned indices: no wraparound checks, so the loops vectorize
    for b in range(U(batch)):
        xb = x[b * kk:][:k]
        ob = xs[b * kk:][:k]
        ss = np.float32(0)
        for i in range(kk):
            v = xb[i]
            ss = rfma(ss, v, v)
        inv = np.float32(1.0) / math.sqrt(ss / np.float32(k) + np.float32(eps))
        for i in range(kk):
            ob[i] = xb[i] * inv * g[i]


SCREEN_LANES = 8


@njit(**OPTS)
def screened_rows(screen, x, g, w_addr, w_dtype, bound, out, batch, k, vocab, eps, xs, work, entry, none):
    # type: ignore[no-untyped-def]
    """A screened_logits task (PersistentKernel.screened_logits_layer): per batch row, the exact logits of the rows
    whose screen score can hold the maximum (``screen[i] + r_i >= max_j screen[j] - r_j``, in float64, with
    ``r_i = bound[i] * |x|_1 + k * SCREEN_UNDERFLOW``, x the normalized row), -inf for the others. The exact ones come
    from the projections' own entry point (``entry``, linear_entry) one weight row at a time: the bits
    rmsnorm_linear gives that row in any batch (its tiles and single rows agree bit for bit,
    tests/test_float_dot.py). A screen or bound that is not finite, or an r_i that reaches SCREEN_OVERFLOW, is not
    trusted: the row's logits are then all computed exactly."""
    for b in range(batch):
        rms_rows(x[b * k:][:k], g, xs, 1, k, eps)
        total = 0.0
        for i in range(k):
            total += abs(np.float64(xs[i]))
        scores = screen[b * vocab:][:vocab]
        logits = out[b * vocab:][:vocab]
        tiny = k * SCREEN_UNDERFLOW
        lows = np.full(SCREEN_LANES, -np.inf)  # independent lanes and selects: the loop vectorizes (argmax_row)
        highs = np.zeros(SCREEN_LANES)  # the largest r
        odd = np.zeros(SCREEN_LANES)  # sums of s - s and r - r: 0, or NaN once a score or bound is not finite
        full = vocab - vocab % SCREEN_LANES
        for i in range(0, full, SCREEN_LANES):
            for j in range(SCREEN_LANES):
                s = np.float64(scores[i + j])
                r = np.float64(bound[i + j]) * total + tiny
                v = s - r
                lows[j] = v if v > lows[j] else lows[j]
                highs[j] = r if r > highs[j] else highs[j]
                odd[j] += (s - s) + (r - r)
        low, high, check = -np.inf, 0.0, total - total
        for j in range(SCREEN_LANES):
            low = lows[j] if lows[j] > low else low
            high = highs[j] if highs[j] > high else high
            check += odd[j]
        for i in range(full, vocab):
            s = np.float64(scores[i])
            r = np.float64(bound[i]) * total + tiny
            low = s - r if s - r > low else low
            high = r if r > high else high
            check += (s - s) + (r - r)
        logits[:] = -np.inf
        finite = check == 0.0 and high < SCREEN_OVERFLOW
        if not finite:
            call_linear(entry, xs, 1, k, w_addr, w_dtype, 0, vocab, logits, vocab, none, none, work, 0)
            continue
        for i in range(vocab):
            if np.float64(scores[i]) + (np.float64(bound[i]) * total + tiny) >= low:
                call_linear(entry, xs, 1, k, w_addr, w_dtype, i, i + 1, logits, vocab, none, none, work, 0)


@njit(inline="always", **OPTS)
def linear(xs, batch, k, w_addr, w_dtype, n0, n1, out, out_cols, res, bias, work, quant):
    # type: ignore[no-untyped-def]
    """Rows n0..n1 of x @ W.T: the float tiles, or Q8_0 / Q4_0 blocks through ``quant``, the address of
    pk_quant.linear_q_entry (compiled apart, only for a model that has quantized matrices; 0: none, and the
    rows come out NaN rather than a call to address 0)."""
    if w_dtype == F32 or w_dtype == BF16 or w_dtype == F16:
        linear_float(xs, batch, k, w_addr, w_dtype, n0, n1, out, out_cols, res, bias)
    else:
        call_quantized(quant, xs, batch, k, w_addr, w_dtype, n0, n1, out, out_cols, res, bias, work)


@njit(inline="always", **OPTS)
def call_quantized(quant, xs, batch, k, w_addr, w_dtype, n0, n1, out, out_cols, res, bias, work):
    # type: ignore[no-untyped-def]
    """Rows n0..n1 of x @ W.T for Q8_0 / Q4_0 blocks (pk_quant.is_quantized) through ``quant``, linear_q_entry's
    address (0: none compiled; the rows come out NaN rather than a call to address 0)."""
    if quant == 0:
        nan_rows(out, out_cols, batch, n0, n1)
        return
    call_c(quant, (xs.ctypes.data, batch, k, w_addr, w_dtype, n0, n1, out.ctypes.data, out.shape[0], out_cols,
                   res.ctypes.data, res.shape[0], bias.ctypes.data, bias.shape[0], work.ctypes.data, work.shape[0]))


@njit(inline="always", **OPTS)
def nan_rows(out, out_cols, batch, n0, n1):  # type: ignore[no-untyped-def]
    for b in range(batch):
        for n in range(n0, n1):
            out[b * out_cols + n] = np.float32(np.nan)


def _linear_c(x, x_len, batch, k, w_addr, w_dtype, n0, n1, out, out_len, out_cols, res, res_len, bias, bias_len, work,
              work_len, quant):  # type: ignore[no-untyped-def]
    linear(f32s(x, x_len), batch, k, w_addr, w_dtype, n0, n1, f32s(out, out_len), out_cols, f32s(res, res_len),
           f32s(bias, bias_len), f32s(work, work_len), quant)


# linear behind a C entry point (pk_entry.LINEAR_ENTRY): its tiles are compiled once, not into execute and again
# into the prompt's projections (prompt_linear); on a cold cache that was 4 of execute's 11 s of compile
linear_entry = task_entry(_linear_c, types.void(*(types.int64,) * 18))


def _linear_blocks_c(x, x_len, batch, k, w_addr, w_dtype, n0, n1, out, out_len, out_cols, res, res_len, bias, bias_len,
                     work, work_len, quant):  # type: ignore[no-untyped-def]
    if is_quantized(w_dtype):
        call_quantized(quant, f32s(x, x_len), batch, k, w_addr, w_dtype, n0, n1, f32s(out, out_len), out_cols,
                       f32s(res, res_len), f32s(bias, bias_len), f32s(work, work_len))
    else:  # a float matrix needs linear_entry's tiles: NaN rows rather than its bytes read as blocks
        nan_rows(f32s(out, out_len), out_cols, batch, n0, n1)


# linear_entry's Q8_0 / Q4_0 half alone, with its signature: the LINEAR_ENTRY of a model whose matrices are all
# quantized, so that it never compiles the float tiles (4-5 s of its cold start on 2 cores), while execute and the
# prompt's projections call the one entry point as before
linear_blocks_entry = task_entry(_linear_blocks_c, types.void(*(types.int64,) * 18))

#: (task kind, its weight's column): the matrices execute's tasks multiply through call_linear
LINEAR_WEIGHTS = ((RMSLIN, RMS_W), (LINRES, LIN_W), (SILURES, SILU_W), (SCREEN, SCR_W))


@njit(inline="always", **OPTS)
def call_linear(entry, xs, batch, k, w_addr, w_dtype, n0, n1, out, out_cols, res, bias, work, quant):
    # type: ignore[no-untyped-def]
    """``linear(...)`` through ``linear_entry``'s address ``entry`` (or ``linear_blocks_entry``'s, for Q8_0 / Q4_0
    blocks only; 0: none compiled; the rows come out NaN rather than a call to address 0)."""
    if entry == 0:
        nan_rows(out, out_cols, batch, n0, n1)
        return
    call_c(entry, (xs.ctypes.data, xs.shape[0], batch, k, w_addr, w_dtype, n0, n1, out.ctypes.data, out.shape[0],
                   out_cols, res.ctypes.data, res.shape[0], bias.ctypes.data, bias.shape[0], work.ctypes.data,
                   work.shape[0], quant))


# -- RoPE, attention, pickers ---------------------------------------------------------------


@njit(inline="always", **OPTS)
def rope(src, dst, cos, sin, d):  # type: ignore[no-untyped-def]
    h = d // 2
    for i in range(h):
        dst[i] = src[i] * cos[i] - src[i + h] * sin[i]
    for i in range(h, d):
        dst[i] = src[i] * cos[i] + src[i - h] * sin[i]


def cache_load(cache, index, code):  # type: ignore[no-untyped-def]
    """One cached key/value element as float32: a float32 cache's own, a 16-bit one's widened (``code``)."""
    raise NotImplementedError("cache_load is only callable from numba-compiled code")


@overload(cache_load, **CACHED)
def _cache_load(cache, index, code):  # type: ignore[no-untyped-def]
    if cache.dtype == types.float32:
        return lambda cache, index, code: cache[index]

    def narrow(cache, index, code):  # type: ignore[no-untyped-def]
        return bf16(cache[index]) if code == BF16 else f16(cache[index])

    return narrow


def cache_store(cache, index, x, code):  # type: ignore[no-untyped-def]
    """Store float32 ``x`` into a cache element: as is, or rounded to the 16-bit cache's type (``code``)."""
    raise NotImplementedError("cache_store is only callable from numba-compiled code")


@overload(cache_store, **CACHED)
def _cache_store(cache, index, x, code):  # type: ignore[no-untyped-def]
    if cache.dtype == types.float32:
        def store(cache, index, x, code):  # type: ignore[no-untyped-def]
            cache[index] = x

        return store

    def narrow(cache, index, x, code):  # type: ignore[no-untyped-def]
        cache[index] = float_to_bf16(x) if code == BF16 else float_to_half(x)

    return narrow


@njit(**OPTS)
def attention(qkv, b, g, group, d, pos, kc, vc, code, cache_seq, kv_heads, cos, sin, s0, s1, outs, stride, whole,
              scratch):  # type: ignore[no-untyped-def]
    """KV head ``g`` of batch row ``b`` over the cached positions ``s0`` .. ``s1 - 1`` (the whole context, or one
    chunk of it: flash-decoding's split, see ``attention_task``). The chunk that holds ``pos`` first rotates and
    stores the new key and value. The ``group`` query heads that share the KV head run together: each cached key
    and value is read from memory once for all of them (at 2048 positions a head's keys and values are 1 MiB:
    reading them once per query head went to L2 or DRAM again). Each head's scores, softmax and sums keep the
    one-head order.

    Head ``j``'s output goes to ``outs[j * stride:][:d]``: the softmax-weighted values when ``whole`` (the
    chunk is the whole context); else the exp-weighted values, unnormalized, followed by the chunk's largest
    score and its sum of exps (``outs[j * stride + d]``, ``+ d + 1``; ``stride >= d + 2``), which
    ``combine_chunks`` merges.

    ``kc``/``vc``: float32 arrays, or uint16 arrays of bfloat16/float16 bits (``code``): one compiled body per
    array type (a body per dtype constant, 3 inlined copies, tripled the runtime's cold compile: 66 -> 190 s).
    ``scratch``: group * (d + s1 - s0 + 1) + d floats."""
    width = (group + 2) * d
    base = b * (kv_heads * width) + g * width
    cs = cos[pos * d:][:d]
    sn = sin[pos * d:][:d]
    head = ((b * kv_heads + g) * cache_seq) * d
    n = s1 - s0
    qs = scratch[:group * d]
    scores = scratch[group * d:][:group * n]  # head j's at j * n
    top = scratch[group * (d + n):][:group]
    if s0 <= pos < s1:
        new_key = scratch[group * (d + n + 1):][:d]
        rope(qkv[base + group * d:][:d], new_key, cs, sn, d)
        vsrc = qkv[base + (group + 1) * d:][:d]
        at = head + pos * d
        for i in range(d):
            cache_store(kc, at + i, new_key[i], code)
            cache_store(vc, at + i, vsrc[i], code)
    scale = F(1.0 / math.sqrt(d))
    for j in range(group):
        rope(qkv[base + j * d:][:d], qs[j * d:][:d], cs, sn, d)
        top[j] = F(-np.inf)
    for s in range(n):
        key = kc[head + (s0 + s) * d:][:d]
        for j in range(group):
            q = qs[j * d:][:d]
            acc = F(0)
            for i in range(d):
                acc = rfma(acc, q[i], cache_load(key, i, code))
            score = acc * scale
            scores[j * n + s] = score
            top[j] = fmax(top[j], score)  # a NaN score makes the head NaN, as in torch
    for j in range(group):  # softmax in place; loops that vectorize (the max came with the scores)
        row = scores[j * n:][:n]
        mx = top[j]
        total = F(0)
        for s in range(n):
            e = fexp(row[s] - mx)
            row[s] = e
            total = racc(total, e)
        if whole:
            for s in range(n):
                row[s] = row[s] / total
        else:
            outs[j * stride + d] = mx
            outs[j * stride + d + 1] = total
        o = outs[j * stride:][:d]
        for i in range(d):
            o[i] = F(0)
    # o += p[s] * v[s], four positions a pass: each output row read and written once per four value rows
    n4 = n - n % 4
    for s in range(0, n4, 4):
        at = head + (s0 + s) * d
        v0, v1, v2, v3 = vc[at:][:d], vc[at + d:][:d], vc[at + 2 * d:][:d], vc[at + 3 * d:][:d]
        for j in range(group):
            p = scores[j * n + s:][:4]
            w0, w1, w2, w3 = p[0], p[1], p[2], p[3]
            o = outs[j * stride:][:d]
            for i in range(d):
                o[i] += ((w0 * cache_load(v0, i, code) + w1 * cache_load(v1, i, code))
                         + (w2 * cache_load(v2, i, code) + w3 * cache_load(v3, i, code)))
    for s in range(n4, n):
        val = vc[head + (s0 + s) * d:][:d]
        for j in range(group):
            w = scores[j * n + s]
            o = outs[j * stride:][:d]
            for i in range(d):
                o[i] += w * cache_load(val, i, code)


@njit(**OPTS)
def combine_chunks(parts, chunks, group, d, out):  # type: ignore[no-untyped-def]
    """Merge the ``chunks`` partial results of one KV head (``attention`` over each chunk, ``group * (d + 2)``
    floats each, in position order) into its heads' softmax-weighted values ``out[j * d:][:d]``: each chunk's
    sums rescaled by exp(its max - the overall max). A chunk with no positions holds max -inf and sum 0."""
    width = group * (d + 2)
    for j in range(group):
        mx = F(-np.inf)
        for c in range(chunks):
            mx = fmax(mx, parts[c * width + j * (d + 2) + d])
        total = F(0)
        o = out[j * d:][:d]
        for i in range(d):
            o[i] = F(0)
        for c in range(chunks):
            block = parts[c * width + j * (d + 2):][:d + 2]
            if block[d + 1] == F(0) and block[d] == F(-np.inf):
                continue  # an empty chunk
            w = fexp(block[d] - mx)
            total += w * block[d + 1]
            for i in range(d):
                o[i] += w * block[i]
        for i in range(d):
            o[i] = o[i] / total


@njit(inline="always", **OPTS)
def attention_task(layer, t, qkv, kc, vc, code, step, cos, sin, out, n_out, lp, addr, tnum, scratch):
    # type: ignore[no-untyped-def]
    """Attention task ``t`` of ``layer``: KV head (b, g) = divmod(t // chunks, kv_heads), chunk t % chunks of
    its positions. With one chunk the task writes the heads' output itself; with more (the runtime's choice,
    C_CHUNKS), each chunk writes its partial sums and the last chunk of the KV head to finish merges them (an
    atomic count per KV head, reset by that merge)."""
    kv_heads, group, d, seq = lp[layer, C_KV_HEADS], lp[layer, C_GROUP], lp[layer, C_HEAD_DIM], lp[layer, C_SEQ]
    chunks = lp[layer, C_CHUNKS]
    head = t // chunks
    c = t - head * chunks
    b = head // kv_heads
    g = head - b * kv_heads
    pos = step[b]
    n = pos + 1
    row = out[b * n_out + g * group * d:][:group * d]
    whole = chunks == 1  # not the constants True / False, nor 0 below: numba would compile attention once for each
    if whole:
        attention(qkv, b, g, group, d, pos, kc, vc, code, seq, kv_heads, cos, sin, c * n, n, row, d, whole, scratch)
        return
    parts = f32s(addr[lp[layer, C_PARTS]], tnum[lp[layer, C_PARTS]])[head * chunks * group * (d + 2):]
    attention(qkv, b, g, group, d, pos, kc, vc, code, seq, kv_heads, cos, sin, c * n // chunks,
              (c + 1) * n // chunks, parts[c * group * (d + 2):], d + 2, whole, scratch)
    arrived = i64s(addr[lp[layer, C_ARRIVED]], tnum[lp[layer, C_ARRIVED]])
    if atomic_add(arrived, head, 1) == chunks - 1:  # sequentially consistent: every chunk's sums are visible
        atomic_store(arrived, head, 0)
        combine_chunks(parts, chunks, group, d, row)


@njit(inline="always", **OPTS)
def _attention_c(layer, t, qkv, qkv_n, kcs, vcs, code, step, step_n, cos, cos_n, sin, sin_n, out, out_n, n_out, lp,
                 lp_rows, lp_cols, addr, addr_n, tnum, scratch, scratch_n):  # type: ignore[no-untyped-def]
    """attention_task from an entry point's integers (the caches already viewed as their arrays)."""
    attention_task(layer, t, f32s(qkv, qkv_n), kcs, vcs, code, i64s(step, step_n), f32s(cos, cos_n), f32s(sin, sin_n),
                   f32s(out, out_n), n_out, numba.carray(as_pointer(lp), (lp_rows, lp_cols), np.int64),
                   i64s(addr, addr_n), i64s(tnum, addr_n), f32s(scratch, scratch_n))


def _narrow_attention_c(layer, t, qkv, qkv_n, kc, kc_n, vc, vc_n, code, step, step_n, cos, cos_n, sin, sin_n, out,
                        out_n, n_out, lp, lp_rows, lp_cols, addr, addr_n, tnum, scratch, scratch_n):
    # type: ignore[no-untyped-def]
    _attention_c(layer, t, qkv, qkv_n, u16s(kc, kc_n), u16s(vc, vc_n), code, step, step_n, cos, cos_n, sin, sin_n,
                 out, out_n, n_out, lp, lp_rows, lp_cols, addr, addr_n, tnum, scratch, scratch_n)


# attention_task over bfloat16 / float16 caches (uint16 arrays), behind a C entry point compiled on first use
# (pk_entry.NARROW_ATTENTION_ENTRY): a model with float32 caches never compiles this second body
narrow_attention_entry = task_entry(_narrow_attention_c, types.void(*(types.int64,) * 26))


def _float_attention_c(layer, t, qkv, qkv_n, kc, kc_n, vc, vc_n, code, step, step_n, cos, cos_n, sin, sin_n, out,
                       out_n, n_out, lp, lp_rows, lp_cols, addr, addr_n, tnum, scratch, scratch_n):
    # type: ignore[no-untyped-def]
    _attention_c(layer, t, qkv, qkv_n, f32s(kc, kc_n), f32s(vc, vc_n), code, step, step_n, cos, cos_n, sin, sin_n,
                 out, out_n, n_out, lp, lp_rows, lp_cols, addr, addr_n, tnum, scratch, scratch_n)


# attention_task over float32 caches, behind its own entry point (pk_entry.FLOAT_ATTENTION_ENTRY): on a cold cache
# it closes the compile-ahead child's list, and the process takes it back when the child has not reached it
# (pk_runtime.ahead, pk_entry.Ahead)
float_attention_entry = task_entry(_float_attention_c, types.void(*(types.int64,) * 26))


ARGMAX_LANES = 16


@njit(**OPTS)
def argmax_row(logits, base, vocab):  # type: ignore[no-untyped-def]
    """torch.argmax of one row: the first maximum, or the first NaN if the row has one.

    Two passes: the largest value and whether a NaN occurs, in 16 independent lanes (selects, so the
    loop vectorizes without fast-math), then the first index holding it. The one-pass scalar loop took
    207 us over a 49152-token vocabulary, once per decode step with the other threads idle; this 45 us.
    """
    acc = np.full(ARGMAX_LANES, -np.inf, np.float32)
    odd = np.zeros(ARGMAX_LANES, np.int32)
    full = vocab - vocab % ARGMAX_LANES
    for i in range(0, full, ARGMAX_LANES):
        for j in range(ARGMAX_LANES):
            v = logits[base + i + j]
            acc[j] = v if v > acc[j] else acc[j]
            odd[j] |= v != v
    top = acc[0]
    nan = odd[0]
    for j in range(1, ARGMAX_LANES):
        top = acc[j] if acc[j] > top else top
        nan |= odd[j]
    for i in range(full, vocab):
        v = logits[base + i]
        top = v if v > top else top
        nan |= v != v
    for i in range(vocab):
        v = logits[base + i]
        if (v != v) if nan else (v == top):
            return i
    return 0


@njit(**OPTS)
def sample_row(logits, base, vocab, temperature, top_k, top_p, state):  # type: ignore[no-untyped-def]
    """Temperature, top-k, then nucleus top-p; ``state`` is a xorshift64* seed.

    A NaN logit is never drawn; if some logits are +inf, one of them is drawn (uniformly); if every
    logit is NaN or -inf there is nothing to draw from and the pick is ``argmax_row``'s.
    """
    scores = np.empty(vocab, np.float64)
    for i in range(vocab):
        s = np.float64(logits[base + i]) / temperature
        scores[i] = -np.inf if s != s else s
    order = np.argsort(-scores)
    keep = vocab if top_k == 0 else min(top_k, vocab)
    mx = scores[order[0]]
    if mx == -np.inf:
        return argmax_row(logits, base, vocab)
    probs = np.empty(keep, np.float64)
    total = 0.0
    for r in range(keep):
        s = scores[order[r]]
        probs[r] = (1.0 if s == mx else 0.0) if mx == np.inf else math.exp(s - mx)
        total += probs[r]
    cut = keep
    running = 0.0
    for r in range(keep):
        if running >= top_p * total:
            cut = r
            break
        running += probs[r]
    mass = 0.0
    for r in range(cut):
        mass += probs[r]
    state ^= state >> np.uint64(12)
    state ^= state << np.uint64(25)
    state ^= state >> np.uint64(27)
    draw = float((state * np.uint64(2685821657736338717)) >> np.uint64(11)) / 9007199254740992.0 * mass
    for r in range(cut):
        draw -= probs[r]
        if draw <= 0.0:
            return order[r]
    return order[cut - 1]


# -- one task of any layer: the descriptor row (named columns above) picks the body -------------


@njit(**OPTS)
def pick_rows(lp, lf, layer, logits, step, picked, batch, sample):  # type: ignore[no-untyped-def]
    """The picker layer ``layer`` (argmax or sampling) on every row of ``logits`` at positions ``step``: the decode
    step's last task, and ``CPUPersistentRuntime.pick`` (a prompt's first token) alike. Sampling runs behind
    ``sample``, the address of ``sample_entry`` (compiled apart, only for a program that samples: its sort and
    draws took about 3 s of a greedy model's cold compile); with 0 there a sampling layer picks -1, never a call
    to address 0."""
    k = lp[layer, C_K]
    if lp[layer, C_KIND] == ARGMAX:
        for b in range(batch):
            picked[b] = argmax_row(logits, b * k, k)
    elif sample != 0:
        call_c(sample, (lp.ctypes.data, lp.shape[0], lp.shape[1], lf.ctypes.data, lf.shape[0], lf.shape[1], layer,
                        logits.ctypes.data, logits.shape[0], step.ctypes.data, step.shape[0], picked.ctypes.data,
                        picked.shape[0], batch))
    else:
        for b in range(batch):
            picked[b] = -1


def _sample_rows_c(lp, lp_rows, lp_cols, lf, lf_rows, lf_cols, layer, logits, logits_n, step, step_n, picked,
                   picked_n, batch):  # type: ignore[no-untyped-def]
    params = numba.carray(as_pointer(lp), (lp_rows, lp_cols), np.int64)
    floats = numba.carray(as_pointer(lf), (lf_rows, lf_cols), np.float64)
    x, at, out = f32s(logits, logits_n), i64s(step, step_n), i64s(picked, picked_n)
    k = params[layer, C_K]
    for b in range(batch):
        # seeded by position, so a run repeats whatever ran before it
        state = np.uint64(params[layer, C_SEED] * 1000003 + at[b] * 7919 + b * 104729 + 1)
        out[b] = sample_row(x, b * k, k, floats[layer, F_TEMPERATURE], params[layer, C_TOP_K],
                            floats[layer, F_TOP_P], state)


# the sampling picker behind a C entry point compiled on first use (pk_entry.SAMPLE_ENTRY)
sample_entry = task_entry(_sample_rows_c, types.void(*(types.int64,) * 14))


@njit(**OPTS)
def execute(task, w, addr, tdt, tnum, lp, lf, task_layer, task_index, batch, scratch, step, tokens, tok_cols,
            none, flags, entries):  # type: ignore[no-untyped-def]
    layer = task_layer[task]
    t = task_index[task]
    kind = lp[layer, C_KIND]
    out_id = lp[layer, C_OUT]
    n = lp[layer, C_N]
    tasks = lp[layer, C_TASKS]
    k = lp[layer, C_K]
    if kind == ARGMAX or kind == SAMPLE:
        pick_rows(lp, lf, layer, f32s(addr[lp[layer, PICK_X]], tnum[lp[layer, PICK_X]]), step,
                  i64s(addr[out_id], batch), batch, entries[SAMPLE_ENTRY])
        return
    out = f32s(addr[out_id], tnum[out_id])
    cols = n // tasks
    n0 = t * cols
    if kind == EMBED:
        wid = lp[layer, EMB_W]
        rows = tnum[wid] // row_bytes(tdt[wid], n) if is_quantized(tdt[wid]) else tnum[wid] // n
        for b in range(batch):
            tok = tokens[b * tok_cols + step[b]]
            if tok < 0 or tok >= rows:  # never read outside the table: stop the run with an error instead
                flags[ERR_VALUE] = tok
                flags[ERR_ROW] = b
                flags[ERROR] = ERR_TOKEN
                atomic_store(flags, STOP, 1)
                continue
            if tdt[wid] == F32:
                src = f32s(addr[wid], tnum[wid])
                for i in range(cols):
                    out[b * n + n0 + i] = src[tok * n + n0 + i]
            elif is_quantized(tdt[wid]):
                dequantize_row(addr[wid], tdt[wid], n, tok, n0, cols, out[b * n + n0:][:cols])
            else:
                xs = scratch[:cols]
                linear_widen(addr[wid], tdt[wid], tok * n + n0, cols, xs)
                for i in range(cols):
                    out[b * n + n0 + i] = xs[i]
    elif kind == RMSLIN:
        xs = scratch[:batch * k]
        rms_rows(f32s(addr[lp[layer, RMS_X]], batch * k), f32s(addr[lp[layer, RMS_NORM]], k), xs, batch, k,
                 lf[layer, F_EPS])
        bias = f32s(addr[lp[layer, RMS_BIAS]], n) if lp[layer, RMS_BIAS] >= 0 else none
        call_linear(entries[LINEAR_ENTRY], xs, batch, k, addr[lp[layer, RMS_W]], tdt[lp[layer, RMS_W]], n0, n0 + cols,
                    out, n, none, bias, scratch[batch * k:], entries[QUANT_ENTRY])
    elif kind == LINRES:
        x = f32s(addr[lp[layer, LIN_X]], batch * k)
        res = f32s(addr[lp[layer, LIN_RES]], batch * n)
        call_linear(entries[LINEAR_ENTRY], x, batch, k, addr[lp[layer, LIN_W]], tdt[lp[layer, LIN_W]], n0, n0 + cols,
                    out, n, res, none, scratch[batch * k:], entries[QUANT_ENTRY])
    elif kind == SILURES:
        gu = f32s(addr[lp[layer, SILU_X]], batch * 2 * k)
        res = f32s(addr[lp[layer, SILU_RES]], batch * n)
        xs = scratch[:batch * k]
        kk = U(k)  # unsigned indices: no wraparound checks, so the loop vectorizes (measured 1.4x)
        for b in range(U(batch)):
            gb = gu[b * U(2) * kk:][:2 * k]
            ob = xs[b * kk:][:k]
            for i in range(kk):
                ob[i] = fsilu(gb[i]) * gb[kk + i]
        call_linear(entries[LINEAR_ENTRY], xs, batch, k, addr[lp[layer, SILU_W]], tdt[lp[layer, SILU_W]], n0,
                    n0 + cols, out, n, res, none, scratch[batch * k:], entries[QUANT_ENTRY])
    elif kind == SCREEN:
        hk = tnum[lp[layer, SCR_NORM]]  # the hidden width
        wi = lp[layer, SCR_W]
        screened_rows(f32s(addr[lp[layer, SCR_IN]], batch * n), f32s(addr[lp[layer, SCR_X]], batch * hk),
                      f32s(addr[lp[layer, SCR_NORM]], hk), addr[wi], tdt[wi], f32s(addr[lp[layer, SCR_BOUND]], n), out,
                      batch, hk, n, lf[layer, F_EPS], scratch[:hk], scratch[hk:], entries[LINEAR_ENTRY], none)
    elif kind == ATTN:
        kci, vci = lp[layer, ATT_KC], lp[layer, ATT_VC]
        # float32 caches, or bfloat16 / float16 bits (both caches: one dtype): each behind its own entry point
        body = entries[FLOAT_ATTENTION_ENTRY] if tdt[kci] == F32 else entries[NARROW_ATTENTION_ENTRY]
        if body != 0:
            qi, ci, si = lp[layer, ATT_QKV], lp[layer, ATT_COS], lp[layer, ATT_SIN]
            call_c(body, (
                layer, t, addr[qi], tnum[qi], addr[kci], tnum[kci], addr[vci], tnum[vci], tdt[kci], step.ctypes.data,
                step.shape[0], addr[ci], tnum[ci], addr[si], tnum[si], out.ctypes.data, out.shape[0], n,
                lp.ctypes.data, lp.shape[0], lp.shape[1], addr.ctypes.data, addr.shape[0], tnum.ctypes.data,
                scratch.ctypes.data, scratch.shape[0]))
    else:  # ALLRED, ALLGAT: pk_comm's thread runs the collective on the layer's buffers; this task waits for it
        communicate(layer, flags)


def _execute_entry(task, w, frame, scratch, scratch_len):  # type: ignore[no-untyped-def]
    run_task(execute, task, w, frame, scratch, scratch_len)


# what the decode loop calls for every task: execute behind a C entry point, compiled once (pk_entry)
execute_entry = task_entry(_execute_entry)


@njit(**OPTS)
def linear_widen(address, dtype, start, count, dst):  # type: ignore[no-untyped-def]
    for i in range(count):
        dst[i] = load(address, start + i, dtype)


@njit(cache=True)
def _compiled_layout():  # type: ignore[no-untyped-def]
    return LAYOUT


_layout_checked = False


def check_compiled_layout(runtime_namespace: dict[str, Any]) -> None:
    """Recompile this module's cached functions if they were compiled for another descriptor layout.

    numba re-validates a cache entry by the stamp of this file (and the backend's sources), not by the
    core's LayerSpec table, whose column numbers it froze into the code; ``_compiled_layout`` is cached
    alongside ``execute`` and ``decode`` and returns the layout they were compiled with.
    """
    global _layout_checked
    if _layout_checked:
        return
    if _compiled_layout() != LAYOUT:
        for namespace in (globals(), runtime_namespace):  # both froze the layout's numbers into their code
            for value in list(namespace.values()):
                if isinstance(value, CPUDispatcher) and value.__module__ == namespace["__name__"]:
                    value.recompile()  # flushes its cache entries too
                elif isinstance(value, CFunc) and value.__module__ == namespace["__name__"]:
                    recompile(value)
        if _compiled_layout() != LAYOUT:
            raise AssertionError("the recompiled PK runtime still reports the old descriptor layout")
    _layout_checked = True


tie_caches_to_sources(globals())  # after every cached function above is defined
