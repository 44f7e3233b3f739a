"""The PersistentKernel's task bodies as Triton kernels (imported only by yirage.persistent.launched).

One kernel per task kind, specialized by Triton on its ``tl.constexpr``
shapes; ``launched.py`` reads the program's descriptor rows and launches
them, layer by layer, once per decode step. The language used stays inside
what Triton 3.0 to 3.5 accept (the range the vendors' Triton forks pin):
blocks, masks, ``tl.sum``/``tl.max``, ``tl.static_range``, bitcasts. The math
follows the reference runtime: float32 compute, weights widened from
bfloat16/float16 as they load, rsqrt as ``1 / sqrt``, first index on argmax
ties and the first NaN wins. Under ``TRITON_INTERPRET=1`` these run on torch
CPU tensors (how the tests check them on a machine without a GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from yirage.persistent.control import Ctl, CtlError

# the control buffer's slots, from its one definition (yirage.persistent.control); Triton reads module globals
# only as tl.constexpr, and as plain ints (not IntEnum members) in its cache keys
ALIVE: tl.constexpr = tl.constexpr(int(Ctl.ALIVE))
STEPS: tl.constexpr = tl.constexpr(int(Ctl.STEPS))
ERROR: tl.constexpr = tl.constexpr(int(Ctl.ERROR))
ERR_ROW: tl.constexpr = tl.constexpr(int(Ctl.ERR_ROW))
ERR_VALUE: tl.constexpr = tl.constexpr(int(Ctl.ERR_VALUE))
ACTIVE: tl.constexpr = tl.constexpr(int(Ctl.ACTIVE))
ERR_TOKEN: tl.constexpr = tl.constexpr(int(CtlError.TOKEN))


@triton.jit
def y_begin(ctl, tokens, step, eos, B: tl.constexpr, BB: tl.constexpr, TC: tl.constexpr, MAX_SEQ: tl.constexpr,
            VOCAB: tl.constexpr, N_EOS: tl.constexpr):
    """Which rows decode this step (not at EOS, room left), and the first row whose token is out of range."""
    rows = tl.arange(0, BB)
    m = rows < B
    pos = tl.load(step + rows, mask=m, other=0)
    tok = tl.load(tokens + rows * TC + pos, mask=m, other=0)
    ok = m & (pos + 1 < MAX_SEQ)
    for e in tl.static_range(N_EOS):
        ok = ok & (tok != tl.load(eos + e))
    tl.store(ctl + ACTIVE + rows, ok.to(tl.int64), mask=m)
    tl.store(ctl + ALIVE, tl.sum(ok.to(tl.int64), axis=0))
    bad = m & ((tok < 0) | (tok >= VOCAB))
    row = tl.min(tl.where(bad, rows, BB), axis=0)
    if row < B:
        tl.store(ctl + ERROR, ERR_TOKEN)
        tl.store(ctl + ERR_ROW, row.to(tl.int64))
        tl.store(ctl + ERR_VALUE, tl.sum(tl.where(rows == row, tok, 0), axis=0))


@triton.jit
def y_commit(tokens, step, ctl, picked, B: tl.constexpr, BB: tl.constexpr, TC: tl.constexpr):
    """Append each active row's picked token and advance its step; count the step."""
    rows = tl.arange(0, BB)
    m = rows < B
    act = m & (tl.load(ctl + ACTIVE + rows, mask=m, other=0) != 0)
    pos = tl.load(step + rows, mask=m, other=0)
    tok = tl.load(picked + rows, mask=m, other=0).to(tl.int64)
    tl.store(tokens + rows * TC + pos + 1, tok, mask=act)
    tl.store(step + rows, pos + 1, mask=act)
    alive = tl.load(ctl + ALIVE)
    tl.store(ctl + STEPS, tl.load(ctl + STEPS) + (alive > 0).to(tl.int64))


