"""Q4_0 matrices in 8-row groups: one int32 lane per row, so one x load serves eight rows.

quant_dot's one-row dot is bound by compute, not memory: every 32-value block
pays for unpacking, x's load, a scale conversion and a horizontal step for a
single row (1.6 ns per block and thread here). The CPU runtime therefore
repacks each Q4_0 matrix once, at load, into groups of 8 rows (llama.cpp's
CPU backend does the same, "q4_0_8x8"); block j of a group is 144 bytes:

    the 8 rows' half scales (16 bytes), then 4 chunks of 32 bytes; chunk t
    holds bytes 4t .. 4t+3 of each row's 16 quant bytes, row after row.

So a chunk's low nibbles are elements 4t .. 4t+3 of all 8 rows, its high
nibbles elements 16+4t .. 16+4t+3, and a vector multiply-add of a chunk with
those four x values broadcast leaves each row's partial sum in its own lane:
no shuffles, no horizontal sums, one scale conversion per 8 rows. Still one
sequential stream per task (two interleaved row streams measured half the
bandwidth). x is int16 (quant_dot.quantize_x16, error at most 2^-16 of a
block's largest |x|): exact integer products summed pairwise (vpmaddwd,
vpdpwssd where the host has VNNI), then one fma per block with the 8 rows'
scales times x's. Measured 0.8 ns per block and thread against 1.6 for the
one-row dot. Exact integers: the sums do not depend on the instruction.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from yirage_backend_cpu import quant_dot
from yirage_backend_cpu.quant_dot import F32, I8, I16, I32, I64, _ints, _pointer, _scale, _splat

GROUP = 8
Q4_GROUP_BYTES = 8 * 18  # one block of 8 rows
V8I32, V8F, V32I8 = ir.VectorType(I32, 8), ir.VectorType(F32, 8), ir.VectorType(I8, 32)
V16I32, V32I16, V32I32 = ir.VectorType(I32, 16), ir.VectorType(I16, 32), ir.VectorType(I32, 32)


def repack_q4_0(blocks: Any) -> Any:
    """(N, K/32 * 18) uint8 Q4_0 rows, N a multiple of 8, as (N/8, K/32, 144) groups: a new tensor."""
    import torch

    n, row = blocks.shape
    nb = row // 18
    b = blocks.reshape(n // GROUP, GROUP, nb, 18)
    groups = torch.empty((n // GROUP, nb, Q4_GROUP_BYTES), dtype=torch.uint8)
    groups[:, :, :16] = b[:, :, :, :2].permute(0, 2, 1, 3).reshape(n // GROUP, nb, 16)
    quants = b[:, :, :, 2:].reshape(n // GROUP, GROUP, nb, 4, 4)  # group, row, block, chunk t, byte
    groups[:, :, 16:] = quants.permute(0, 2, 3, 1, 4).reshape(n // GROUP, nb, 128)
    return groups.reshape(n, row)


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


def _madd(builder: ir.IRBuilder, w16: ir.Value, x16: ir.Value) -> ir.Value:
    """Pairwise sums of 32 int16 products into 16 int32 lanes: vpmaddwd (vpdpwssd with the add after it)."""
    prod = builder.mul(builder.sext(w16, V32I32), builder.sext(x16, V32I32))  # |w| <= 8, |x| <= 32767: exact
    even = builder.shuffle_vector(prod, prod, ir.Constant(V16I32, list(range(0, 32, 2))))
    odd = builder.shuffle_vector(prod, prod, ir.Constant(V16I32, list(range(1, 32, 2))))
    return builder.add(even, odd)


def _group_dot_x16(builder: ir.IRBuilder, xq: ir.Value, dx: ir.Value, group: ir.Value, blocks: ir.Value,
                   out: ir.Value) -> None:
    """out[0..8) = the 8 rows of ``group`` dotted with x (int16 ``xq`` times ``dx`` per block)."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F, [V8F, V8F, V8F]), "llvm.fmuladd.v8f32")
    entry = builder.block
    loop = builder.append_basic_block("q4g.loop")
    done = builder.append_basic_block("q4g.done")
    zero = ir.Constant(V8F, [0.0] * 8)
    builder.cbranch(builder.icmp_signed(">", blocks, ir.Constant(I64, 0)), loop, done)

    builder.position_at_end(loop)
    j = builder.phi(I64)
    acc = builder.phi(V8F)
    block = builder.gep(group, [builder.mul(j, ir.Constant(I64, Q4_GROUP_BYTES))])
    x4 = builder.bitcast(builder.gep(xq, [builder.mul(j, ir.Constant(I64, 32))]), I64.as_pointer())  # 4 int16 each
    sums = [ir.Constant(V16I32, [0] * 16), ir.Constant(V16I32, [0] * 16)]  # low and high nibbles: two chains
    fifteen, eight = ir.Constant(V32I8, [15] * 32), ir.Constant(V32I8, [8] * 32)
    for t in range(4):
        chunk = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(I64, 16 + 32 * t)]), V32I8.as_pointer()),
                             align=1)
        low = builder.sub(builder.and_(chunk, fifteen), eight)
        high = builder.sub(builder.and_(builder.lshr(chunk, ir.Constant(V32I8, [4] * 32)), fifteen), eight)
        for h, quants in enumerate((low, high)):
            xs = builder.load(builder.gep(x4, [ir.Constant(I64, 4 * h + t)]), align=2)  # x[16h + 4t .. + 4)
            x16 = builder.bitcast(_splat(builder, xs, 8), V32I16)
            sums[h] = builder.add(sums[h], _madd(builder, builder.sext(quants, V32I16), x16))
    total = builder.add(sums[0], sums[1])  # lanes 2r, 2r + 1: row r
    rows = builder.add(builder.shuffle_vector(total, total, ir.Constant(V8I32, list(range(0, 16, 2)))),
                       builder.shuffle_vector(total, total, ir.Constant(V8I32, list(range(1, 16, 2)))))
    scale = builder.fmul(_scales8(builder, block), _splat(builder, builder.load(builder.gep(dx, [j]), align=4), 8))
    new = builder.call(fma, [builder.sitofp(rows, V8F), scale, acc])
    nxt = builder.add(j, ir.Constant(I64, 1))
    tail = builder.block
    j.add_incoming(ir.Constant(I64, 0), entry)
    j.add_incoming(nxt, tail)
    acc.add_incoming(zero, entry)
    acc.add_incoming(new, tail)
    builder.cbranch(builder.icmp_signed("<", nxt, blocks), loop, done)

    builder.position_at_end(done)
    result = builder.phi(V8F)
    result.add_incoming(zero, entry)
    result.add_incoming(new, tail)
    builder.store(result, builder.bitcast(out, V8F.as_pointer()), align=4)


@intrinsic
def dot_q4_group_x16(typingctx, xq_addr, dx_addr, group_addr, blocks, out_addr):  # type: ignore[no-untyped-def]
    """Writes 8 float32 at ``out_addr``: the group's rows dotted with x as quant_dot.quantize_x16 wrote it."""
    if not _ints(xq_addr, dx_addr, group_addr, blocks, out_addr):
        return None

    def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
        k = signature.args
        _group_dot_x16(builder, _pointer(builder, context, values[0], k[0], I16),
                       _pointer(builder, context, values[1], k[1], F32),
                       _pointer(builder, context, values[2], k[2], I8),
                       context.cast(builder, values[3], k[3], types.int64),
                       _pointer(builder, context, values[4], k[4], F32))
        return context.get_dummy_value()

    return types.none(xq_addr, dx_addr, group_addr, blocks, out_addr), codegen
