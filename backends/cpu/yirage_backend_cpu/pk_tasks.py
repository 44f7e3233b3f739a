"""Task bodies of the CPU PersistentKernel runtime, as numba functions over raw addresses.

Every tensor is reached through its address (``tensor.data_ptr()``) in one
table, so one compiled function can touch every weight, activation and the
KV caches. Weights may be float32, bfloat16 or float16; narrow ones are
widened to float32 in registers, so a decode step streams half the bytes.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit

from yirage_backend_cpu.kernel_lib import FASTMATH, as_pointer, fexp, fmax, half_to_float, racc, rfma
from yirage_backend_cpu.sources import tie_caches_to_sources

U = np.uint64
F = np.float32
OPTS = {"fastmath": FASTMATH, "error_model": "numpy", "nogil": True, "cache": True}

F32, BF16, F16, I64 = 0, 1, 2, 3


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


# linear_f32 and linear_u16 are two copies on purpose: passing the widening function as an
# argument would make numba's compiled code uncacheable (it treats dispatchers as dynamic globals).


@njit(**OPTS)
def linear_f32(xs, batch, k, w_addr, n0, n1, out, out_cols, res, bias):  # type: ignore[no-untyped-def]
    w = f32s(w_addr, n1 * k)
    kk = U(k)
    nn = U(n0)
    while nn + U(4) <= U(n1):
        c0 = w[nn * kk:][:k]
        c1 = w[(nn + U(1)) * kk:][:k]
        c2 = w[(nn + U(2)) * kk:][:k]
        c3 = w[(nn + U(3)) * kk:][:k]
        for b in range(U(batch)):
            x = xs[b * kk:][:k]
            s0 = F(0)
            s1 = F(0)
            s2 = F(0)
            s3 = F(0)
            for i in range(kk):
                v = x[i]
                s0 = rfma(s0, v, c0[i])
                s1 = rfma(s1, v, c1[i])
                s2 = rfma(s2, v, c2[i])
                s3 = rfma(s3, v, c3[i])
            _store4(out, out_cols, b, nn, s0, s1, s2, s3, res, bias)
        nn += U(4)
    while nn < U(n1):
        c0 = w[nn * kk:][:k]
        for b in range(U(batch)):
            x = xs[b * kk:][:k]
            s0 = F(0)
            for i in range(kk):
                s0 = rfma(s0, x[i], c0[i])
            _store1(out, out_cols, b, nn, s0, res, bias)
        nn += U(1)


@njit(**OPTS)
def linear_u16(xs, batch, k, w_addr, n0, n1, out, out_cols, res, bias, is_bf16):  # type: ignore[no-untyped-def]
    w = u16s(w_addr, n1 * k)
    kk = U(k)
    nn = U(n0)
    while nn + U(4) <= U(n1):
        c0 = w[nn * kk:][:k]
        c1 = w[(nn + U(1)) * kk:][:k]
        c2 = w[(nn + U(2)) * kk:][:k]
        c3 = w[(nn + U(3)) * kk:][:k]
        for b in range(U(batch)):
            x = xs[b * kk:][:k]
            s0 = F(0)
            s1 = F(0)
            s2 = F(0)
            s3 = F(0)
            if is_bf16:
                for i in range(kk):
                    v = x[i]
                    s0 = rfma(s0, v, bf16(c0[i]))
                    s1 = rfma(s1, v, bf16(c1[i]))
                    s2 = rfma(s2, v, bf16(c2[i]))
                    s3 = rfma(s3, v, bf16(c3[i]))
            else:
                for i in range(kk):
                    v = x[i]
                    s0 = rfma(s0, v, f16(c0[i]))
                    s1 = rfma(s1, v, f16(c1[i]))
                    s2 = rfma(s2, v, f16(c2[i]))
                    s3 = rfma(s3, v, f16(c3[i]))
            _store4(out, out_cols, b, nn, s0, s1, s2, s3, res, bias)
        nn += U(4)
    while nn < U(n1):
        c0 = w[nn * kk:][:k]
        for b in range(U(batch)):
            x = xs[b * kk:][:k]
            s0 = F(0)
            for i in range(kk):
                s0 = rfma(s0, x[i], (bf16(c0[i]) if is_bf16 else f16(c0[i])))
            _store1(out, out_cols, b, nn, s0, res, bias)
        nn += U(1)


@njit(inline="always", **OPTS)
def _store1(out, out_cols, b, n, s, res, bias):  # type: ignore[no-untyped-def]
    if bias.shape[0]:
        s += bias[n]
    if res.shape[0]:
        s += res[b * U(out_cols) + n]
    out[b * U(out_cols) + n] = s


@njit(inline="always", **OPTS)
def _store4(out, out_cols, b, n, s0, s1, s2, s3, res, bias):  # type: ignore[no-untyped-def]
    _store1(out, out_cols, b, n, s0, res, bias)
    _store1(out, out_cols, b, n + U(1), s1, res, bias)
    _store1(out, out_cols, b, n + U(2), s2, res, bias)
    _store1(out, out_cols, b, n + U(3), s3, res, bias)


@njit(**OPTS)
def linear(xs, batch, k, w_addr, w_dtype, n0, n1, out, out_cols, res, bias):  # type: ignore[no-untyped-def]
    if w_dtype == F32:
        linear_f32(xs, batch, k, w_addr, n0, n1, out, out_cols, res, bias)
    else:
        linear_u16(xs, batch, k, w_addr, n0, n1, out, out_cols, res, bias, w_dtype == BF16)


# -- RoPE, attention, pickers ---------------------------------------------------------------


@njit(inline="always", **OPTS)
def rope(src, dst, cos, sin, d):  # type: ignore[no-untyped-def]
    h = d // 2
    for i in range(h):
        dst[i] = src[i] * cos[i] - src[i + h] * sin[i]
    for i in range(h, d):
        dst[i] = src[i] * cos[i] + src[i - h] * sin[i]


@njit(**OPTS)
def attention(qkv, b, g, group, d, pos, kc, vc, cache_seq, kv_heads, cos, sin, out, out_cols, scratch):
    # type: ignore[no-untyped-def]
    width = (group + 2) * d
    base = b * (kv_heads * width) + g * width
    cs = cos[pos * d:][:d]
    sn = sin[pos * d:][:d]
    head = ((b * kv_heads + g) * cache_seq) * d
    rope(qkv[base + group * d:][:d], kc[head + pos * d:][:d], cs, sn, d)
    vsrc = qkv[base + (group + 1) * d:][:d]
    vdst = vc[head + pos * d:][:d]
    for i in range(d):
        vdst[i] = vsrc[i]
    q = scratch[:d]
    scores = scratch[d:][:pos + 1]
    scale = F(1.0 / math.sqrt(d))
    for j in range(group):
        rope(qkv[base + j * d:][:d], q, cs, sn, d)
        mx = F(-np.inf)
        for s in range(pos + 1):
            key = kc[head + s * d:][:d]
            acc = F(0)
            for i in range(d):
                acc = rfma(acc, q[i], key[i])
            acc *= scale
            scores[s] = acc
            mx = fmax(mx, acc)  # a NaN score makes the head NaN, as in torch
        total = F(0)
        for s in range(pos + 1):
            e = fexp(scores[s] - mx)
            scores[s] = e
            total = racc(total, e)
        o = out[b * out_cols + (g * group + j) * d:][:d]
        for i in range(d):
            o[i] = F(0)
        for s in range(pos + 1):
            w = scores[s] / total
            val = vc[head + s * d:][:d]
            for i in range(d):
                o[i] += w * val[i]


@njit(**OPTS)
def argmax_row(logits, base, vocab):  # type: ignore[no-untyped-def]
    """torch.argmax of one row: the first maximum, or the first NaN if the row has one."""
    best = 0
    top = logits[base]
    for i in range(1, vocab):
        v = logits[base + i]
        if top == top and (v > top or v != v):
            top = v
            best = i
    return best


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


tie_caches_to_sources(globals())  # after every cached function above is defined
