"""The dot product of float32 x with a float32, bf16 or f16 weight row, as LLVM vector IR reached from numba;
and the weight prefetch every GEMV body of the CPU runtime uses.

A decode step streams every weight once from DRAM, a task's rows as one
sequential stream. The loop vectorizer's dot (pk_tasks before) left the
memory system idle between bursts: the hardware prefetcher does not run far
enough ahead of a core that also widens and multiplies, least for bf16 and
f16 rows, which hold twice the values per line; asking for a whole row
ahead at its start (48 prefetches at once for a bf16 row of K = 1536)
stalls on the core's few line-fill buffers instead. Written by hand, every
64-byte line read comes with one prefetch of the line ``AHEAD`` bytes on,
spread evenly through the loop; 32 values per iteration, widened in
registers (bf16: a 16-bit shift of the zero-extended bits; f16: LLVM's
fpext, F16C's vcvtph2ps), one fused multiply-add into a 32-lane
accumulator (four or two independent register chains), one horizontal sum
per row in a fixed order. No fast-math flags: products and sums round as
IEEE says, in this order.

Measured (a 49152 x 576 and an 18432 x 1536 matrix, 2 threads each taking
half the rows, medians of 10 interleaved calls; Intel Xeon Cascade Lake, 2
cores, ~22 GB/s by a torch sum): vectorized loop vs this, GB/s, K = 576 /
1536: f32 15.8-16.9 / 16.5-17.3 vs 20.2-20.7 / 18.9-21.3; bf16 14.8-16.3 /
14.4-14.8 vs 19.5-20.5 / 18.9-19.7; f16 14.4-16.5 / 14.8-16.5 vs 19.6-20.6
/ 18.9-20.0. Prefetching 512 bytes ahead was slower than 2-4 KB; into L2
only (locality 2) no better; non-temporal (locality 0) 13 GB/s.

quant_group's 8-row block loop asks the same way (``prefetch_ahead``): Q4_0
groups 19.5-19.9 against 12.0-14.6 GB/s in two of three interleaved runs
(the third 11.8 against 13.2), Q8_0 groups 18.2-21.9 against 16.9-17.4; the
W6 decode 1.2x faster in Q4_0, 1.1x in Q8_0. A whole group's lines asked
for at once at its start measured 9% slower than none. x86 prefetches never
fault; every request is clipped to the task's own rows anyway.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from yirage_backend_cpu.quant_dot import F32, I8, I16, I32, I64, _hsum, _ints, _pointer, counted_loop

CHUNK = 32  # values per iteration: one 64-byte line of 16-bit weights, two of float32
AHEAD = 4096  # bytes between a line read and the line prefetched (measurements above: 2-4 KB best)
LINE = 64  # bytes per cache line on every x86-64 and most arm64 cores
V32F, V32I16, V32I32 = ir.VectorType(F32, CHUNK), ir.VectorType(I16, CHUNK), ir.VectorType(I32, CHUNK)


BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def _load(builder: ir.IRBuilder, w: ir.Value, offset: ir.Value, kind: str) -> ir.Value:
    """32 weights from ``offset`` (in values) as <32 x float>."""
    if kind == "f32":
        return builder.load(builder.bitcast(builder.gep(w, [offset]), V32F.as_pointer()), align=4)
    bits = builder.load(builder.bitcast(builder.gep(w, [offset]), V32I16.as_pointer()), align=2)
    if kind == "bf16":  # bf16 is the top half of a float32
        wide = builder.shl(builder.zext(bits, V32I32), ir.Constant(V32I32, [16] * CHUNK))
        return builder.bitcast(wide, V32F)
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), CHUNK)), V32F)


def prefetch_ahead(builder: ir.IRBuilder, here: ir.Value, size: int, limit: ir.Value) -> None:
    """Ask for the lines of [here + AHEAD, here + AHEAD + size) (``here``: an int64 address), none at or past
    ``limit`` (0: ask for nothing). One request per 64 bytes: with ``size`` bytes read per iteration, every
    line of the stream is asked for once or twice."""
    i8p = I8.as_pointer()
    prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.VoidType(), [i8p, I32, I32, I32]), "llvm.prefetch.p0i8")
    read, keep, data = (ir.Constant(I32, v) for v in (0, 3, 1))
    with builder.if_then(builder.icmp_signed(">", limit, ir.Constant(I64, 0))):
        last = builder.sub(limit, ir.Constant(I64, 1))  # clipped: the task's own rows only
        for line in range(0, size, LINE):
            ahead = builder.add(here, ir.Constant(I64, AHEAD + line))
            target = builder.select(builder.icmp_signed("<", ahead, last), ahead, last)
            builder.call(prefetch, [builder.inttoptr(target, i8p), read, keep, data])


def _dot(builder: ir.IRBuilder, x: ir.Value, w: ir.Value, chunks: ir.Value, limit: ir.Value, kind: str
         ) -> ir.Value:
    """sum_i x[i] * w[i] over ``chunks`` * 32 values; ``limit``: an address past which nothing is prefetched
    (0: no prefetch)."""
    size = BYTES[kind]
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32F, [V32F, V32F, V32F]),
                                         "llvm.fmuladd.v32f32")
    w_base = builder.ptrtoint(w, I64)

    def body(builder: ir.IRBuilder, j: ir.Value, acc: list[ir.Value]) -> list[ir.Value]:
        offset = builder.mul(j, ir.Constant(I64, CHUNK))
        prefetch_ahead(builder, builder.add(w_base, builder.mul(offset, ir.Constant(I64, size))), CHUNK * size,
                       limit)
        xs = builder.load(builder.bitcast(builder.gep(x, [offset]), V32F.as_pointer()), align=4)
        return [builder.call(fma, [xs, _load(builder, w, offset, kind), acc[0]])]

    (total,) = counted_loop(builder, chunks, [ir.Constant(V32F, [0.0] * CHUNK)], body, "fdot")
    return _hsum(builder, total)


def _dots(builder: ir.IRBuilder, x: ir.Value, x_stride: ir.Value, w: ir.Value, w_stride: ir.Value, chunks: ir.Value,
          limit: ir.Value, kind: str, wrows: int, xrows: int) -> list[ir.Value]:
    """``_dot`` of ``wrows`` weight rows (``w_stride`` bytes apart) with ``xrows`` rows of x (``x_stride`` bytes
    apart), every pair at once, results weight row by weight row: each weight chunk is loaded and widened
    once for all x rows and each x chunk once for all weight rows, and the pairs' accumulators are
    independent chains (2 x 4 pairs: 16 of the 32 vector registers). Each pair's products and sums are
    ``_dot``'s, in ``_dot``'s order: the same bits as one call of it per pair."""
    size = BYTES[kind]
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32F, [V32F, V32F, V32F]),
                                         "llvm.fmuladd.v32f32")
    w_base, x_base = builder.ptrtoint(w, I64), builder.ptrtoint(x, I64)

    def rows(base: ir.Value, stride: ir.Value, count: int, to: ir.Type) -> list[ir.Value]:
        return [builder.inttoptr(builder.add(base, builder.mul(stride, ir.Constant(I64, r))), to.as_pointer())
                for r in range(count)]

    xs, ws = rows(x_base, x_stride, xrows, F32), rows(w_base, w_stride, wrows, w.type.pointee)

    def body(builder: ir.IRBuilder, j: ir.Value, acc: list[ir.Value]) -> list[ir.Value]:
        offset = builder.mul(j, ir.Constant(I64, CHUNK))
        step = builder.mul(offset, ir.Constant(I64, size))
        for r in range(wrows):  # the lines AHEAD on in each weight row's stream
            prefetch_ahead(builder, builder.add(w_base, builder.add(step, builder.mul(w_stride, ir.Constant(
                I64, r)))), CHUNK * size, limit)
        xv = [builder.load(builder.bitcast(builder.gep(xr, [offset]), V32F.as_pointer()), align=4) for xr in xs]
        out = []
        for r, wr in enumerate(ws):
            weights = _load(builder, wr, offset, kind)
            out += [builder.call(fma, [xv[b], weights, acc[r * xrows + b]]) for b in range(xrows)]
        return out

    totals = counted_loop(builder, chunks, [ir.Constant(V32F, [0.0] * CHUNK)] * (wrows * xrows), body, "fdots")
    return [_hsum(builder, t) for t in totals]


def _tile(kind: str, wrows: int, xrows: int):  # type: ignore[no-untyped-def]
    def typer(typingctx, x_addr, x_stride, w_addr, w_stride, chunks, limit):  # type: ignore[no-untyped-def]
        if not _ints(x_addr, x_stride, w_addr, w_stride, chunks, limit):
            return None
        result = types.UniTuple(types.float32, wrows * xrows)

        def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
            kinds = signature.args
            x = _pointer(builder, context, values[0], kinds[0], F32)
            xs = context.cast(builder, values[1], kinds[1], types.int64)
            w = _pointer(builder, context, values[2], kinds[2], F32 if kind == "f32" else I16)
            ws = context.cast(builder, values[3], kinds[3], types.int64)
            n = context.cast(builder, values[4], kinds[4], types.int64)
            end = context.cast(builder, values[5], kinds[5], types.int64)
            return context.make_tuple(builder, result, _dots(builder, x, xs, w, ws, n, end, kind, wrows, xrows))

        return result(x_addr, x_stride, w_addr, w_stride, chunks, limit), codegen
    return intrinsic(typer)


def _row(kind: str):  # type: ignore[no-untyped-def]
    def typer(typingctx, x_addr, w_addr, chunks, limit):  # type: ignore[no-untyped-def]
        if not _ints(x_addr, w_addr, chunks, limit):
            return None

        def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
            kinds = signature.args
            x = _pointer(builder, context, values[0], kinds[0], F32)
            w = _pointer(builder, context, values[1], kinds[1], F32 if kind == "f32" else I16)
            n = context.cast(builder, values[2], kinds[2], types.int64)
            end = context.cast(builder, values[3], kinds[3], types.int64)
            return _dot(builder, x, w, n, end, kind)

        return types.float32(x_addr, w_addr, chunks, limit), codegen
    return intrinsic(typer)


#: dot_f32_row(x_addr, w_addr, chunks, limit), dot_bf16_row, dot_f16_row: sum over ``chunks`` * 32 values of
#: x[i] * w[i], x float32, w float32 / bf16 / f16; each line read prefetches the one AHEAD bytes on, up to
#: ``limit`` (an address; 0: none)
dot_f32_row = _row("f32")
dot_bf16_row = _row("bf16")
dot_f16_row = _row("f16")

#: batch decode's GEMV tiles: dot_{kind}_tile(x_addr, x_stride, w_addr, w_stride, chunks, limit) -> the
#: TILE_W x TILE_X float32 dots of TILE_W weight rows with TILE_X rows of x (weight row major), each bit for
#: bit dot_{kind}_row's of its pair; dot_{kind}_quad: one weight row with TILE_X rows of x (the odd row left)
TILE_W, TILE_X = 2, 4
dot_f32_tile, dot_bf16_tile, dot_f16_tile = (_tile(kind, TILE_W, TILE_X) for kind in ("f32", "bf16", "f16"))
dot_f32_quad, dot_bf16_quad, dot_f16_quad = (_tile(kind, 1, TILE_X) for kind in ("f32", "bf16", "f16"))
