"""Dot products of x with Q8_0 / Q4_0 rows, as LLVM vector IR reached from numba (pk_quant's GEMV).

Written as explicit vectors because the loop vectorizer mishandles the
block structure: it fully unrolls the 32-value inner loop and then
vectorizes across blocks with gathers (measured 2 GB/s against 22 GB/s for
float32 rows). The main path quantizes x once per task to int16 with a
float32 scale per block (``quantize_x16``: error at most 2^-16 of the
block's largest |x|); each block of each row is then 32 exact integer
products summed in pairs (vpmaddwd on x86), converted once and scaled by
dx * d into a vector accumulator; one horizontal sum per row, two rows at a
time sharing x's loads. x with inf or NaN takes the float32 path
(``dot_q8``/``dot_q4``), so such results stay torch's. A block's half
scale is widened in integer registers (_scale). The vectors are portable
LLVM types (one zmm register each on an AVX-512 host; LLVM splits them
elsewhere). No fast-math flags: every operation rounds as written.
int8 x through VNNI (vpdpbusd on 256-bit vectors, llama.cpp's way) measured
1.9x faster for Q4_0 in a probe, but put test-model logits 1.5% of their range
off the dequantized-float reference (int16: < 0.1%): not used yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

LANES = 16
MAGIC, MAGIC_BITS = 12582912.0, 0x4B400000  # 1.5 * 2^23 and its bits: adding it rounds |v| < 2^22 to an integer
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
VF, VB = ir.VectorType(F32, LANES), ir.VectorType(I8, LANES)
VI32, VI16W, VI32W = ir.VectorType(I32, LANES), ir.VectorType(I16, 2 * LANES), ir.VectorType(I32, 2 * LANES)
VI16, VI32W_IDX = ir.VectorType(I16, LANES), ir.VectorType(I32, 2 * LANES)  # 16 halves; a 32-lane shuffle mask
Emit = Callable[[ir.IRBuilder, list[ir.Value], ir.Value, list[list[ir.Value]]], list[list[ir.Value]]]


def _splat(builder: ir.IRBuilder, value: ir.Value, lanes: int = LANES) -> ir.Value:
    kind = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(kind, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(kind, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes),
                                                                                      [0] * lanes))


def _hsum(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Pairwise halves: 16 -> 8 -> 4 -> 2 -> 1 lanes (a fixed order, so results repeat)."""
    width = v.type.count
    while width > 1:
        half = width // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, half), list(range(half, width))))
        v = builder.fadd(lo, hi)
        width = half
    return builder.extract_element(v, ir.Constant(I32, 0))


def _quants(builder: ir.IRBuilder, block: ir.Value, q4: bool) -> tuple[ir.Value, ir.Value]:
    """A block's 32 quants as two <16 x i8> halves (elements 0..15, 16..31), Q4_0's already minus 8."""
    quants = builder.gep(block, [ir.Constant(I64, 2)])
    if q4:
        packed = builder.load(builder.bitcast(quants, VB.as_pointer()), align=1)
        eight = ir.Constant(VB, [8] * LANES)
        return (builder.sub(builder.and_(packed, ir.Constant(VB, [15] * LANES)), eight),
                builder.sub(builder.lshr(packed, ir.Constant(VB, [4] * LANES)), eight))
    return (builder.load(builder.bitcast(quants, VB.as_pointer()), align=1),
            builder.load(builder.bitcast(builder.gep(quants, [ir.Constant(I64, LANES)]), VB.as_pointer()), align=1))


