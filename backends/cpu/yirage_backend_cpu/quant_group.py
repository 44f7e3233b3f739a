"""Q4_0 and Q8_0 matrices in 8-row groups: one int32 lane per row, so one x load serves eight rows.

quant_dot's one-row dots are bound by compute, not memory: every 32-value
block pays for unpacking, x's load, a scale conversion and a horizontal step
for a single row (1.6 ns per Q4_0 block and thread here, 1.75 for Q8_0). The
CPU runtime therefore repacks each such matrix once, at load, into groups of
8 rows (llama.cpp's CPU backend does the same, "q4_0_8x8"); block j of a
group is the 8 rows' half scales (16 bytes), then chunks of 32 bytes: chunk
t holds quant bytes 4t .. 4t+3 of each row, row after row (Q4_0: 4 chunks,
144 bytes; Q8_0: 8 chunks, 272 bytes).

So a Q4_0 chunk's low nibbles are elements 4t .. 4t+3 of all 8 rows and its
high nibbles elements 16+4t .. 16+4t+3 (Q8_0: its bytes, elements 4t ..), and
a byte dot product of a chunk with those four x values broadcast leaves each
row's partial sum in its own lane: no shuffles, no horizontal sums, one
scale conversion per 8 rows. Still one sequential stream per task (two
interleaved row streams measured half the bandwidth).

x is int16 (quant_dot's rounding: error at most 2^-16 of a block's largest
|x|), stored split in bytes: x = 256 hi + lo with lo unsigned and hi signed
(``quantize_x16_split``). Then each chunk is two vpdpbusd (unsigned by signed
bytes, AVX-512 VNNI): lo times the signed weight, and the weight made
unsigned (Q4_0: the nibble; Q8_0: q + 128) times hi, whose offset folds out
per block as 8 or 128 sum(hi). The integer sums are exact, so the result is
bit for bit the one of int16 products, at 0.55-0.65 against 0.85 (Q4_0) and
1.75 (Q8_0) ns per block and thread for a 576-column matrix in the L3; hosts
without VNNI get the same integers from portable LLVM vectors. One fma per
block then applies the 8 rows' scales times x's.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from yirage_backend_cpu import quant_dot
from yirage_backend_cpu.float_dot import prefetch_ahead
from yirage_backend_cpu.quant_dot import (
    F32,
    I8,
    I16,
    I32,
    I64,
    _host_has,
    _ints,
    _pointer,
    _scale,
    _splat,
    counted_loop,
)

GROUP = 8
Q4_GROUP_BYTES, Q8_GROUP_BYTES = 8 * 18, 8 * 34  # one block of 8 rows
V8I32, V8F, V32I8 = ir.VectorType(I32, 8), ir.VectorType(F32, 8), ir.VectorType(I8, 32)
V32I16, V32I32 = ir.VectorType(I16, 32), ir.VectorType(I32, 32)
VNNI = _host_has("avx512vnni", "avx512vl")


def repack(blocks: Any, quant_bytes: int) -> Any:
    """(N, K/32 * (2 + quant_bytes)) uint8 rows of Q4_0 (16 quant bytes) or Q8_0 (32), N a multiple of 8, as
    (N/8, K/32, 8 * (2 + quant_bytes)) groups: a new tensor, returned as (N, row bytes)."""
    import torch

    n, row = blocks.shape
    bb = 2 + quant_bytes
    nb, chunks = row // bb, quant_bytes // 4
    b = blocks.reshape(n // GROUP, GROUP, nb, bb)
    groups = torch.empty((n // GROUP, nb, GROUP * bb), dtype=torch.uint8)
    groups[:, :, :16] = b[:, :, :, :2].permute(0, 2, 1, 3).reshape(n // GROUP, nb, 16)
    quants = b[:, :, :, 2:].reshape(n // GROUP, GROUP, nb, chunks, 4)  # group, row, block, chunk t, byte
    groups[:, :, 16:] = quants.permute(0, 2, 3, 1, 4).reshape(n // GROUP, nb, GROUP * quant_bytes)
    return groups.reshape(n, row)


def repack_q4_0(blocks: Any) -> Any:
    return repack(blocks, 16)


def repack_q8_0(blocks: Any) -> Any:
    return repack(blocks, 32)


def _scales8(builder: ir.IRBuilder, block: ir.Value) -> ir.Value:
    """The group's 8 half scales as <8 x float>, exactly: one vcvtph2ps, or quant_dot's integer widening."""
    if quant_dot.F16C:  # read at compile time (a test compiles both widenings)
        v8h = ir.VectorType(I16, 8)
        bits = builder.load(builder.bitcast(block, v8h.as_pointer()), align=1)
        cvt = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F, [v8h]), "llvm.x86.vcvtph2ps.256")
        return builder.call(cvt, [bits])
    out = ir.Constant(V8F, ir.Undefined)
    for r in range(GROUP):
        scale = _scale(builder, builder.gep(block, [ir.Constant(I64, 2 * r)]))
        out = builder.insert_element(out, scale, ir.Constant(I32, r))
    return out


def _dpbusd(builder: ir.IRBuilder, acc: ir.Value, u: ir.Value, s: ir.Value) -> ir.Value:
    """acc (8 int32) + the sums of 4 products of unsigned ``u`` by signed ``s`` bytes per lane: vpdpbusd."""
    if VNNI:  # read at compile time (a test compiles both)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8I32, [V8I32, V8I32, V8I32]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [acc, builder.bitcast(u, V8I32), builder.bitcast(s, V8I32)])
    prod = builder.mul(builder.zext(u, V32I32), builder.sext(s, V32I32))
    parts = [builder.shuffle_vector(prod, prod, ir.Constant(V8I32, list(range(i, 32, 4)))) for i in range(4)]
    return builder.add(acc, builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3])))


def _store_split(xlo: ir.Value, xhi: ir.Value, sxhi: ir.Value) -> Any:
    """quant_dot._quantize_x16's store hook: block j's int16 values as low bytes, high bytes and sum(high)."""
    def store(builder: ir.IRBuilder, q: ir.Value, j: ir.Value) -> None:
        total = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [V32I32]),
                                               "llvm.vector.reduce.add.v32i32")
        at = builder.mul(j, ir.Constant(I64, 32))
        hi = builder.trunc(builder.ashr(q, ir.Constant(V32I16, [8] * 32)), V32I8)
        builder.store(builder.trunc(q, V32I8), builder.bitcast(builder.gep(xlo, [at]), V32I8.as_pointer()), align=1)
        builder.store(hi, builder.bitcast(builder.gep(xhi, [at]), V32I8.as_pointer()), align=1)
        builder.store(builder.call(total, [builder.sext(hi, V32I32)]), builder.gep(sxhi, [j]), align=4)
    return store


@intrinsic
def quantize_x16_split(typingctx, x_addr, blocks, xlo_addr, xhi_addr, sxhi_addr, dx_addr):  # type: ignore[no-untyped-def]
    """x (``blocks`` blocks of 32 float32) rounded as quant_dot.quantize_x16 does, stored as bytes: ``blocks`` *
    32 low bytes (unsigned) at xlo, as many high bytes (signed) at xhi, one int32 sum of the high bytes and one
    float32 scale per block at sxhi and dx. 1 if x was finite, else 0 (nothing usable written)."""
    if not _ints(x_addr, blocks, xlo_addr, xhi_addr, sxhi_addr, dx_addr):
        return None

    def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
        k = signature.args
        ptr = [_pointer(builder, context, values[i], k[i], to) for i, to in ((0, F32), (2, I8), (3, I8), (4, I32),
                                                                             (5, F32))]
        n = context.cast(builder, values[1], k[1], types.int64)
        return quant_dot._quantize_x16(builder, ptr[0], n, ptr[1], ptr[4], store=_store_split(*ptr[1:4]))

    return types.int64(x_addr, blocks, xlo_addr, xhi_addr, sxhi_addr, dx_addr), codegen


def _group_dot_split(builder: ir.IRBuilder, x: list[ir.Value], group: ir.Value, blocks: ir.Value,
                     out: ir.Value, q8: bool, limit: ir.Value, xrows: int = 1) -> None:
    """out[8 r .. 8 r + 8) = the 8 rows of ``group`` dotted with x row r (r < ``xrows``) as quantize_x16_split
    wrote it (xlo, xhi, sxhi, dx: row r's bytes 32 ``blocks`` r on, its block sums and scales 4 ``blocks`` r on).

    Q4_0 (``q8`` false): chunk t's nibbles n are elements 4t.. and 16+4t.. of the rows: lo by (n - 8), and n
    by hi, less 8 sum(hi). Q8_0: chunk t is elements 4t.. as int8 q: lo by q, and q + 128 (the byte with its
    top bit flipped) by hi, less 128 sum(hi). With several x rows (batch decode) each chunk is loaded and
    unpacked once for all of them; every row's integer and float operations are the one-row ones, in order."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F, [V8F, V8F, V8F]), "llvm.fmuladd.v8f32")
    stride = Q8_GROUP_BYTES if q8 else Q4_GROUP_BYTES
    row_bytes, row_words = builder.mul(blocks, ir.Constant(I64, 32)), builder.mul(blocks, ir.Constant(I64, 1))

    def rows_of(base: ir.Value, step: ir.Value) -> list[ir.Value]:
        return [builder.gep(base, [builder.mul(step, ir.Constant(I64, r))]) for r in range(xrows)]

    xlo, xhi = rows_of(x[0], row_bytes), rows_of(x[1], row_bytes)
    sxhi, dx = rows_of(x[2], row_words), rows_of(x[3], row_words)

    def block_dot(builder: ir.IRBuilder, j: ir.Value, acc: list[ir.Value]) -> list[ir.Value]:
        block = builder.gep(group, [builder.mul(j, ir.Constant(I64, stride))])
        prefetch_ahead(builder, builder.ptrtoint(block, I64), stride, limit)
        at = builder.mul(j, ir.Constant(I64, 32))
        lo4 = [builder.bitcast(builder.gep(p, [at]), I32.as_pointer()) for p in xlo]  # 4 bytes of x each
        hi4 = [builder.bitcast(builder.gep(p, [at]), I32.as_pointer()) for p in xhi]
        none = ir.Constant(V8I32, [0] * 8)
        lows, highs = [[none, none] for _ in range(xrows)], [[none, none] for _ in range(xrows)]  # 4 chains a row
        fifteen, eight = ir.Constant(V32I8, [15] * 32), ir.Constant(V32I8, [8] * 32)
        for t in range(8 if q8 else 4):
            chunk = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(I64, 16 + 32 * t)]),
                                                 V32I8.as_pointer()), align=1)
            if q8:  # (signed, unsigned) views of elements 4t .. 4t + 3 of the 8 rows
                parts = [(t, chunk, builder.xor(chunk, ir.Constant(V32I8, [-128] * 32)))]
            else:
                nibbles = (builder.and_(chunk, fifteen),
                           builder.and_(builder.lshr(chunk, ir.Constant(V32I8, [4] * 32)), fifteen))
                parts = [(4 * h + t, builder.sub(nib, eight), nib) for h, nib in enumerate(nibbles)]
            for at4, signed, unsigned in parts:  # x[4 at4 .. + 4) broadcast to the 8 rows' lanes
                chain = at4 % 2
                for r in range(xrows):
                    lo = builder.bitcast(_splat(builder, builder.load(builder.gep(lo4[r], [ir.Constant(I64, at4)]),
                                                                      align=1), 8), V32I8)
                    hi = builder.bitcast(_splat(builder, builder.load(builder.gep(hi4[r], [ir.Constant(I64, at4)]),
                                                                      align=1), 8), V32I8)
                    lows[r][chain] = _dpbusd(builder, lows[r][chain], lo, signed)
                    highs[r][chain] = _dpbusd(builder, highs[r][chain], unsigned, hi)
        scales = _scales8(builder, block)
        out = []
        for r in range(xrows):
            offset = builder.shl(builder.load(builder.gep(sxhi[r], [j]), align=4), ir.Constant(I32, 7 if q8 else 3))
            high = builder.sub(builder.add(highs[r][0], highs[r][1]), _splat(builder, offset, 8))
            rows = builder.add(builder.add(lows[r][0], lows[r][1]), builder.shl(high, ir.Constant(V8I32, [8] * 8)))
            scale = builder.fmul(scales, _splat(builder, builder.load(builder.gep(dx[r], [j]), align=4), 8))
            out.append(builder.call(fma, [builder.sitofp(rows, V8F), scale, acc[r]]))
        return out

    results = counted_loop(builder, blocks, [ir.Constant(V8F, [0.0] * 8)] * xrows, block_dot, "q4g")
    for r, result in enumerate(results):
        builder.store(result, builder.bitcast(builder.gep(out, [ir.Constant(I64, 8 * r)]), V8F.as_pointer()),
                      align=4)


