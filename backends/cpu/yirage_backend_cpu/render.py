"""The Python renderer: kernel IR -> one numba module per plan.

Each kernel becomes an ``@njit(parallel, fastmath, nogil, cache)`` function
over flat 1-D buffers with every shape and stride baked in as a constant; a
plain-Python ``run(inputs)`` launcher converts torch tensors to numpy views,
allocates outputs and temporaries and calls the kernels in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from yirage.compiler.indexing import broadcast_strides, coalesce
from yirage.compiler.kernel_ir import (
    Attention,
    Buffer,
    Call,
    Const,
    Embedding,
    Expr,
    Kernel,
    KernelPlan,
    Load,
    Matmul,
    Pointwise,
    Row,
    Var,
)
from yirage.graph.kernel_graph import contiguous_strides

RENDERER_VERSION = "1"
PARALLEL_MIN_WORK = 1 << 15  # below this many scalar ops, prange costs more than it saves
POINTWISE_CHUNK = 4096
GEMV_MAX_M = 16  # up to this many rows per batch a matmul streams B once; above it BLAS wins


def threads() -> int:
    """numba's thread count, baked into the source (and so into the cache key)."""
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def compute_type(buffer: Buffer) -> str:
    """Floats narrower than 32 bits are widened to float32 at the boundary."""
    name = buffer.dtype.name
    return "float32" if name in ("float16", "bfloat16") else name


class Emitter:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def block(self, header: str) -> Emitter:
        self(header)
        return self

    def __enter__(self) -> Emitter:
        self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


def const(value: float, ct: str) -> str:
    if ct.startswith("int"):
        return f"np.{ct}({int(value)})"
    if math.isinf(value):
        return f"np.{ct}({'-' if value < 0 else ''}np.inf)"
    return f"np.{ct}({value!r})"


def expr_src(expr: Expr, load: Callable[[Load], str], ct: str) -> str:
    """Spell an expression in numba-Python for compute type ``ct``."""
    if isinstance(expr, Load):
        return load(expr)
    if isinstance(expr, Var):
        return f"v_{expr.name}"
    if isinstance(expr, Const):
        return const(expr.value, ct)
    a = [expr_src(x, load, ct) for x in expr.args]
    f32 = ct == "float32"
    one = const(1.0, ct)
    spell = {
        "add": lambda: f"({a[0]} + {a[1]})",
        "sub": lambda: f"({a[0]} - {a[1]})",
        "mul": lambda: f"({a[0]} * {a[1]})",
        "div": lambda: f"({a[0]} / {a[1]})",
        "pow": lambda: f"({a[0]} ** {a[1]})",
        "max": lambda: f"max({a[0]}, {a[1]})",
        "min": lambda: f"min({a[0]}, {a[1]})",
        "exp": lambda: f"fexp({a[0]})" if f32 else f"math.exp({a[0]})",
        "sqrt": lambda: f"math.sqrt({a[0]})",
        "rsqrt": lambda: f"({one} / math.sqrt({a[0]}))",
        "silu": lambda: f"fsilu({a[0]})" if f32 else f"dsilu({a[0]})",
        "gelu": lambda: f"fgelu({a[0]})" if f32 else f"dgelu({a[0]})",
        "relu": lambda: f"max({a[0]}, {const(0, ct)})",
        "square": lambda: f"({a[0]} * {a[0]})",
        "neg": lambda: f"(-{a[0]})",
    }
    return spell[expr.fn]()


def has_rotate(expr: Expr) -> bool:
    if isinstance(expr, Load):
        return expr.rotate_half
    if isinstance(expr, Call):
        return any(has_rotate(a) for a in expr.args)
    return False