def _scale(builder: ir.IRBuilder, block: ir.Value) -> ir.Value:
    """The block's half scale as float32, exactly (subnormals, inf, NaN): F16C's vcvtph2ps where the host
    has it, else in integer registers.

    Not LLVM's fpext of a scalar half: x86 lowers it to an insert into some live vector register, which
    chained each block to the previous block's accumulator (measured 2-3x slower). Not ggml's 65536-entry
    table either: streaming weights from DRAM evict it, and a cache miss per block measured 2.4x slower.
    Normal halves rebias the exponent; a subnormal one (mantissa m, value m * 2^-24) is normalised with a
    leading-zero count; exponent 31 keeps its payload (inf, NaN).
    """
    bits = builder.load(builder.bitcast(block, I16.as_pointer()), align=1)
    if F16C:  # one vcvtph2ps of a vector whose other lanes are zero: no merge into a live register
        v8 = ir.VectorType(I16, 8)
        cvt = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VectorType(F32, 4), [v8]),
                                             "llvm.x86.vcvtph2ps.128")
        lanes = builder.insert_element(ir.Constant(v8, [0] * 8), bits, ir.Constant(I32, 0))
        return builder.extract_element(builder.call(cvt, [lanes]), ir.Constant(I32, 0))
    h = builder.zext(bits, I32)
    magnitude = builder.and_(h, ir.Constant(I32, 0x7FFF))
    shifted = builder.shl(magnitude, ir.Constant(I32, 13))
    normal = builder.add(shifted, ir.Constant(I32, (127 - 15) << 23))
    special = builder.or_(shifted, ir.Constant(I32, 0x7F800000))
    mantissa = builder.and_(h, ir.Constant(I32, 0x3FF))
    ctlz = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [I32, ir.IntType(1)]), "llvm.ctlz.i32")
    top = builder.sub(ir.Constant(I32, 31), builder.call(ctlz, [builder.or_(mantissa, ir.Constant(I32, 1)),
                                                                ir.Constant(ir.IntType(1), 0)]))  # 0..9
    subnormal = builder.or_(builder.shl(builder.add(top, ir.Constant(I32, 127 - 24)), ir.Constant(I32, 23)),
                            builder.and_(builder.shl(mantissa, builder.sub(ir.Constant(I32, 23), top)),
                                         ir.Constant(I32, 0x7FFFFF)))
    value = builder.select(builder.icmp_unsigned(">=", magnitude, ir.Constant(I32, 0x7C00)), special, normal)
    value = builder.select(builder.icmp_unsigned("<", magnitude, ir.Constant(I32, 0x400)), subnormal, value)
    value = builder.select(builder.icmp_unsigned("==", magnitude, ir.Constant(I32, 0)), magnitude, value)
    sign = builder.shl(builder.and_(h, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16))
    return builder.bitcast(builder.or_(value, sign), F32)


def _float_block(x_ptr: ir.Value, q4: bool) -> Emit:
    """x as float32: fma(x * d, q, acc) per 16 lanes, into two accumulators per row."""
    def emit(builder: ir.IRBuilder, blocks: list[ir.Value], j: ir.Value, accs: list[list[ir.Value]]
             ) -> list[list[ir.Value]]:
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VF, [VF, VF, VF]),
                                             "llvm.fmuladd.v16f32")
        xb = builder.gep(x_ptr, [builder.mul(j, ir.Constant(I64, 2 * LANES))])
        x0 = builder.load(builder.bitcast(xb, VF.as_pointer()), align=4)
        x1 = builder.load(builder.bitcast(builder.gep(xb, [ir.Constant(I64, LANES)]), VF.as_pointer()), align=4)
        out = []
        for block, (a0, a1) in zip(blocks, accs, strict=True):
            lo, hi = _quants(builder, block, q4)
            scale = _splat(builder, _scale(builder, block))
            out.append([builder.call(fma, [builder.fmul(x0, scale), builder.sitofp(lo, VF), a0]),
                        builder.call(fma, [builder.fmul(x1, scale), builder.sitofp(hi, VF), a1])])
        return out
    return emit


