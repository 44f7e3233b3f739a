"""Matmul templates of the numba renderer.

Three strategies, picked from the shapes and B's layout by ``knobs.matmul_strategies``
(or by ``g.superoptimize()``, which times them: the ``strategy`` knob):

* dot products (B stored (N, K), "pre-transposed"): tiles of output columns,
  register-blocked 4 columns x up to 4 rows, each B column read from DRAM
  once: the bandwidth-bound GEMV/skinny-GEMM of decoding;
* split-K (B stored (K, N), one batch): each thread streams whole rows of B
  into a private partial sum, then the partials are added in the epilogue;
* GEMM (BLAS): prologue kernel, torch's BLAS
  (``torch.matmul``) in the launcher, epilogue kernel.

The prologue materializes A when it is an expression (e.g. ``rms_norm(x) *
g``) or a fused RMSNorm scales it (per row, before the product, as torch
does); the epilogue applies the fused elementwise tail while the
accumulator is hot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from yirage.codegen.emit import Emitter
from yirage.codegen.exprs import compute_type
from yirage.codegen.indexing import broadcast_strides
from yirage.compiler.kernel_ir import Buffer, Load, Matmul, loads
from yirage.compiler.schedule import ScheduleError
from yirage.graph.kernel_graph import contiguous_strides
from yirage_backend_cpu.codegen import (
    PARALLEL_MIN_WORK,
    acc_src,
    at,
    const,
    decompose,
    expr_src,
    fma_src,
    kernel_def,
    offset,
    outer_loop,
    rms_scale_src,
    threads,
)
from yirage_backend_cpu.knobs import matmul_strategies


def matmul_args(k: Matmul) -> tuple[list[str], list[str], list[str]]:
    """(A-prologue buffers, epilogue buffers, every buffer after ``out`` in argument order)."""
    a_names = list(dict.fromkeys(loads(k.a) + (loads(k.row_scale) if k.row_scale is not None else [])))
    epi_names = list(dict.fromkeys(loads(k.epilogue)))
    return a_names, epi_names, list(dict.fromkeys(a_names + [k.b] + epi_names))


class MatmulRenderer:
    def __init__(self, k: Matmul, buffers: dict[str, Buffer], emit: Emitter, strategy: str) -> None:
        self.k, self.buffers, self.emit, self.strategy = k, buffers, emit, strategy
        self.ct = compute_type(buffers[k.out])
        self.nb = math.prod(k.batch)
        self.b_strides = broadcast_strides(buffers[k.b], k.batch + (k.k, k.n))
        self.sbk, self.sbn = self.b_strides[-2], self.b_strides[-1]
        self.a_names, self.epi_names, self.names = matmul_args(k)
        self.scale = k.row_scale is not None
        # a fused RMSNorm scales A's rows before the product, as torch does: scaling the accumulator
        # instead turns rms_norm(x) @ W into inf * 0 = NaN where x * w overflows (x = 1e30, w = -1e30)
        self.plain_a = None if self.scale else self._plain_a()
        self.parallel = self.nb * k.m * k.n * k.k >= PARALLEL_MIN_WORK
        self.bidx = [f"q{d}" for d in range(len(k.batch))]
        self.epi_step = {x: broadcast_strides(buffers[x], k.space) for x in self.epi_names}

    def _plain_a(self) -> str | None:
        k = self.k
        if isinstance(k.a, Load) and not k.a.rotate_half:
            b = self.buffers[k.a.buffer]
            if b.dims == k.a_space and b.strides == contiguous_strides(b.dims):
                return b.name
        return None

    # -- pieces ------------------------------------------------------------------
    def batch_bases(self, flat: str, with_b: bool = True) -> None:
        decompose(self.emit, flat, self.k.batch, self.bidx)
        if with_b:
            self.emit(f"bb = {offset(self.bidx, self.b_strides[:-2])}")
        for x in self.epi_names:
            self.emit(f"eb_{x} = {offset(self.bidx, self.epi_step[x][:-2])}")

    def store(self, acc: str, col: str = "nn", row: str = "mm") -> None:
        k = self.k

        def epi_load(ld: Load) -> str:
            sm, sn = self.epi_step[ld.buffer][-2:]
            return f"{ld.buffer}[{at(at(f'eb_{ld.buffer}', row, sm), col, sn)}]"

        self.emit(f"v_acc = {acc}")
        if self.scale:
            self.emit(f"v_scale = {const(1, self.ct)}  # A's rows are scaled already")
        self.emit(f"{k.out}[(bi * U({k.m}) + {row}) * U({k.n}) + {col}] = {expr_src(k.epilogue, epi_load, self.ct)}")

    def prologue(self, allocate: bool) -> None:
        """Materialize A (unless plain) and the RMS row scale (if fused)."""
        k, emit, ct = self.k, self.emit, self.ct
        if self.plain_a is not None and not self.scale:
            return
        a_strides = {x: broadcast_strides(self.buffers[x], k.a_space) for x in self.a_names}
        if allocate and self.plain_a is None:
            emit(f"a_mat = np.empty({self.nb * k.m * k.k}, np.{ct})")
        if allocate and self.scale:
            emit(f"v_sc = np.empty({self.nb * k.m}, np.{ct})")
        with outer_loop(emit, "row", self.nb * k.m, self.parallel and self.nb * k.m > 1):
            ridx = self.bidx + ["mm"]
            decompose(emit, "row", k.batch + (k.m,), ridx)
            for x in self.a_names:
                emit(f"ab_{x} = {offset(ridx, a_strides[x][:-1])}")

            def a_load(ld: Load) -> str:
                return f"{ld.buffer}[{at(f'ab_{ld.buffer}', 'kk', a_strides[ld.buffer][-1])}]"

            if self.scale:
                emit(f"ss = {const(0, ct)}")
            with emit.block(f"for kk in range(U({k.k})):"):
                if self.plain_a is None:
                    emit(f"a_mat[row * U({k.k}) + kk] = {expr_src(k.a, a_load, ct)}")
                if self.scale:
                    assert k.row_scale is not None
                    emit(f"x = {expr_src(k.row_scale, a_load, ct)}")
                    emit(f"ss = {fma_src('ss', 'x', 'x', ct)}")
            if self.scale:
                emit(f"v_sc[row] = {rms_scale_src('ss', k.k, k.eps, ct)}")
                with emit.block(f"for kk in range(U({k.k})):"):
                    emit(f"a_mat[row * U({k.k}) + kk] *= v_sc[row]")

    # -- strategies -------------------------------------------------------------------
    def render(self) -> list[str]:
        if self.strategy == "blas":
            return self.render_gemm()
        k, emit = self.k, self.emit
        args = [self.buffers[k.out]] + [self.buffers[x] for x in self.names]
        with kernel_def(emit, k.name, args, self.parallel):
            self.prologue(allocate=True)
            if self.strategy == "split_k":
                self.split_k()
            else:
                self.dot_tiles()
            emit("return 0")
        return [f"{k.name}({', '.join(b.name for b in args)})"]

    def split_k(self) -> None:
        k, emit, ct = self.k, self.emit, self.ct
        a_src = self.plain_a or "a_mat"
        mn = k.m * k.n
        parts = max(1, min(threads(), k.k // 64))
        emit(f"part = np.zeros({parts * mn}, np.{ct})")
        with outer_loop(emit, "p", parts, self.parallel and parts > 1):
            emit("bb = U(0)")
            emit(f"ka = p * U({k.k}) // U({parts})")
            emit(f"kz = (p + U(1)) * U({k.k}) // U({parts})")
            emit("k4 = ka + (kz - ka) // U(4) * U(4)")
            # four rows of B per pass: the partial sums are read and written a quarter as often
            with emit.block("for kk in range(ka, k4, U(4)):"):
                for r in range(4):
                    row = f"(kk + U({r}))" if r else "kk"
                    emit(f"r{r} = {k.b}[{at('bb', row, self.sbk)}:][:{k.n}]")
                with emit.block(f"for mm in range(U({k.m})):"):
                    for r in range(4):
                        emit(f"a{r} = {a_src}[mm * U({k.k}) + kk + U({r})]")
                    emit(f"dst = part[p * U({mn}) + mm * U({k.n}):][:{k.n}]")
                    with emit.block(f"for nn in range(U({k.n})):"):
                        fused = "dst[nn]"
                        for r in range(4):
                            fused = fma_src(fused, f"a{r}", f"r{r}[nn]", ct)
                        emit(f"dst[nn] = {fused}")
            with emit.block("for kk in range(k4, kz):"):
                emit(f"brow = {k.b}[{at('bb', 'kk', self.sbk)}:][:{k.n}]")
                with emit.block(f"for mm in range(U({k.m})):"):
                    emit(f"av = {a_src}[mm * U({k.k}) + kk]")
                    emit(f"dst = part[p * U({mn}) + mm * U({k.n}):][:{k.n}]")
                    with emit.block(f"for nn in range(U({k.n})):"):
                        emit(f"dst[nn] = {fma_src('dst[nn]', 'av', 'brow[nn]', ct)}")
        emit("bi = U(0)")
        self.batch_bases("bi", with_b=False)
        with outer_loop(emit, "cell", mn, self.parallel):
            emit(f"mm = cell // U({k.n})")
            emit(f"nn = cell - mm * U({k.n})")
            emit(f"acc = {const(0, ct)}")
            with emit.block(f"for p in range(U({parts})):"):
                emit(f"acc = {acc_src('acc', f'part[p * U({mn}) + cell]', ct)}")
            self.store("acc")

    def dot_tiles(self) -> None:
        k, emit, ct = self.k, self.emit, self.ct
        a_src = self.plain_a or "a_mat"
        cols = 4 if self.sbk == 1 and k.n >= 4 else 1
        rows = min(4, k.m) if cols == 4 else 1
        block = 16 if k.n >= 16 else k.n - k.n % cols
        tiles = -(-k.n // block)
        with outer_loop(emit, "t", self.nb * tiles, self.parallel):
            emit(f"bi = t // U({tiles})")
            emit(f"n0 = (t - bi * U({tiles})) * U({block})")
            emit(f"n1 = min(n0 + U({block}), U({k.n}))")
            self.batch_bases("bi")
            rest = "n0"
            if cols == 4:
                rest = "n1 - (n1 - n0) % U(4)"
                with emit.block(f"for nn in range(n0, {rest}, U(4)):"):
                    for c in range(4):
                        col = f"(nn + U({c}))" if c else "nn"
                        emit(f"c{c} = {k.b}[{at('bb', col, self.sbn)}:][:{k.k}]")
                    self._register_block(a_src, rows, ct)
            with emit.block(f"for nn in range({rest}, n1):"):
                emit(f"bcol = {at('bb', 'nn', self.sbn)}")
                with emit.block(f"for mm in range(U({k.m})):"):
                    emit(f"arow = (bi * U({k.m}) + mm) * U({k.k})")
                    emit(f"acc = {const(0, ct)}")
                    with emit.block(f"for kk in range(U({k.k})):"):
                        b_kk = f"{k.b}[{at('bcol', 'kk', self.sbk)}]"
                        emit(f"acc = {fma_src('acc', f'{a_src}[arow + kk]', b_kk, ct)}")
                    self.store("acc")

    def _register_block(self, a_src: str, rows: int, ct: str) -> None:
        """rows x 4 accumulators per pass over K: each B value loaded once feeds ``rows`` FMAs."""
        k, emit = self.k, self.emit
        full = k.m - k.m % rows
        blocks = [(rows, f"range(U(0), U({full}), U({rows}))")] if full else []
        if k.m % rows:
            blocks.append((1, f"range(U({full}), U({k.m}))"))
        for height, span in blocks:
            with emit.block(f"for m0 in {span}:"):
                for r in range(height):
                    emit(f"a{r} = {a_src}[(bi * U({k.m}) + m0 + U({r})) * U({k.k}):][:{k.k}]")
                    for c in range(4):
                        emit(f"s{r}{c} = {const(0, ct)}")
                with emit.block(f"for kk in range(U({k.k})):"):
                    for c in range(4):
                        emit(f"b{c} = c{c}[kk]")
                    for r in range(height):
                        emit(f"x{r} = a{r}[kk]")
                        for c in range(4):
                            emit(f"s{r}{c} = {fma_src(f's{r}{c}', f'x{r}', f'b{c}', ct)}")
                # the epilogue once, in a loop over the tile: inlined per accumulator, 16 copies of e.g. silu's
                # exp made LLVM take ~10 s per kernel
                emit(f"tile = ({', '.join(f's{r}{c}' for r in range(height) for c in range(4))},)")
                with emit.block(f"for e in range(U({height * 4})):"):
                    emit("mm = m0 + e // U(4)")
                    emit("nc = nn + e % U(4)")
                    self.store("tile[e]", "nc")

    def render_gemm(self) -> list[str]:
        """Prologue and epilogue kernels around torch's BLAS matmul in the launcher."""
        k, emit, ct = self.k, self.emit, self.ct
        a_args = [self.buffers[x] for x in self.a_names]
        launch: list[str] = []
        a_src = self.plain_a
        if self.plain_a is None or self.scale:
            lead = (["a_mat"] if self.plain_a is None else []) + (["v_sc"] if self.scale else [])
            sizes = {"a_mat": (self.nb * k.m * k.k,), "v_sc": (self.nb * k.m,)}
            scratch = [Buffer(name, sizes[name], self.buffers[k.out].dtype, (1,), "temp") for name in lead]
            with kernel_def(emit, f"{k.name}_pro", scratch + a_args, self.parallel):
                self.prologue(allocate=False)
                emit("return 0")
            emit("")
            emit("")
            if self.plain_a is None:
                launch.append(f"T_{k.name}_a = torch.empty({self.nb * k.m * k.k}, dtype=torch.{ct}, device='cpu')")
                launch.append(f"{k.name}_a = T_{k.name}_a.data_ptr()")
                a_src = f"{k.name}_a"
            if self.scale:
                launch.append(f"T_{k.name}_sc = torch.empty({self.nb * k.m}, dtype=torch.{ct}, device='cpu')")
                launch.append(f"{k.name}_sc = T_{k.name}_sc.data_ptr()")
            call = ([f"{k.name}_a"] if self.plain_a is None else []) + ([f"{k.name}_sc"] if self.scale else [])
            launch.append(f"{k.name}_pro({', '.join(call + [b.name for b in a_args])})")
        dims = k.batch + (k.m, k.k)
        b_dims = k.batch + (k.k, k.n)
        launch.append(
            f"T_{k.name}_c = torch.matmul(T_{a_src}.view({dims}), T_{k.b}.as_strided({b_dims}, {self.b_strides}))"
        )
        launch.append(f"{k.name}_c = T_{k.name}_c.data_ptr()")
        dtype = self.buffers[k.out].dtype
        epi_args = [self.buffers[k.out], Buffer("c", (self.nb * k.m * k.n,), dtype, (1,), "temp")]
        epi_args += ([Buffer("v_sc", (self.nb * k.m,), dtype, (1,), "temp")] if self.scale else [])
        epi_args += [self.buffers[x] for x in self.epi_names]
        with kernel_def(emit, f"{k.name}_epi", epi_args, self.parallel):
            with outer_loop(emit, "row", self.nb * k.m, self.parallel):
                emit(f"bi = row // U({k.m})")
                emit(f"mm = row - bi * U({k.m})")
                self.batch_bases("bi", with_b=False)
                with emit.block(f"for nn in range(U({k.n})):"):
                    self.store(f"c[row * U({k.n}) + nn]")
            emit("return 0")
        call = [k.out, f"{k.name}_c"] + ([f"{k.name}_sc"] if self.scale else []) + self.epi_names
        launch.append(f"{k.name}_epi({', '.join(call)})")
        return launch


def render_matmul(k: Matmul, buffers: dict[str, Buffer], emit: Emitter, knobs: Mapping[str, Any]) -> list[str]:
    """``knobs["strategy"]``, else the cost model's pick (knobs.matmul_strategies)."""
    strategies = matmul_strategies(k, buffers)
    strategy = knobs.get("strategy", strategies[0])
    if strategy not in strategies:
        raise ScheduleError(f"matmul {k.name}: strategy {strategy!r} is not one of {strategies}: the plan's "
                            "schedule and the cpu renderer disagree (a yirage bug: report it with g.to_json(); "
                            "YIRAGE_SUPEROPTIMIZE=0 meanwhile)")
    return MatmulRenderer(k, buffers, emit, strategy).render()
