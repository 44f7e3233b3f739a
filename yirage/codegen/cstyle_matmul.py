"""Matmul kernels of the C-family renderer (``yirage.codegen.cstyle``): register-blocked, dialect-generic.

A matmul is a prologue that materializes A's rows (the ``a`` expression,
scaled by a fused RMSNorm's rsqrt) when A is not a plain contiguous buffer,
then the product: one kernel, two for the split-K GEMV (a large matmul on a
``host_gemm`` dialect: see the end). The product takes one of four shapes,
chosen from B's strides over ``batch + (K, N)`` and from M:

- **dot** (B contiguous along K, e.g. an ``nn.Linear`` weight viewed as (K, N)):
  each work-item owns an ``MB x NB`` block of outputs and walks K in steps of
  ``VW`` with ``VW`` independent partial sums per output, summed pairwise at
  the end. The ``VW`` lanes are plain arrays indexed by constant-bound loops:
  every C-family compiler unrolls them and a CPU compiler (PoCL's LLVM)
  vectorizes them, with no vector types and no reassociation (the order of
  every addition is fixed by the source).
- **rows** (B contiguous along N): each work-item owns ``MB`` rows by ``VW``
  consecutive columns; per k it loads ``VW`` elements of B's row k and
  broadcasts one element of each of its ``MB`` rows of A (sequential sum over
  k, the naive order).
- **split-K GEMV** (a ``gemv_split_k`` dialect, set by a backend for CPU devices; M = 1, B contiguous
  along N, at least ``SPLIT_K_MIN_KN`` elements of B): ``{name}_part`` runs S groups of ONE work-item per
  batch item (``split_k_groups``: 32 for K = 4096), each streaming whole rows of its K slice of B into a
  partial row of N sums (the inner loop runs over contiguous columns, which a CPU compiler vectorizes; the
  partial row stays in cache), ``SPLIT_K_UNROLL`` rows per pass over it, rows in order; then ``{name}``
  sums the S partials of each output in order (s = 0..S-1) and applies the epilogue. On a CPU device a
  work-group is one thread's loop, so **rows** with M = 1 would be a single work-group on one core reading
  256 B of every row at a time (9.7 ms for W1 on PoCL; split-K: ~2 ms of kernel time, DRAM speed).
- **naive**: anything else, one work-item per output element.

Blocks divide M and N exactly (the block sizes are chosen among divisors), so
no work-item branches on a partial block; the K tail of the dot shape is a
scalar loop. The work-item index puts the M block fastest, so neighbouring
work-items share B's columns in cache.

A dialect with ``host_gemm`` (CUDA, HIP: a vendor BLAS is at hand) splits a
float32/float64 matmul of at least ``HOST_GEMM_MIN_MNK`` multiply-adds whose B
is a plain buffer of the compute type into steps: the prologue kernel (when A
is not a plain buffer of the compute type, or a fused RMSNorm scales it), a
``Gemm`` step (the backend runs ``a @ b`` with its BLAS into a scratch
accumulator), then an elementwise epilogue kernel ``{name}`` that reads
``v_acc`` from that accumulator. When the epilogue is the bare accumulator and
the output is stored at compute type, the GEMM writes the output directly and
there is no epilogue kernel. The whole product (one of the shapes above) is
still rendered, as ``{name}_full`` (or ``{name}`` when there is no epilogue
kernel), outside ``Rendered.steps``: the backend runs it instead of the GEMM
and the epilogue when its BLAS must not be used (e.g. TF32 allowed for
float32), so results can stay IEEE.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from yirage.codegen import indexing
from yirage.codegen.dialect import Dialect
from yirage.codegen.emit import Emitter
from yirage.codegen.exprs import compute_type
from yirage.codegen.indexing import IndexSyntax, broadcast_strides
from yirage.codegen.launch import Check, Gemm, Launch
from yirage.compiler.kernel_ir import Buffer, Expr, Load, Matmul, Var, loads
from yirage.compiler.schedule import choice
from yirage.graph.kernel_graph import contiguous_strides

GROUP = 64  # work-group size of the naive kernels
PROLOGUE_GROUP = 256  # work-group size of the prologue (one work-group per row of A; fewer for a short row)
BLOCK_GROUP = 64  # work-group size of the blocked kernels
# Block sizes, measured on PoCL (Zen 4, interleaved runs): 8 lanes (one 256-bit register) beat 16; 8 x 2
# output blocks beat 4 x 4 at M = 8 and 64 (1.3-1.5x); a GEMV (M = 1) wants 8 columns per work-item.
DOT_LANES = 8  # partial sums per output in the dot shape (4 for 8-byte types)
DOT_ROWS = (8, 4, 2)  # MB: the first that divides M
DOT_COLS, GEMV_COLS = (2,), (8, 4, 2)  # NB: the first that divides N (GEMV_COLS when MB = 1)
ROW_ROWS = (8, 4, 2)
ROW_WIDTHS, GEMV_WIDTHS = (16, 8, 4, 2), (64, 32, 16, 8, 4, 2)  # columns per work-item in the rows shape
#: smallest batch*M*N*K a host_gemm dialect sends to the host's GEMM: below it one kernel launch is the whole cost
HOST_GEMM_MIN_MNK = 1 << 18
EPILOGUE_GROUP = 256  # work-group size of the split epilogue kernel (one work-item per output element)
#: split-K GEMV (``gemv_split_k`` dialects, CPU devices): from this many elements of B (256 KiB of float32,
#: an L2's worth: below it one work-group reads B about as fast as the second launch costs) ...
SPLIT_K_MIN_KN = 1 << 16
SPLIT_K_MAX = 32  # ... at most this many one-work-item groups per batch item (K = 4096: 32 groups of 128 rows)
SPLIT_K_ROWS = 128  # ... rows per group aimed at: fewer, bigger groups until every core has several to balance
SPLIT_K_MIN_ROWS = 8  # ... and never fewer rows per group than this
SPLIT_K_UNROLL = 4  # rows of B added per pass over the partial row (in order: one load/store of it per 4 rows)
SPLIT_K_SUM_COLS = 64  # consecutive outputs per work-item of the kernel summing the partials


class Renderer(Protocol):
    """What the matmul kernels use of the C-family renderer that calls them (``cstyle._Renderer``).

    The renderer hands itself in; this module sees only these members, so it never imports ``cstyle``.
    """

    d: Dialect
    buffers: dict[str, Buffer]
    narrow: dict[str, str]  # graph buffers stored as float16/bfloat16 -> that dtype
    emit: Emitter
    ix: IndexSyntax
    steps: list[Launch | Gemm]

    def ctype(self, ct: str) -> str: ...
    def const(self, value: float, ct: str) -> str: ...
    def expr(self, e: Expr, load: Callable[[Load], str], ct: str) -> str: ...
    def read(self, name: str, off: str) -> str: ...
    def write(self, name: str, off: str, value: str) -> str: ...
    def loader(self, space: Sequence[int], idx: Sequence[str], ct: str) -> Callable[[Load], str]: ...
    def add_scratch(self, name: str, count: int, dtype: str) -> str: ...
    def kernel(self, name: str, args: Sequence[str], groups: int, local: int, check: Check | None = None,
               step: bool = True) -> None: ...
    def gid(self, total: int) -> None: ...
    def ilp_loop(self, var: str, start: str, count: int | str, stride: int, values: Callable[[int, str], list[str]],
                 fold: Callable[[int, str], list[str]], ilp: int = ...) -> None: ...
    def group_reduce(self, var: str, local: int, combine: Callable[[str, str], str],
                     into: str | None = None) -> None: ...
    def close(self) -> None: ...


def _divisor(n: int, choices: tuple[int, ...]) -> int:
    return next(c for c in (*choices, 1) if n % c == 0)


def matmul(r: Renderer, k: Matmul) -> None:
    """Emit ``k``: its prologue if A needs one, then the product in the shape B's layout allows.

    With a ``host_gemm`` dialect and a large float product: prologue, ``Gemm`` step, epilogue kernel,
    and the product kept aside as the GEMM's fallback (module docstring).
    """
    ct = compute_type(r.buffers[k.out])
    nb = max(1, math.prod(k.batch))
    scale = k.row_scale is not None
    host = _host_gemm(r, k, ct, nb, choice(r.plan, k.name, "host_gemm", None))
    a_names = list(dict.fromkeys(loads(k.a) + (loads(k.row_scale) if k.row_scale is not None else [])))
    a_src = _plain_a(r, k)
    if a_src is None or scale or (host and (a_src in r.narrow or compute_type(r.buffers[a_src]) != ct)):
        a_src = _prologue(r, k, ct, nb, a_names)
        a_names = [a_src]
    epi = list(dict.fromkeys(loads(k.epilogue)))
    args = list(dict.fromkeys([k.out] + a_names + [k.b] + epi))
    name, step = k.name, True
    if host:
        name, step = _gemm_steps(r, k, ct, nb, a_src), False
    strides = broadcast_strides(r.buffers[k.b], k.batch + (k.k, k.n))
    sk, sn = strides[-2], strides[-1]
    wide = r.ctype(ct) in ("double", "long", "long long")
    if _split_k(r, k, sn):
        _gemv_split_k(r, k, ct, nb, a_src, strides, name=name, step=step)
    elif sk == 1:
        mb = _divisor(k.m, DOT_ROWS)
        _dot(r, k, ct, nb, a_src, args, strides, mb=mb, nbk=_divisor(k.n, GEMV_COLS if mb == 1 else DOT_COLS),
             vw=DOT_LANES // 2 if wide else DOT_LANES, name=name, step=step)
    elif sn == 1 and (vw := _divisor(k.n, GEMV_WIDTHS if k.m == 1 else ROW_WIDTHS)) > 1:
        _rows(r, k, ct, nb, a_src, args, strides, mb=_divisor(k.m, ROW_ROWS), vw=vw, name=name, step=step)
    else:
        _naive(r, k, ct, nb, a_src, args, name=name, step=step)


def _split_k(r: Renderer, k: Matmul, sn: int) -> bool:
    """Whether ``k`` is a GEMV worth splitting over K: a ``gemv_split_k`` dialect, M = 1, B contiguous along N."""
    return (r.d.gemv_split_k and k.m == 1 and sn == 1 and k.k * k.n >= SPLIT_K_MIN_KN
            and k.k >= 2 * SPLIT_K_MIN_ROWS)


def split_k_groups(kdim: int) -> tuple[int, int]:
    """(S, KC): ``S`` work-groups per batch item, each owning ``KC`` consecutive rows of B (the last fewer).

    About ``SPLIT_K_ROWS`` rows per group, at least 2 and at most ``SPLIT_K_MAX`` groups and at least
    ``SPLIT_K_MIN_ROWS`` rows each; KC is a multiple of ``SPLIT_K_UNROLL`` so only the last group has a tail.
    """
    s = min(SPLIT_K_MAX, max(2, kdim // SPLIT_K_ROWS), kdim // SPLIT_K_MIN_ROWS)
    kc = -(-kdim // s)
    kc += -kc % SPLIT_K_UNROLL
    return -(-kdim // kc), kc


def _host_gemm(r: Renderer, k: Matmul, ct: str, nb: int, chosen: bool | None = None) -> bool:
    """Whether ``k`` goes to the host's GEMM: a host_gemm dialect, B plain at ``ct``, a float product big enough
    (or, where a search chose, ``chosen``: the size threshold is the only part of the decision it may overturn)."""
    b = r.buffers[k.b]
    eligible = (r.d.host_gemm and ct in ("float32", "float64") and k.m >= r.d.host_gemm_min_m
                and k.b not in r.narrow and compute_type(b) == ct)
    return eligible and (nb * k.m * k.n * k.k >= HOST_GEMM_MIN_MNK if chosen is None else chosen)


def host_gemm_choices(r: Renderer, k: Matmul) -> tuple[bool, ...]:
    """The ``host_gemm`` knob's values for ``k``, the threshold's pick first; () where the GEMM cannot take it."""
    ct, nb = compute_type(r.buffers[k.out]), max(1, math.prod(k.batch))
    if not _host_gemm(r, k, ct, nb, True):
        return ()
    pick = _host_gemm(r, k, ct, nb)
    return (pick, not pick)


def _gemm_steps(r: Renderer, k: Matmul, ct: str, nb: int, a_src: str) -> str:
    """Add the ``Gemm`` step (and the epilogue kernel after it); return the name of the fallback product kernel."""
    direct = k.epilogue == Var("acc") and k.out not in r.narrow
    acc = k.out if direct else r.add_scratch(f"s_{k.name}_acc", nb * k.m * k.n, ct)
    b_dims = k.batch + (k.k, k.n)
    b_strides = broadcast_strides(r.buffers[k.b], b_dims)
    if not any(b_strides[:len(k.batch)]):  # one B for every batch: the GEMM broadcasts it
        b_dims, b_strides = b_dims[len(k.batch):], b_strides[len(k.batch):]
    fallback = k.name if direct else f"{k.name}_full"
    r.steps.append(Gemm(k.name, a_src, k.a_space, contiguous_strides(k.a_space), k.b, b_dims, b_strides, acc,
                        k.space, ct, fallback, "" if direct else k.name))
    if not direct:
        _split_epilogue(r, k, ct, nb, acc)
    return fallback


def _split_epilogue(r: Renderer, k: Matmul, ct: str, nb: int, acc: str) -> None:
    """One work-item per output element: out = epilogue(``acc[gid]``), the GEMM step's result."""
    total = nb * k.m * k.n
    r.kernel(k.name, list(dict.fromkeys([k.out, acc] + loads(k.epilogue))), -(-total // EPILOGUE_GROUP),
             EPILOGUE_GROUP)
    r.gid(total)
    bidx = [f"q{i}" for i in range(len(k.batch))]
    indexing.decompose(r.emit, "gid", k.space, bidx + ["mm", "nn"], r.ix)
    _epilogue(r, k, ct, bidx, r.read(acc, "gid"), out_off="gid")
    r.close()


def _plain_a(r: Renderer, k: Matmul) -> str | None:
    if isinstance(k.a, Load) and not k.a.rotate_half:
        b = r.buffers[k.a.buffer]
        if b.dims == k.a_space and b.strides == contiguous_strides(b.dims):
            return b.name
    return None


def _prologue(r: Renderer, k: Matmul, ct: str, nb: int, a_names: list[str]) -> str:
    """One work-group per row of A writes it to scratch, scaled by a fused RMSNorm's rsqrt: its threads split the
    row (``ilp_loop``: loads in flight), their sums of squares meet in a tree, and each thread scales what it wrote.
    (One work-item per row, as before, walked a 4096-wide row alone: the likely cause of rmsnorm_linear's 365 us
    beside torch's 127 in the first H100 run, not profiled.)"""
    emit, t, it = r.emit, r.ctype(ct), r.d.index_type
    scale = k.row_scale is not None
    local = min(PROLOGUE_GROUP, 1 << max(0, (k.k - 1).bit_length()))
    a_src = r.add_scratch(f"s_{k.name}_a", nb * k.m * k.k, ct)
    r.kernel(f"{k.name}_pro", [a_src] + a_names, nb * k.m, local)
    if scale:
        emit(f"{r.d.local} {t} red[{local}];")
    emit(f"{it} row = {r.d.ids['group']};")
    emit(f"{it} lid = {r.d.ids['local']};")
    ridx = [f"q{i}" for i in range(len(k.batch))] + ["mm"]
    indexing.decompose(emit, "row", k.batch + (k.m,), ridx, r.ix)
    if scale:
        emit(f"{t} ss = {r.const(0, ct)};")

    def values(u: int, at: str) -> list[str]:
        load = r.loader(k.a_space, ridx + [at], ct)
        return [f"{t} a{u} = {r.expr(k.a, load, ct)};"] + (
            [f"{t} x{u} = {r.expr(k.row_scale, load, ct)};"] if scale else [])

    def fold(u: int, at: str) -> list[str]:
        return [f"{a_src}[row * {k.k} + {at}] = a{u};"] + ([f"ss = ss + x{u} * x{u};"] if scale else [])

    r.ilp_loop("kk", "lid", k.k, local, values, fold)
    if scale:
        r.group_reduce("ss", local, lambda a, b: f"{a} + {b}")
        emit(f"{t} sc = {r.rms_scale_expr('ss', k.k, k.eps, ct)};")
        with emit.block(f"for ({it} kk = lid; kk < {k.k}; kk += {local}) {{"):  # the elements this thread wrote
            emit(f"{a_src}[row * {k.k} + kk] = {a_src}[row * {k.k} + kk] * sc;")
        emit("}")
    r.close()
    return a_src


def _epilogue(r: Renderer, k: Matmul, ct: str, bidx: list[str], value: str, out_off: str = "") -> None:
    """Write output (``qb``, ``mm``, ``nn``) = epilogue(``value``); A's rows carry the RMSNorm scale already."""
    t = r.ctype(ct)
    r.emit(f"{t} v_acc = {value};")
    if k.row_scale is not None:
        r.emit(f"{t} v_scale = {r.const(1, ct)};  // A's rows are scaled already")
    load = r.loader(k.space, bidx + ["mm", "nn"], ct)
    r.emit(r.write(k.out, out_off or f"(qb * {k.m} + mm) * {k.n} + nn", r.expr(k.epilogue, load, ct)))


def _block_frame(r: Renderer, k: Matmul, nb: int, args: list[str], mb: int, nw: int,
                 strides: tuple[int, ...], name: str, step: bool) -> list[str]:
    """Open a blocked kernel: work-item -> (qb, m0, n0) with the M block fastest; A's and B's base offsets."""
    emit, it = r.emit, r.d.index_type
    mblocks, nblocks = k.m // mb, k.n // nw
    items = nb * mblocks * nblocks
    r.kernel(name, args, -(-items // BLOCK_GROUP), BLOCK_GROUP, step=step)
    emit(f"{it} gid = {r.d.ids['global']};")
    if items % BLOCK_GROUP:
        emit(f"if (gid >= {items}) return;")
    emit(f"{it} m0 = (gid % {mblocks}) * {mb};")
    emit(f"{it} rest = gid / {mblocks};")
    emit(f"{it} n0 = (rest % {nblocks}) * {nw};")
    emit(f"{it} qb = rest / {nblocks};")
    bidx = [f"q{i}" for i in range(len(k.batch))]
    indexing.decompose(emit, "qb", k.batch, bidx, r.ix, scratch="_q")
    emit(f"{it} abase = (qb * {k.m} + m0) * {k.k};")
    emit(f"{it} bbase = {indexing.at(indexing.offset(bidx, strides[:-2], r.ix), 'n0', strides[-1], r.ix)};")
    return bidx


def _dot(r: Renderer, k: Matmul, ct: str, nb: int, a_src: str, args: list[str], strides: tuple[int, ...],
         mb: int, nbk: int, vw: int, name: str, step: bool) -> None:
    emit, t, it = r.emit, r.ctype(ct), r.d.index_type
    sn = strides[-1]
    bidx = _block_frame(r, k, nb, args, mb, nbk, strides, name, step)
    zero = r.const(0, ct)
    kv = k.k - k.k % vw
    emit(f"{t} acc[{mb}][{nbk}][{vw}];")
    emit(f"for (int i = 0; i < {mb}; i++) for (int j = 0; j < {nbk}; j++) for (int v = 0; v < {vw}; v++) "
         f"acc[i][j][v] = {zero};")
    b_row = f"bbase + j * {sn}" if sn else "bbase"
    if kv:
        with emit.block(f"for ({it} k0 = 0; k0 < {kv}; k0 += {vw}) {{"):
            emit(f"{t} av[{mb}][{vw}];")
            emit(f"{t} bv[{nbk}][{vw}];")
            emit(f"for (int i = 0; i < {mb}; i++) for (int v = 0; v < {vw}; v++) "
                 f"av[i][v] = {r.read(a_src, f'abase + i * {k.k} + k0 + v')};")
            emit(f"for (int j = 0; j < {nbk}; j++) for (int v = 0; v < {vw}; v++) "
                 f"bv[j][v] = {r.read(k.b, f'{b_row} + k0 + v')};")
            emit(f"for (int i = 0; i < {mb}; i++) for (int j = 0; j < {nbk}; j++) for (int v = 0; v < {vw}; v++) "
                 "acc[i][j][v] = acc[i][j][v] + av[i][v] * bv[j][v];")
        emit("}")
    if kv < k.k:  # the K tail, into lane 0
        with emit.block(f"for ({it} kk = {kv}; kk < {k.k}; kk++) {{"):
            emit(f"for (int i = 0; i < {mb}; i++) for (int j = 0; j < {nbk}; j++) acc[i][j][0] = acc[i][j][0] + "
                 f"{r.read(a_src, f'abase + i * {k.k} + kk')} * {r.read(k.b, f'{b_row} + kk')};")
        emit("}")
    if vw > 1:  # pairwise sum of the lanes: a fixed order
        emit(f"for (int w = {vw // 2}; w > 0; w >>= 1) for (int i = 0; i < {mb}; i++) for (int j = 0; j < {nbk}; "
             "j++) for (int v = 0; v < w; v++) acc[i][j][v] = acc[i][j][v] + acc[i][j][v + w];")
    with emit.block(f"for (int i = 0; i < {mb}; i++) {{"):
        with emit.block(f"for (int j = 0; j < {nbk}; j++) {{"):
            emit(f"{it} mm = m0 + i;")
            emit(f"{it} nn = n0 + j;")
            _epilogue(r, k, ct, bidx, "acc[i][j][0]")
        emit("}")
    emit("}")
    r.close()


def _rows(r: Renderer, k: Matmul, ct: str, nb: int, a_src: str, args: list[str], strides: tuple[int, ...],
          mb: int, vw: int, name: str, step: bool) -> None:
    emit, t, it = r.emit, r.ctype(ct), r.d.index_type
    sk = strides[-2]
    bidx = _block_frame(r, k, nb, args, mb, vw, strides, name, step)
    emit(f"{t} acc[{mb}][{vw}];")
    emit(f"for (int i = 0; i < {mb}; i++) for (int v = 0; v < {vw}; v++) acc[i][v] = {r.const(0, ct)};")
    with emit.block(f"for ({it} kk = 0; kk < {k.k}; kk++) {{"):
        emit(f"{t} bv[{vw}];")
        emit(f"for (int v = 0; v < {vw}; v++) bv[v] = {r.read(k.b, indexing.at('bbase', 'kk', sk, r.ix) + ' + v')};")
        with emit.block(f"for (int i = 0; i < {mb}; i++) {{"):
            emit(f"{t} x = {r.read(a_src, f'abase + i * {k.k} + kk')};")
            emit(f"for (int v = 0; v < {vw}; v++) acc[i][v] = acc[i][v] + x * bv[v];")
        emit("}")
    emit("}")
    with emit.block(f"for (int i = 0; i < {mb}; i++) {{"):
        with emit.block(f"for (int v = 0; v < {vw}; v++) {{"):
            emit(f"{it} mm = m0 + i;")
            emit(f"{it} nn = n0 + v;")
            _epilogue(r, k, ct, bidx, "acc[i][v]")
        emit("}")
    emit("}")
    r.close()


def _gemv_split_k(r: Renderer, k: Matmul, ct: str, nb: int, a_src: str, strides: tuple[int, ...],
                  name: str, step: bool) -> None:
    """The split-K GEMV (M = 1, B contiguous along N): partial rows per K slice, then their sum and the epilogue.

    ``{name}_part`` has S one-work-item groups per batch item, each streaming whole rows of its K slice of B
    into a partial row of N sums; ``{name}`` sums the S partials of each output. Every sum runs in a fixed
    order (rows in order within a group, then groups 0..S-1), so results do not depend on scheduling. The
    partial row (N values) stays in the core's cache while B streams from memory.
    """
    emit, t, it = r.emit, r.ctype(ct), r.d.index_type
    groups, kc = split_k_groups(k.k)
    sk, n, u = strides[-2], k.n, SPLIT_K_UNROLL
    part = r.add_scratch(f"s_{name}_part", nb * groups * n, ct)
    r.kernel(f"{name}_part", list(dict.fromkeys([part, a_src, k.b])), nb * groups, 1, step=step)
    emit(f"{it} gid = {r.d.ids['global']};")
    emit(f"{it} qb = gid / {groups};")
    emit(f"{it} k0 = (gid % {groups}) * {kc};")
    emit(f"{it} k1 = k0 + {kc} < {k.k} ? k0 + {kc} : {k.k};")
    bidx = [f"q{i}" for i in range(len(k.batch))]
    indexing.decompose(emit, "qb", k.batch, bidx, r.ix, scratch="_q")
    emit(f"{it} abase = qb * {k.k};")
    emit(f"{it} bbase = {indexing.offset(bidx, strides[:-2], r.ix)};")
    emit(f"{it} pbase = gid * {n};")

    def row(j: int) -> str:  # where B's row kk + j starts
        return indexing.at("bbase", f"(kk + {j})" if j else "kk", sk, r.ix)

    emit(f"{it} kk = k0;")
    with emit.block("{"):  # the first row is written, not added: no zero-fill needed
        emit(f"{t} x = {r.read(a_src, 'abase + kk')};")
        emit(f"{it} rk = {row(0)};")
        with emit.block(f"for ({it} nn = 0; nn < {n}; nn++) {{"):
            emit(f"{part}[pbase + nn] = x * {r.read(k.b, 'rk + nn')};")
        emit("}")
    emit("}")
    with emit.block(f"for (kk = k0 + 1; kk + {u} <= k1; kk += {u}) {{"):  # {u} rows per pass over the partial row
        for j in range(u):
            emit(f"{t} x{j} = {r.read(a_src, f'abase + kk + {j}' if j else 'abase + kk')};")
            emit(f"{it} r{j} = {row(j)};")
        with emit.block(f"for ({it} nn = 0; nn < {n}; nn++) {{"):
            emit(f"{t} p = {part}[pbase + nn];")
            for j in range(u):
                emit(f"p = p + x{j} * {r.read(k.b, f'r{j} + nn')};")
            emit(f"{part}[pbase + nn] = p;")
        emit("}")
    emit("}")
    with emit.block("for (; kk < k1; kk++) {"):
        emit(f"{t} x = {r.read(a_src, 'abase + kk')};")
        emit(f"{it} rk = {row(0)};")
        with emit.block(f"for ({it} nn = 0; nn < {n}; nn++) {{"):
            emit(f"{part}[pbase + nn] = {part}[pbase + nn] + x * {r.read(k.b, 'rk + nn')};")
        emit("}")
    emit("}")
    r.close()

    cols = min(SPLIT_K_SUM_COLS, n)  # columns per work-item of the sum: inner loops over contiguous columns
    blocks = -(-n // cols)
    r.kernel(name, list(dict.fromkeys([k.out, part] + loads(k.epilogue))), nb * blocks, 1, step=step)
    emit(f"{it} gid = {r.d.ids['global']};")
    emit(f"{it} qb = gid / {blocks};")
    emit(f"{it} c0 = (gid % {blocks}) * {cols};")
    cn = str(cols) if n % cols == 0 else "cn"
    if n % cols:
        emit(f"int cn = {n} - c0 < {cols} ? (int)({n} - c0) : {cols};")
    indexing.decompose(emit, "qb", k.batch, bidx, r.ix, scratch="_q")
    emit(f"{it} pb = qb * {groups * n} + c0;")
    emit(f"{t} s[{cols}];")
    emit(f"for (int v = 0; v < {cn}; v++) s[v] = {part}[pb + v];")
    emit(f"for (int g = 1; g < {groups}; g++) for (int v = 0; v < {cn}; v++) s[v] = s[v] + {part}[pb + g * {n} + v];")
    with emit.block(f"for (int v = 0; v < {cn}; v++) {{"):
        emit(f"{it} mm = 0;")
        emit(f"{it} nn = c0 + v;")
        _epilogue(r, k, ct, bidx, "s[v]")
    emit("}")
    r.close()


def _naive(r: Renderer, k: Matmul, ct: str, nb: int, a_src: str, args: list[str], name: str, step: bool) -> None:
    """One work-item per output element (B neither K- nor N-contiguous, or N has no usable divisor)."""
    emit, t, it = r.emit, r.ctype(ct), r.d.index_type
    total = nb * k.m * k.n
    r.kernel(name, args, -(-total // GROUP), GROUP, step=step)
    r.gid(total)
    bidx = [f"q{i}" for i in range(len(k.batch))]
    indexing.decompose(emit, "gid", k.space, bidx + ["mm", "nn"], r.ix)
    emit(f"{it} qb = gid / {k.m * k.n};")
    emit(f"{it} arow = (gid / {k.n}) * {k.k};")
    b_off = indexing.offset(bidx + ["kk", "nn"], broadcast_strides(r.buffers[k.b], k.batch + (k.k, k.n)), r.ix)
    emit(f"{t} s = {r.const(0, ct)};")
    with emit.block(f"for ({it} kk = 0; kk < {k.k}; kk++) {{"):
        emit(f"s = s + {r.read(a_src, 'arow + kk')} * {r.read(k.b, b_off)};")
    emit("}")
    _epilogue(r, k, ct, bidx, "s")
    r.close()