def _int16_block(xq_ptr: ir.Value, dx_ptr: ir.Value, q4: bool) -> Emit:
    """x as int16 with a float scale per block: 32 exact integer products summed pairwise into 16 int32
    lanes (the multiply-add of sign-extended halves, which x86 selects as one vpmaddwd), then
    fma(float(sums), dx * d, acc) into one accumulator per row. x's block is loaded once for all rows."""
    def emit(builder: ir.IRBuilder, blocks: list[ir.Value], j: ir.Value, accs: list[list[ir.Value]]
             ) -> list[list[ir.Value]]:
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VF, [VF, VF, VF]),
                                             "llvm.fmuladd.v16f32")
        xb = builder.gep(xq_ptr, [builder.mul(j, ir.Constant(I64, 2 * LANES))])
        x = builder.sext(builder.load(builder.bitcast(xb, VI16W.as_pointer()), align=2), VI32W)
        dx = builder.load(builder.gep(dx_ptr, [j]), align=4)
        out = []
        for block, (acc,) in zip(blocks, accs, strict=True):
            if q4:  # nibbles widened to 16 bits first: x86 shifts 16-bit lanes natively, not bytes
                packed = builder.zext(builder.load(builder.bitcast(builder.gep(block, [ir.Constant(I64, 2)]),
                                                                   VB.as_pointer()), align=1), VI16)
                lo = builder.and_(packed, ir.Constant(VI16, [15] * LANES))
                hi = builder.lshr(packed, ir.Constant(VI16, [4] * LANES))
                both = builder.sub(builder.shuffle_vector(lo, hi, ir.Constant(VI32W_IDX, list(range(2 * LANES)))),
                                   ir.Constant(VI16W, [8] * 2 * LANES))
            else:
                lo, hi = _quants(builder, block, q4)
                both = builder.shuffle_vector(lo, hi, ir.Constant(VI32W_IDX, list(range(2 * LANES))))
            prod = builder.mul(builder.sext(both, VI32W), x)  # |q| <= 128, |x| <= 32767: exact; pairs fit int32
            even = builder.shuffle_vector(prod, prod, ir.Constant(VI32, list(range(0, 2 * LANES, 2))))
            odd = builder.shuffle_vector(prod, prod, ir.Constant(VI32, list(range(1, 2 * LANES, 2))))
            sums = builder.sitofp(builder.add(even, odd), VF)
            scale = _splat(builder, builder.fmul(dx, _scale(builder, block)))
            out.append([builder.call(fma, [sums, scale, acc])])
        return out
    return emit


def counted_loop(builder: ir.IRBuilder, count: ir.Value, inits: list[ir.Value], body: Callable[
        [ir.IRBuilder, ir.Value, list[ir.Value]], list[ir.Value]], name: str) -> list[ir.Value]:
    """``for j in range(count): values = body(builder, j, values)`` from ``inits``, as one LLVM loop whose
    values are phis (no memory round trips); returns the final values (``inits`` when count <= 0)."""
    entry = builder.block
    loop = builder.append_basic_block(f"{name}.loop")
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", count, ir.Constant(I64, 0)), loop, done)

    builder.position_at_end(loop)
    j = builder.phi(I64)
    phis = [builder.phi(value.type) for value in inits]
    new = body(builder, j, phis)
    nxt = builder.add(j, ir.Constant(I64, 1))
    tail = builder.block
    j.add_incoming(ir.Constant(I64, 0), entry)
    j.add_incoming(nxt, tail)
    for phi, init, value in zip(phis, inits, new, strict=True):
        phi.add_incoming(init, entry)
        phi.add_incoming(value, tail)
    builder.cbranch(builder.icmp_signed("<", nxt, count), loop, done)

    builder.position_at_end(done)
    finals = []
    for init, value in zip(inits, new, strict=True):  # every phi first: LLVM wants them at the top of the block
        phi = builder.phi(init.type)
        phi.add_incoming(init, entry)
        phi.add_incoming(value, tail)
        finals.append(phi)
    return finals


def _rows_dot(builder: ir.IRBuilder, emit: Emit, rows: list[ir.Value], blocks: ir.Value, stride: int, width: int,
              acc_type: ir.VectorType = VF) -> list[ir.Value]:
    """One block (``stride`` bytes) per iteration for each of ``rows`` (addresses of their first block), each
    row into its own ``width`` accumulators; then one horizontal sum per row. pk_quant passes one row: two
    interleaved rows shared x's loads but measured half the DRAM bandwidth (two streams 612 bytes apart)."""
    w_ptrs = [builder.inttoptr(row, I8.as_pointer()) for row in rows]
    block_bytes = ir.Constant(I64, stride)
    zero = ir.Constant(acc_type, [0.0] * acc_type.count)

    def body(builder: ir.IRBuilder, j: ir.Value, flat: list[ir.Value]) -> list[ir.Value]:
        accs = [flat[r * width:(r + 1) * width] for r in range(len(rows))]
        offset = builder.mul(j, block_bytes)
        new = emit(builder, [builder.gep(w, [offset]) for w in w_ptrs], j, accs)
        return [value for row in new for value in row]

    finals = counted_loop(builder, blocks, [zero] * (len(rows) * width), body, "qdot")
    sums = []
    for r in range(len(rows)):
        row = finals[r * width:(r + 1) * width]
        total = row[0]
        for value in row[1:]:
            total = builder.fadd(total, value)
        sums.append(_hsum(builder, total))
    return sums