def decompose(emit: Emitter, flat: str, dims: Sequence[int], names: Sequence[str]) -> None:
    """Emit ``names[i] = index along dims[i]`` for the row-major flat index ``flat`` (uint64)."""
    if not dims:
        return
    if len(dims) == 1:
        emit(f"{names[0]} = {flat}")
        return
    emit(f"_r = {flat}")
    for i in range(len(dims) - 1, 0, -1):
        emit(f"{names[i]} = _r % U({dims[i]})")
        emit(f"_r = _r // U({dims[i]})")
    emit(f"{names[0]} = _r")


def offset(names: Sequence[str], strides: Sequence[int]) -> str:
    """uint64 offset expression; every index is uint64 so numba skips wraparound checks."""
    terms = [f"{n} * U({s})" if s != 1 else n for n, s in zip(names, strides, strict=True) if s]
    return " + ".join(terms) or "U(0)"


def at(base: str, index: str, stride: int) -> str:
    if not stride:
        return base
    return f"{base} + {index}" if stride == 1 else f"{base} + {index} * U({stride})"


def signature(args: Sequence[Buffer]) -> str:
    return "int64(" + ", ".join(f"{compute_type(b)}[::1]" for b in args) + ")"


def decorator(args: Sequence[Buffer], parallel: bool) -> str:
    return (f'@njit("{signature(args)}", parallel={parallel}, fastmath=True, error_model="numpy", '
            f"nogil=True, cache=True)")


def outer_loop(emit: Emitter, var: str, count: int, parallel: bool) -> Emitter:
    """A (p)range over ``count`` whose body sees ``var`` as uint64."""
    emit(f"for {var}_ in {'prange' if parallel else 'range'}({count}):")
    emit.depth += 1
    emit(f"{var} = U({var}_)")
    emit.depth -= 1
    return emit


# -- kernels ----------------------------------------------------------------