def _group_intrinsic(q8: bool, xrows: int = 1):  # type: ignore[no-untyped-def]
    def dot(typingctx, xlo_addr, xhi_addr, sxhi_addr, dx_addr, group_addr, blocks, out_addr, limit):  # type: ignore[no-untyped-def]
        if not _ints(xlo_addr, xhi_addr, sxhi_addr, dx_addr, group_addr, blocks, out_addr, limit):
            return None

        def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
            k = signature.args
            x = [_pointer(builder, context, values[i], k[i], to) for i, to in ((0, I8), (1, I8), (2, I32), (3, F32))]
            _group_dot_split(builder, x, _pointer(builder, context, values[4], k[4], I8),
                             context.cast(builder, values[5], k[5], types.int64),
                             _pointer(builder, context, values[6], k[6], F32), q8,
                             context.cast(builder, values[7], k[7], types.int64), xrows)
            return context.get_dummy_value()

        return types.none(xlo_addr, xhi_addr, sxhi_addr, dx_addr, group_addr, blocks, out_addr, limit), codegen
    return intrinsic(dot)


#: dot_q4_group(xlo, xhi, sxhi, dx, group, blocks, out, limit): writes 8 float32 at ``out``, the rows of a Q4_0
#: group (repack_q4_0) dotted with x as quantize_x16_split wrote it; dot_q8_group the same for Q8_0 (repack_q8_0).
#: Each block read asks for the one float_dot.AHEAD bytes on, below the address ``limit`` (0: none)
dot_q4_group = _group_intrinsic(q8=False)
dot_q8_group = _group_intrinsic(q8=True)
#: dot_q4_group4 / dot_q8_group4: the same for GROUP_X rows of x at once (row r's split bytes 32 ``blocks`` r
#: on, its sums and scales 4 ``blocks`` r on), 8 GROUP_X float32 at ``out``, each row's bit for bit
#: dot_q4_group's / dot_q8_group's: batch decode unpacks each chunk once for the four
GROUP_X = 4
dot_q4_group4 = _group_intrinsic(q8=False, xrows=GROUP_X)
dot_q8_group4 = _group_intrinsic(q8=True, xrows=GROUP_X)