def _quantize_x16(builder: ir.IRBuilder, x_ptr: ir.Value, blocks: ir.Value, xq_ptr: ir.Value,
                  dx_ptr: ir.Value, store: Callable[[ir.IRBuilder, ir.Value, ir.Value], None] | None = None
                  ) -> ir.Value:
    """x (``blocks`` blocks of 32 float32) as int16 times one float32 scale per block; 0 if x holds inf or NaN.

    Per block: the largest |x| as the largest bit pattern of |x| (the same order for non-negative floats,
    and inf/NaN patterns are the largest), dx = largest / 32767, q = round(x * 32767 / largest) to
    nearest even by adding 1.5 * 2^23 (exact: |x * inv| <= 32767 < 2^22). 32 lanes at a time: as plain
    numba loops, LLVM unrolled the 32-value block and vectorized across blocks with gathers. ``store(builder,
    q, j)`` writes block j's <32 x i16> elsewhere instead of to ``xq_ptr``.
    """
    v32f, v32i = ir.VectorType(F32, 2 * LANES), ir.VectorType(I32, 2 * LANES)
    umax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [v32i]),
                                          "llvm.vector.reduce.umax.v32i32")
    entry = builder.block
    loop = builder.append_basic_block("xq.loop")
    body = builder.append_basic_block("xq.body")
    done = builder.append_basic_block("xq.done")
    builder.cbranch(builder.icmp_signed(">", blocks, ir.Constant(I64, 0)), loop, done)

    builder.position_at_end(loop)
    j = builder.phi(I64)
    x = builder.load(builder.bitcast(builder.gep(x_ptr, [builder.mul(j, ir.Constant(I64, 2 * LANES))]),
                                     v32f.as_pointer()), align=4)
    top = builder.call(umax, [builder.and_(builder.bitcast(x, v32i), ir.Constant(v32i, [0x7FFFFFFF] * 2 * LANES))])
    builder.cbranch(builder.icmp_unsigned(">=", top, ir.Constant(I32, 0x7F800000)), done, body)

    builder.position_at_end(body)
    amax = builder.bitcast(top, F32)
    levels = ir.Constant(F32, 32767.0)
    positive = builder.fcmp_ordered(">", amax, ir.Constant(F32, 0.0))
    inv = builder.select(positive, builder.fdiv(levels, amax), ir.Constant(F32, 0.0))
    builder.store(builder.fdiv(amax, levels), builder.gep(dx_ptr, [j]), align=4)
    scaled = builder.fadd(builder.fmul(x, _splat(builder, inv, 2 * LANES)),
                          ir.Constant(v32f, [MAGIC] * 2 * LANES))
    q = builder.trunc(builder.sub(builder.bitcast(scaled, v32i), ir.Constant(v32i, [MAGIC_BITS] * 2 * LANES)),
                      ir.VectorType(I16, 2 * LANES))
    if store is None:
        target = builder.gep(xq_ptr, [builder.mul(j, ir.Constant(I64, 2 * LANES))])
        builder.store(q, builder.bitcast(target, ir.VectorType(I16, 2 * LANES).as_pointer()), align=2)
    else:  # another layout of the same int16 values (quant_group's split bytes)
        store(builder, q, j)
    nxt = builder.add(j, ir.Constant(I64, 1))
    j.add_incoming(ir.Constant(I64, 0), entry)
    j.add_incoming(nxt, body)
    builder.cbranch(builder.icmp_signed("<", nxt, blocks), loop, done)

    builder.position_at_end(done)
    ok = builder.phi(I64)
    ok.add_incoming(ir.Constant(I64, 1), entry)
    ok.add_incoming(ir.Constant(I64, 0), loop)
    ok.add_incoming(ir.Constant(I64, 1), body)
    return ok