@triton.jit
def y_embed(out, tokens, step, w, N: tl.constexpr, TC: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    tok = tl.load(tokens + b * TC + tl.load(step + b))
    ok = (tok >= 0) & (tok < ROWS)
    safe = tl.where(ok, tok, 0)
    v = tl.load(w + safe * N + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + b * N + cols, tl.where(ok, v, 0.0), mask=m)


@triton.jit
def y_rmsnorm(xs, x, gamma, eps, K: tl.constexpr, BK: tl.constexpr):
    """xs[b] = x[b] / sqrt(mean(x[b]^2) + eps) * gamma, one program per row."""
    b = tl.program_id(0)
    acc = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        v = tl.load(x + b * K + c, mask=c < K, other=0.0)
        acc += v * v
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        m = c < K
        v = tl.load(x + b * K + c, mask=m, other=0.0)
        g = tl.load(gamma + c, mask=m, other=0.0).to(tl.float32)
        tl.store(xs + b * K + c, v * inv * g, mask=m)


@triton.jit
def y_silu_mul(xs, gu, K: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < K
    a = tl.load(gu + b * 2 * K + c, mask=m, other=0.0)
    up = tl.load(gu + b * 2 * K + K + c, mask=m, other=0.0)
    tl.store(xs + b * K + c, a / (1.0 + tl.exp(-a)) * up, mask=m)


@triton.jit
def y_gemv(out, x, w, bias, res, N: tl.constexpr, K: tl.constexpr, B: tl.constexpr, BB: tl.constexpr,
           HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[b, n] = x[b] . W[n] (+ bias[n]) (+ res[b, n]) for a block of BN columns and every row."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BB)
    mn = n < N
    acc = tl.zeros([BB, BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        mk = c < K
        wt = tl.load(w + n[:, None] * K + c[None, :], mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
        xt = tl.load(x + rows[:, None] * K + c[None, :], mask=(rows[:, None] < B) & mk[None, :], other=0.0)
        acc += xt[:, None, :] * wt[None, :, :]
    s = tl.sum(acc, axis=2)
    if HAS_BIAS:
        s += tl.load(bias + n, mask=mn, other=0.0).to(tl.float32)[None, :]
    both = (rows[:, None] < B) & mn[None, :]
    if HAS_RES:
        s += tl.load(res + rows[:, None] * N + n[None, :], mask=both, other=0.0)
    tl.store(out + rows[:, None] * N + n[None, :], s, mask=both)


@triton.jit
def _rotated(qkv, base, cos, sin, pos, d, D: tl.constexpr):
    """The elements ``d`` of the head at ``base`` rotated to position ``pos`` (rotate-half pairs)."""
    half: tl.constexpr = D // 2
    m = d < D
    x0 = tl.load(qkv + base + d, mask=m, other=0.0)
    partner = tl.where(d < half, d + half, d - half)
    x1 = tl.load(qkv + base + partner, mask=m, other=0.0)
    x1 = tl.where(d < half, -x1, x1)
    c = tl.load(cos + pos * D + d, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin + pos * D + d, mask=m, other=0.0).to(tl.float32)
    return x0 * c + x1 * s


@triton.jit
def _cache_value(x, ptr):
    """float32 ``x`` as the cache ``ptr`` holds it: a bfloat16 cache's rounded to nearest even by hand (Triton's
    interpreter truncates the implicit cast; torch rounds), NaN kept a quiet NaN; float16 and float32 by cast."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def y_kv_store(kc, vc, qkv, step, cos, sin, KV: tl.constexpr, GR: tl.constexpr, D: tl.constexpr,
               SEQ: tl.constexpr, BD: tl.constexpr):
    """Rotate the new key and store it and the value at the row's position in the caches."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    pos = tl.load(step + b)
    d = tl.arange(0, BD)
    m = d < D
    base = b * KV * (GR + 2) * D + g * (GR + 2) * D
    at = ((b * KV + g) * SEQ + pos) * D + d
    tl.store(kc + at, _cache_value(_rotated(qkv, base + GR * D, cos, sin, pos, d, D), kc), mask=m)
    tl.store(vc + at, _cache_value(tl.load(qkv + base + (GR + 1) * D + d, mask=m, other=0.0), vc), mask=m)


@triton.jit
def y_attention(out, qkv, kc, vc, step, cos, sin, scale, KV: tl.constexpr, GR: tl.constexpr, D: tl.constexpr,
                SEQ: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    """One query head over the cached positions 0..pos: scores, softmax, weighted values (two passes)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // GR
    j = h - g * GR
    pos = tl.load(step + b)
    d = tl.arange(0, BD)
    md = d < D
    q = _rotated(qkv, b * KV * (GR + 2) * D + g * (GR + 2) * D + j * D, cos, sin, pos, d, D)
    head = (b * KV + g) * SEQ * D
    top = tl.full([BS], float("-inf"), tl.float32)
    for s0 in range(0, SEQ, BS):
        s = s0 + tl.arange(0, BS)
        ms = s <= pos
        keys = tl.load(kc + head + s[:, None] * D + d[None, :], mask=ms[:, None] & md[None, :], other=0.0)
        sc = tl.where(ms, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))
        top = tl.maximum(top, sc)
    mx = tl.max(top, axis=0)
    total = tl.zeros([BS], dtype=tl.float32)
    o = tl.zeros([BD], dtype=tl.float32)
    for s0 in range(0, SEQ, BS):
        s = s0 + tl.arange(0, BS)
        ms = s <= pos
        both = ms[:, None] & md[None, :]
        keys = tl.load(kc + head + s[:, None] * D + d[None, :], mask=both, other=0.0)
        p = tl.where(ms, tl.exp(tl.sum(keys * q[None, :], axis=1) * scale - mx), 0.0)
        total += p
        vals = tl.load(vc + head + s[:, None] * D + d[None, :], mask=both, other=0.0)
        o += tl.sum(p[:, None] * vals, axis=0)
    tl.store(out + b * KV * GR * D + h * D + d, o / tl.sum(total, axis=0), mask=md)


@triton.jit
def y_argmax(out, x, V: tl.constexpr, BV: tl.constexpr):
    """torch.argmax of one row: the first maximum, or the first NaN if the row has one."""
    b = tl.program_id(0)
    best = tl.full([BV], float("-inf"), tl.float32)
    where = tl.full([BV], V, tl.int64)
    first_nan = tl.full([BV], V, tl.int64)
    for v0 in range(0, V, BV):
        c = v0 + tl.arange(0, BV)
        m = c < V
        v = tl.load(x + b * V + c, mask=m, other=float("-inf"))
        first_nan = tl.minimum(first_nan, tl.where(m & (v != v), c, V))
        better = m & (v == v) & ((v > best) | (where == V))  # strictly greater: earlier blocks keep ties
        best = tl.where(better, v, best)
        where = tl.where(better, c, where)
    top = tl.max(best, axis=0)
    pick = tl.min(tl.where(best == top, where, V), axis=0)
    nan = tl.min(first_nan, axis=0)
    tl.store(out + b, tl.where(nan < V, nan, pick).to(out.dtype.element_ty))


@triton.jit
def _key(s):
    """float32 -> int64 with the same order (NaN already mapped to -inf)."""
    u = s.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(u < 0, -1 - u, u + 2147483648)


@triton.jit
def _mass_above(x, sc, row, cut, inv_t, V: tl.constexpr, BV: tl.constexpr):
    acc = tl.zeros([BV], dtype=tl.float32)
    for v0 in range(0, V, BV):
        c = v0 + tl.arange(0, BV)
        m = c < V
        s = tl.load(x + row + c, mask=m, other=float("-inf")) * inv_t
        s = tl.where(s != s, float("-inf"), s)
        acc += tl.where(m & (_key(s) > cut), tl.load(sc + row + c, mask=m, other=0.0), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def y_sample(out, sc, x, step, inv_t, top_p, seed, V: tl.constexpr, BV: tl.constexpr, TOP_K: tl.constexpr,
             NUCLEUS: tl.constexpr):
    """Temperature, top-k, nucleus top-p, then one seeded draw (a MINSTD stream seeded by seed, position, row).

    Thresholds are found by bisecting the order-preserving integer keys of the scores (32 passes), so no
    sort is needed; a NaN logit is never drawn. A row of only NaN/-inf keeps what ``y_argmax`` stored
    there first (the runtime launches it before this kernel).
    """
    b = tl.program_id(0)
    row = b * V
    top = tl.full([BV], float("-inf"), tl.float32)
    for v0 in range(0, V, BV):
        c = v0 + tl.arange(0, BV)
        s = tl.load(x + row + c, mask=c < V, other=float("-inf")) * inv_t
        top = tl.maximum(top, tl.where(s != s, float("-inf"), s))
    mx = tl.max(top, axis=0)
    kth = tl.zeros([], dtype=tl.int64)
    if TOP_K > 0:
        for bit in tl.static_range(32):
            cand = kth + (1 << (31 - bit))
            count = tl.zeros([BV], dtype=tl.int64)
            for v0 in range(0, V, BV):
                c = v0 + tl.arange(0, BV)
                s = tl.load(x + row + c, mask=c < V, other=float("-inf")) * inv_t
                s = tl.where(s != s, float("-inf"), s)
                count += ((c < V) & (_key(s) >= cand)).to(tl.int64)
            if tl.sum(count, axis=0) >= TOP_K:
                kth = cand
    total = tl.zeros([BV], dtype=tl.float32)
    for v0 in range(0, V, BV):
        c = v0 + tl.arange(0, BV)
        m = c < V
        s = tl.load(x + row + c, mask=m, other=float("-inf")) * inv_t
        s = tl.where(s != s, float("-inf"), s)
        p = tl.where(mx == float("inf"), tl.where(s == mx, 1.0, 0.0), tl.exp(s - mx))
        p = tl.where(m & (_key(s) >= kth), p, 0.0)
        tl.store(sc + row + c, p, mask=m)
        total += p
    cut = tl.zeros([], dtype=tl.int64)
    if NUCLEUS:  # keep a score iff the mass ranked strictly above it is below top_p of the total
        want = top_p * tl.sum(total, axis=0)
        if _mass_above(x, sc, row, cut, inv_t, V, BV) >= want:
            lo = tl.zeros([], dtype=tl.int64)
            for bit in tl.static_range(32):
                cand = lo + (1 << (31 - bit))
                if _mass_above(x, sc, row, cand, inv_t, V, BV) >= want:
                    lo = cand
            cut = lo + 1
    mass = tl.zeros([BV], dtype=tl.float32)
    for v0 in range(0, V, BV):
        c = v0 + tl.arange(0, BV)
        m = c < V
        s = tl.load(x + row + c, mask=m, other=float("-inf")) * inv_t
        s = tl.where(s != s, float("-inf"), s)
        mass += tl.where(m & (_key(s) >= cut), tl.load(sc + row + c, mask=m, other=0.0), 0.0)
    state = (seed.to(tl.int64) * 1000003 + tl.load(step + b) * 7919 + b * 104729 + 1) % 2147483647
    for _ in tl.static_range(3):
        state = (state * 48271) % 2147483647
    draw = (state.to(tl.float32) / 2147483647.0) * tl.sum(mass, axis=0)
    # the first kept score whose running mass reaches the draw (in index order)
    pick = tl.zeros([], dtype=tl.int64) - 1
    last = tl.zeros([], dtype=tl.int64)
    running = tl.zeros([], dtype=tl.float32)
    for v0 in range(0, V, BV):
        c = v0 + tl.arange(0, BV)
        m = c < V
        s = tl.load(x + row + c, mask=m, other=float("-inf")) * inv_t
        s = tl.where(s != s, float("-inf"), s)
        p = tl.where(m & (_key(s) >= cut), tl.load(sc + row + c, mask=m, other=0.0), 0.0)
        run = running + tl.cumsum(p, axis=0)
        hit = (p > 0) & (run >= draw)
        first = tl.min(tl.where(hit, c.to(tl.int64), V), axis=0)
        if pick < 0:
            if first < V:
                pick = first
        last = tl.maximum(last, tl.max(tl.where(p > 0, c.to(tl.int64), -1), axis=0))
        running = running + tl.sum(p, axis=0)
    if mx > float("-inf"):  # else nothing can be drawn: the argmax stored before this kernel stays
        tl.store(out + b, tl.where(pick >= 0, pick, last).to(out.dtype.element_ty))