def render_pointwise(k: Pointwise, buffers: dict[str, Buffer], emit: Emitter) -> None:
    names = k.reads()
    out = buffers[k.out]
    ct = compute_type(out)
    strides = [contiguous_strides(k.space)] + [broadcast_strides(buffers[n], k.space) for n in names]
    keep = [len(k.space) - 1] if has_rotate(k.expr) else []
    space, cstrides, _ = coalesce(k.space, strides, keep)
    inner, outer_dims = space[-1], space[:-1]
    outer = math.prod(outer_dims)
    parallel = math.prod(space) >= PARALLEL_MIN_WORK
    chunk = min(inner, POINTWISE_CHUNK) if parallel else inner
    nch = -(-inner // chunk)
    args = [out] + [buffers[n] for n in names]
    all_names = [k.out] + names
    inner_stride = {name: s[-1] for name, s in zip(all_names, cstrides, strict=True)}
    half = inner // 2

    def load(ld: Load) -> str:
        s = inner_stride[ld.buffer]
        if not ld.rotate_half:
            return f"{ld.buffer}[{at(f'b_{ld.buffer}', 'j', s)}]"
        partner = f"{ld.buffer}[{at(f'b_{ld.buffer}', f'(j + U({half}) if j < U({half}) else j - U({half}))', s)}]"
        return f"(-{partner} if j < U({half}) else {partner})"

    emit(decorator(args, parallel))
    with emit.block(f"def {k.name}({', '.join(b.name for b in args)}):"):
        with outer_loop(emit, "t", outer * nch, parallel):
            emit(f"o = t // U({nch})")
            emit(f"j0 = (t - o * U({nch})) * U({chunk})")
            idx = [f"i{d}" for d in range(len(outer_dims))]
            decompose(emit, "o", outer_dims, idx)
            for name, s in zip(all_names, cstrides, strict=True):
                emit(f"b_{name} = {offset(idx, s[:-1])}")
            with emit.block(f"for j in range(j0, min(j0 + U({chunk}), U({inner}))):"):
                emit(f"{k.out}[{at(f'b_{k.out}', 'j', inner_stride[k.out])}] = {expr_src(k.expr, load, ct)}")
        emit("return 0")


def render_row(k: Row, buffers: dict[str, Buffer], emit: Emitter) -> None:
    names = k.reads()
    out = buffers[k.out]
    ct = compute_type(out)
    out_dims = tuple(1 if i == k.axis else d for i, d in enumerate(k.space))
    out_strides = broadcast_strides(out, out_dims if k.per_row else k.space)
    strides = [out_strides] + [broadcast_strides(buffers[n], k.space) for n in names]
    space, cstrides, origin = coalesce(k.space, strides, [k.axis])
    axis = origin.index(k.axis)
    length = space[axis]
    row_dims = [d for i, d in enumerate(space) if i != axis]
    rows = math.prod(row_dims)
    parallel = rows > 1 and rows * length >= PARALLEL_MIN_WORK
    args = [out] + [buffers[n] for n in names]
    all_names = [k.out] + names
    step = {n: s[axis] for n, s in zip(all_names, cstrides, strict=True)}

    def load(ld: Load) -> str:
        return f"{ld.buffer}[{at(f'b_{ld.buffer}', 'l', step[ld.buffer])}]"

    def row_load(ld: Load) -> str:
        return f"{ld.buffer}[b_{ld.buffer}]"

    emit(decorator(args, parallel))
    with emit.block(f"def {k.name}({', '.join(b.name for b in args)}):"):
        with outer_loop(emit, "r", rows, parallel):
            idx = [f"i{d}" for d in range(len(row_dims))]
            decompose(emit, "r", row_dims, idx)
            for name, s in zip(all_names, cstrides, strict=True):
                emit(f"b_{name} = {offset(idx, [x for i, x in enumerate(s) if i != axis])}")
            for red in k.reductions:
                init = const(0, ct) if red.combine == "sum" else const(-math.inf, ct)
                emit(f"v_{red.var} = {init}")
                with emit.block(f"for l in range(U({length})):"):
                    value = expr_src(red.expr, load, ct)
                    if red.combine == "sum":
                        emit(f"v_{red.var} += {value}")
                    else:
                        emit(f"v_{red.var} = max(v_{red.var}, {value})")
            if k.per_row:
                emit(f"{k.out}[b_{k.out}] = {expr_src(k.out_expr, row_load, ct)}")
            else:
                with emit.block(f"for l in range(U({length})):"):
                    emit(f"{k.out}[{at(f'b_{k.out}', 'l', step[k.out])}] = {expr_src(k.out_expr, load, ct)}")
        emit("return 0")


def _plain_contiguous_a(k: Matmul, buffers: dict[str, Buffer]) -> str | None:
    if isinstance(k.a, Load) and not k.a.rotate_half:
        b = buffers[k.a.buffer]
        if b.dims == k.a_space and b.strides == contiguous_strides(b.dims):
            return b.name
    return None


def _loads(expr: Expr | None) -> list[str]:
    from yirage.compiler.kernel_ir import loads

    return loads(expr) if expr is not None else []


def matmul_args(k: Matmul) -> tuple[list[str], list[str], list[str]]:
    """(A-prologue buffers, epilogue buffers, all buffers in argument order after out)."""
    a_names = list(dict.fromkeys(_loads(k.a) + _loads(k.row_scale)))
    epi_names = list(dict.fromkeys(_loads(k.epilogue)))
    return a_names, epi_names, list(dict.fromkeys(a_names + [k.b] + epi_names))


def render_matmul(k: Matmul, buffers: dict[str, Buffer], emit: Emitter) -> None:
    out = buffers[k.out]
    ct = compute_type(out)
    m, n, kk = k.m, k.n, k.k
    nb = math.prod(k.batch)
    b_strides = broadcast_strides(buffers[k.b], k.batch + (kk, n))
    sbk, sbn = b_strides[-2], b_strides[-1]
    a_names, epi_names, names = matmul_args(k)
    args = [out] + [buffers[x] for x in names]
    plain_a = _plain_contiguous_a(k, buffers)
    parallel = nb * m * n * kk >= PARALLEL_MIN_WORK
    bidx = [f"q{d}" for d in range(len(k.batch))]
    epi_step = {x: broadcast_strides(buffers[x], k.space) for x in epi_names}
    scale = k.row_scale is not None

    def batch_bases(flat: str) -> None:
        decompose(emit, flat, k.batch, bidx)
        emit(f"bb = {offset(bidx, b_strides[:-2])}")
        for x in epi_names:
            emit(f"eb_{x} = {offset(bidx, epi_step[x][:-2])}")

    def store(acc: str, col: str = "nn") -> list[str]:
        def epi_load(ld: Load) -> str:
            sm, sn = epi_step[ld.buffer][-2:]
            return f"{ld.buffer}[{at(at(f'eb_{ld.buffer}', 'mm', sm), col, sn)}]"

        lines = [f"v_acc = {acc}"]
        if scale:
            lines.append(f"v_scale = v_sc[bi * U({m}) + mm]")
        lines.append(f"{k.out}[(bi * U({m}) + mm) * U({n}) + {col}] = {expr_src(k.epilogue, epi_load, ct)}")
        return lines

    emit(decorator(args, parallel))
    with emit.block(f"def {k.name}({', '.join(b.name for b in args)}):"):
        a_src = plain_a or "a_mat"
        if plain_a is None or scale:
            # prologue: materialize A (and the fused RMSNorm's row scale) once per row
            a_strides = {x: broadcast_strides(buffers[x], k.a_space) for x in a_names}
            if plain_a is None:
                emit(f"a_mat = np.empty({nb * m * kk}, np.{ct})")
            if scale:
                emit(f"v_sc = np.empty({nb * m}, np.{ct})")
            with outer_loop(emit, "row", nb * m, parallel and nb * m > 1):
                ridx = bidx + ["mm"]
                decompose(emit, "row", k.batch + (m,), ridx)
                for x in a_names:
                    emit(f"ab_{x} = {offset(ridx, a_strides[x][:-1])}")

                def a_load(ld: Load) -> str:
                    return f"{ld.buffer}[{at(f'ab_{ld.buffer}', 'kk', a_strides[ld.buffer][-1])}]"

                if scale:
                    emit(f"ss = {const(0, ct)}")
                with emit.block(f"for kk in range(U({kk})):"):
                    if plain_a is None:
                        emit(f"a_mat[row * U({kk}) + kk] = {expr_src(k.a, a_load, ct)}")
                    if scale:
                        emit(f"x = {expr_src(k.row_scale, a_load, ct)}")
                        emit("ss += x * x")
                if scale:
                    emit(f"v_sc[row] = {const(1, ct)} / math.sqrt(ss / {const(kk, ct)} + {const(k.eps, ct)})")

        if m > GEMV_MAX_M and ((sbn == 1 and sbk == n) or (sbk == 1 and sbn == kk)):
            # BLAS: one GEMM per batch, then the epilogue
            with emit.block(f"for bi_ in range({nb}):"):
                emit("bi = U(bi_)")
                batch_bases("bi")
                emit(f"a2 = {a_src}[bi * U({m * kk}):(bi + U(1)) * U({m * kk})].reshape(({m}, {kk}))")
                shape = f"({kk}, {n}))" if sbn == 1 else f"({n}, {kk})).T"
                emit(f"b2 = {k.b}[bb:bb + U({kk * n})].reshape({shape}")
                emit("c2 = np.dot(a2, b2)")
                with outer_loop(emit, "mm", m, parallel):
                    with emit.block(f"for nn in range(U({n})):"):
                        for line in store("c2[mm, nn]"):
                            emit(line)
        elif sbn == 1 and sbk != 1 and nb == 1:
            # split-K GEMV over a row-major (K, N) weight: each thread streams whole rows of B
            parts = max(1, min(threads(), kk // 64))
            emit(f"part = np.zeros(({parts}, {m * n}), np.{ct})")
            with outer_loop(emit, "p", parts, parallel and parts > 1):
                emit("bi = U(0)")
                batch_bases("bi")
                with emit.block(f"for kk in range(p * U({kk}) // U({parts}), (p + U(1)) * U({kk}) // U({parts})):"):
                    emit(f"brow = {at('bb', 'kk', sbk)}")
                    with emit.block(f"for mm in range(U({m})):"):
                        emit(f"av = {a_src}[mm * U({kk}) + kk]")
                        emit(f"dst = part[p, mm * U({n}):(mm + U(1)) * U({n})]")
                        with emit.block(f"for nn in range(U({n})):"):
                            emit(f"dst[nn] += av * {k.b}[brow + nn]")
            with outer_loop(emit, "mm", m, False):
                emit("bi = U(0)")
                batch_bases("bi")
                with emit.block(f"for nn in {'prange' if parallel else 'range'}({n}):"):
                    emit("nu = U(nn)")
                    emit(f"acc = {const(0, ct)}")
                    with emit.block(f"for p in range({parts}):"):
                        emit(f"acc += part[p, mm * U({n}) + nu]")
                    for line in store("acc", "nu"):
                        emit(line)
        else:
            # dot products: each tile owns a block of output columns and reads them from B once
            group = 4 if sbk == 1 and n >= 4 else 1
            block = 16 if n >= 16 else n
            block -= block % group
            tiles = -(-n // block)
            with outer_loop(emit, "t", nb * tiles, parallel):
                emit(f"bi = t // U({tiles})")
                emit(f"n0 = (t - bi * U({tiles})) * U({block})")
                emit(f"n1 = min(n0 + U({block}), U({n}))")
                batch_bases("bi")
                if group == 4:
                    with emit.block("for nn in range(n0, n1 - (n1 - n0) % U(4), U(4)):"):
                        for c in range(4):
                            emit(f"c{c} = {k.b}[{at('bb', f'(nn + U({c}))' if c else 'nn', sbn)}:][:{kk}]")
                        with emit.block(f"for mm in range(U({m})):"):
                            emit(f"ar = {a_src}[(bi * U({m}) + mm) * U({kk}):][:{kk}]")
                            for c in range(4):
                                emit(f"s{c} = {const(0, ct)}")
                            with emit.block(f"for kk in range(U({kk})):"):
                                emit("x = ar[kk]")
                                for c in range(4):
                                    emit(f"s{c} += x * c{c}[kk]")
                            for c in range(4):
                                emit(f"nc = nn + U({c})")
                                for line in store(f"s{c}", "nc"):
                                    emit(line)
                    first_rest = "n1 - (n1 - n0) % U(4)"
                else:
                    first_rest = "n0"
                with emit.block(f"for nn in range({first_rest}, n1):"):
                    emit(f"bcol = {at('bb', 'nn', sbn)}")
                    with emit.block(f"for mm in range(U({m})):"):
                        emit(f"arow = (bi * U({m}) + mm) * U({kk})")
                        emit(f"acc = {const(0, ct)}")
                        with emit.block(f"for kk in range(U({kk})):"):
                            emit(f"acc += {a_src}[arow + kk] * {k.b}[{at('bcol', 'kk', sbk)}]")
                        for line in store("acc"):
                            emit(line)
        emit("return 0")


def render_embedding(k: Embedding, buffers: dict[str, Buffer], emit: Emitter) -> None:
    out, ids, table = buffers[k.out], buffers[k.ids], buffers[k.table]
    sv, sd = table.strides
    parallel = k.tokens * k.dim >= PARALLEL_MIN_WORK and k.tokens > 1
    idx = [f"i{d}" for d in range(len(ids.dims))]
    emit(decorator([out, ids, table], parallel))
    with emit.block(f"def {k.name}({k.out}, {k.ids}, {k.table}):"):
        with outer_loop(emit, "t", k.tokens, False):
            decompose(emit, "t", ids.dims, idx)
            emit(f"tok = {k.ids}[{offset(idx, ids.strides)}]")
            with emit.block(f"if tok < 0 or tok >= {k.vocab}:"):
                emit("return t_ + 1")
        with outer_loop(emit, "t", k.tokens, parallel):
            decompose(emit, "t", ids.dims, idx)
            emit(f"row = U({k.ids}[{offset(idx, ids.strides)}]) * U({sv})")
            with emit.block(f"for d in range(U({k.dim})):"):
                emit(f"{k.out}[t * U({k.dim}) + d] = {k.table}[{at('row', 'd', sd)}]")
        emit("return 0")


def render_attention(k: Attention, buffers: dict[str, Buffer], emit: Emitter) -> None:
    out, q, kc, vc = (buffers[x] for x in (k.out, k.q, k.k, k.v))
    ct = compute_type(out)
    args = [out, q, kc, vc] + ([buffers[k.lengths]] if k.lengths else [])
    group = k.heads // k.kv_heads
    parallel = k.batch * k.heads > 1 and k.batch * k.heads * k.seq * k.head_dim >= PARALLEL_MIN_WORK
    qs, ks, vs = q.strides, kc.strides, vc.strides
    ls = buffers[k.lengths].strides[0] if k.lengths else 0
    emit(decorator(args, parallel))
    with emit.block(f"def {k.name}({', '.join(b.name for b in args)}):"):
        if k.lengths:
            with emit.block(f"for b in range({k.batch}):"):
                emit(f"n = {k.lengths}[U(b) * U({ls})]")
                with emit.block(f"if n < 1 or n > {k.seq}:"):
                    emit("return b + 1")
        with outer_loop(emit, "t", k.batch * k.heads, parallel):
            emit(f"b = t // U({k.heads})")
            emit(f"h = t - b * U({k.heads})")
            emit(f"g = h // U({group})")
            emit(f"n = U({k.lengths}[b * U({ls})])" if k.lengths else f"n = U({k.seq})")
            emit(f"qb = {offset(['b', 'h'], qs[:2])}")
            emit(f"kb = {offset(['b', 'g'], ks[:2])}")
            emit(f"vb = {offset(['b', 'g'], vs[:2])}")
            emit(f"sc = np.empty(n, np.{ct})")
            emit(f"mx = {const(-math.inf, ct)}")
            with emit.block("for s in range(n):"):
                emit(f"acc = {const(0, ct)}")
                emit(f"kr = {at('kb', 's', ks[2])}")
                with emit.block(f"for d in range(U({k.head_dim})):"):
                    emit(f"acc += {k.q}[{at('qb', 'd', qs[2])}] * {k.k}[{at('kr', 'd', ks[3])}]")
                emit(f"acc *= {const(k.scale, ct)}")
                emit("sc[s] = acc")
                emit("mx = max(mx, acc)")
            emit(f"tot = {const(0, ct)}")
            exp = "fexp" if ct == "float32" else "math.exp"
            with emit.block("for s in range(n):"):
                emit(f"e = {exp}(sc[s] - mx)")
                emit("sc[s] = e")
                emit("tot += e")
            emit(f"ob = t * U({k.head_dim})")
            with emit.block(f"for d in range(U({k.head_dim})):"):
                emit(f"{k.out}[ob + d] = {const(0, ct)}")
            with emit.block("for s in range(n):"):
                emit("w = sc[s] / tot")
                emit(f"vr = {at('vb', 's', vs[2])}")
                with emit.block(f"for d in range(U({k.head_dim})):"):
                    emit(f"{k.out}[ob + d] += w * {k.v}[{at('vr', 'd', vs[3])}]")
        emit("return 0")


RENDERERS: dict[type, Callable[..., None]] = {
    Pointwise: render_pointwise,
    Row: render_row,
    Matmul: render_matmul,
    Embedding: render_embedding,
    Attention: render_attention,
}


def kernel_args(k: Kernel, buffers: dict[str, Buffer]) -> list[str]:
    """The buffer names a kernel function takes, in order (out first)."""
    if isinstance(k, Matmul):
        return [k.out] + matmul_args(k)[2]
    if isinstance(k, Embedding):
        return [k.out, k.ids, k.table]
    if isinstance(k, Attention):
        return [k.out, k.q, k.k, k.v] + ([k.lengths] if k.lengths else [])
    return [k.out] + k.reads()


# -- the launcher -------------------------------------------------------------


def _input_view(buf: Buffer, var: str) -> str:
    """Source turning torch tensor ``var`` into a flat numpy view in memory order."""
    src = f"{var}.float()" if buf.dtype.name in ("float16", "bfloat16") else var
    order = sorted(range(len(buf.dims)), key=lambda i: (-buf.strides[i], i))
    if order != list(range(len(buf.dims))) and any(buf.dims[i] > 1 for i in range(len(buf.dims))):
        return f"{src}.numpy().transpose({tuple(order)}).reshape(-1)"
    return f"{src}.numpy().reshape(-1)"


def render_module(plan: KernelPlan, version: str) -> str:
    emit = Emitter()
    emit(f"# Generated by yirage-backend-cpu {version} (renderer {RENDERER_VERSION}) for plan {plan.digest}.")
    emit("# Do not edit: yirage re-renders this file on every compile and rewrites it if it differs.")
    emit("import math")
    emit("")
    emit("import numba")
    emit("import numpy as np")
    emit("import torch")
    emit("from numba import njit, prange")
    emit("")
    emit("from yirage_backend_cpu.kernel_lib import dgelu, dsilu, fexp, fgelu, fsilu")
    emit("")
    emit("U = np.uint64")
    emit("_keep = (math, numba, prange, dgelu, dsilu, fexp, fgelu, fsilu)")
    for k in plan.kernels:
        emit("")
        emit("")
        RENDERERS[type(k)](k, plan.buffers, emit)
    emit("")
    emit("")
    with emit.block("def run(inputs):"):
        for name in plan.inputs:
            buf = plan.buffers[name]
            emit(f"x = inputs[{buf.index}]")
            emit(f"{name} = {_input_view(buf, 'x')}")
        for buf in plan.buffers.values():
            if buf.role == "input":
                continue
            ct = compute_type(buf)
            size = math.prod(buf.dims)
            if buf.role == "output" and ct == buf.dtype.name:
                emit(f"t_{buf.name} = torch.empty({buf.dims}, dtype=torch.{ct})")
                emit(f"{buf.name} = t_{buf.name}.numpy().reshape(-1)")
            else:
                emit(f"{buf.name} = np.empty({size}, np.{ct})")
        for k in plan.kernels:
            args = ", ".join(kernel_args(k, plan.buffers))
            if isinstance(k, Embedding):
                emit(f"s = {k.name}({args})")
                with emit.block("if s:"):
                    emit(f'raise IndexError(f"embedding ids must lie in [0, {k.vocab}); the id at flat position '
                         f'{{s - 1}} of {k.ids} is out of range")')
            elif isinstance(k, Attention) and k.lengths:
                emit(f"s = {k.name}({args})")
                with emit.block("if s:"):
                    emit(f'raise ValueError(f"attention lengths must lie in [1, {k.seq}]; batch {{s - 1}} '
                         f'has length {{int({k.lengths}[s - 1])}}")')
            else:
                emit(f"{k.name}({args})")
        results = []
        for name in plan.outputs:
            buf = plan.buffers[name]
            if compute_type(buf) == buf.dtype.name:
                results.append(f"t_{name}")
            else:
                results.append(f"torch.from_numpy({name}).view({buf.dims}).to(torch.{buf.dtype.name})")
        emit(f"return [{', '.join(results)}]")
    emit("")
    return "\n".join(emit.lines)