@intrinsic
def quantize_x16(typingctx, x_addr, blocks, xq_addr, dx_addr):  # type: ignore[no-untyped-def]
    """_quantize_x16 on addresses: 1 if x was finite (xq and dx are filled), else 0."""
    if not _ints(x_addr, blocks, xq_addr, dx_addr):
        return None

    def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
        kinds = signature.args
        x = _pointer(builder, context, values[0], kinds[0], F32)
        n = context.cast(builder, values[1], kinds[1], types.int64)
        xq = _pointer(builder, context, values[2], kinds[2], I16)
        dx = _pointer(builder, context, values[3], kinds[3], F32)
        return _quantize_x16(builder, x, n, xq, dx)

    return types.int64(x_addr, blocks, xq_addr, dx_addr), codegen


def _ints(*ts: types.Type) -> bool:
    return all(isinstance(t, types.Integer) for t in ts)


def _pointer(builder: ir.IRBuilder, context: Any, value: ir.Value, kind: types.Type, to: ir.Type) -> ir.Value:
    return builder.inttoptr(context.cast(builder, value, kind, types.int64), to.as_pointer())


def _signature(args: tuple[types.Type, ...], q4: bool, mode: str, rows: int):  # type: ignore[no-untyped-def]
    """(x, [dx,] row addresses..., blocks) -> float32 per row; None (no match) unless all are ints.

    ``mode``: "float" (x float32) or "int16" (x int16 and its block scales dx).
    """
    if not _ints(*args):
        return None
    result = types.float32 if rows == 1 else types.UniTuple(types.float32, rows)

    def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
        ptrs = [_pointer(builder, context, v, t, I8) for v, t in zip(values, signature.args, strict=True)]
        as_float = [builder.bitcast(p, F32.as_pointer()) for p in ptrs]
        if mode == "int16":
            emit, width, first = _int16_block(builder.bitcast(ptrs[0], I16.as_pointer()), as_float[1], q4), 1, 2
        else:
            emit, width, first = _float_block(as_float[0], q4), 2, 1
        addrs = [context.cast(builder, v, t, types.int64) for v, t in zip(values[first:], signature.args[first:],
                                                                          strict=True)]
        sums = _rows_dot(builder, emit, addrs[:-1], addrs[-1], 18 if q4 else 34, width)
        return sums[0] if rows == 1 else context.make_tuple(builder, result, sums)

    return result(*args), codegen


def _float_row(q4: bool):  # type: ignore[no-untyped-def]
    def typer(typingctx, x_addr, row, blocks):  # type: ignore[no-untyped-def]
        return _signature((x_addr, row, blocks), q4, "float", rows=1)
    return intrinsic(typer)


def _int16_row(q4: bool):  # type: ignore[no-untyped-def]
    def typer(typingctx, xq_addr, dx_addr, row, blocks):  # type: ignore[no-untyped-def]
        return _signature((xq_addr, dx_addr, row, blocks), q4, "int16", rows=1)
    return intrinsic(typer)


#: dot_q8(x_addr, row_addr, blocks): sum over one row of x[i] * d * q[i]; x float32, the row's ``blocks``
#: Q8_0 / Q4_0 blocks
dot_q8 = _float_row(q4=False)
dot_q4 = _float_row(q4=True)
#: dot_q8_x16_row(xq_addr, dx_addr, row_addr, blocks): the same with x as int16 (``xq_addr``) times one float32
#: scale per block of x (``dx_addr``), as quantize_x16 writes them
dot_q8_x16_row = _int16_row(q4=False)
dot_q4_x16_row = _int16_row(q4=True)



def _host_has(*features: str) -> bool:
    """Whether the CPU numba compiles for has every feature: only when it compiles for this host (no
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES), as an x86-only intrinsic cannot be lowered for another target.
    numba's cache is keyed by the CPU name and features, so code built with it never reaches another host."""
    from llvmlite import binding
    from numba.core import config

    if config.CPU_NAME not in (None, "host") or config.CPU_FEATURES:
        return False
    host = binding.get_host_cpu_features()
    return all(host.get(f, False) for f in features)


F16C = _host_has("f16c")
