"""Prompt projections on bfloat16 activations: native bf16 dot products (AVX512-BF16's vdpbf16ps) from LLVM.

With ``InferEngine(prompt_dtype="bfloat16")`` the prefill rounds each projection's input to bf16, as transformers
and llama.cpp run a bf16 model's prompt (yirage.models.prefill.rounded_linear). vdpbf16ps multiplies 32 bf16
pairs and adds them pairwise into 16 float32 lanes in one instruction: twice the float32 FMA's rate, and no
widening. Tiles of 2 weight rows x 4 prompt rows keep 8 accumulators in registers; each lane's sum is reduced
in a fixed order at the end. Measured (2 cores, AMD EPYC, a 1536 x 576 bf16 matrix, medians of 15): 0.026 /
0.078 / 0.62 ms at 4 / 16 / 128 rows against torch's bf16 matmul (oneDNN) 0.075 / 0.127 / 0.60 and this
backend's float32 tiles (widened weights) 0.12 / 0.27 / 1.28.

The instruction treats subnormal inputs and results as zero and rounds to nearest even, as torch's own bf16
GEMM does on the same CPU. Offered only where the CPU numba compiles for has it (``native``); elsewhere the
caller falls back on torch's matmul.
"""

from __future__ import annotations

import functools
from typing import Any

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from yirage_backend_cpu.quant_dot import F32, I16, I64, _hsum, _ints, _pointer, counted_loop
from yirage_backend_cpu.sources import tie_caches_to_sources

CHUNK = 32  # bf16 values per instruction and per loop iteration


class _BFloat(ir.Type):
    """LLVM's ``bfloat``, which llvmlite's IR builder does not name (the intrinsic takes <32 x bfloat>)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


V32B, V32I16, V16F = ir.VectorType(_BFloat(), CHUNK), ir.VectorType(I16, CHUNK), ir.VectorType(F32, 16)


@functools.cache
def native() -> bool:
    """Whether the CPU numba compiles for has vdpbf16ps (NUMBA_CPU_FEATURES / NUMBA_CPU_NAME, else the host's)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return "+avx512bf16" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME not in (None, "host"):
        return False  # a named (portable) target: do not assume the host's extensions
    return bool(llvm.get_host_cpu_features().get("avx512bf16", False))


def _dots(builder: ir.IRBuilder, x: ir.Value, x_stride: ir.Value, w: ir.Value, w_stride: ir.Value, chunks: ir.Value,
          wrows: int, xrows: int) -> list[ir.Value]:
    """Every (weight row, x row) pair's bf16 dot product over ``chunks`` * 32 values, weight row by weight row
    (rows ``*_stride`` bytes apart)."""
    dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V32B, V32B]),
                                        "llvm.x86.avx512bf16.dpbf16ps.512")
    x_base, w_base = builder.ptrtoint(x, I64), builder.ptrtoint(w, I64)

    def rows(base: ir.Value, stride: ir.Value, count: int) -> list[ir.Value]:
        return [builder.inttoptr(builder.add(base, builder.mul(stride, ir.Constant(I64, r))), I16.as_pointer())
                for r in range(count)]

    xs, ws = rows(x_base, x_stride, xrows), rows(w_base, w_stride, wrows)

    def body(builder: ir.IRBuilder, j: ir.Value, acc: list[ir.Value]) -> list[ir.Value]:
        offset = builder.mul(j, ir.Constant(I64, CHUNK))

        def load(row: ir.Value) -> ir.Value:
            bits = builder.load(builder.bitcast(builder.gep(row, [offset]), V32I16.as_pointer()), align=2)
            return builder.bitcast(bits, V32B)

        xv = [load(r) for r in xs]
        out = []
        for r, row in enumerate(ws):
            wv = load(row)
            out += [builder.call(dp, [acc[r * xrows + b], xv[b], wv]) for b in range(xrows)]
        return out

    totals = counted_loop(builder, chunks, [ir.Constant(V16F, [0.0] * 16)] * (wrows * xrows), body, "bf16dots")
    return [_hsum(builder, t) for t in totals]


def _tile(wrows: int, xrows: int):  # type: ignore[no-untyped-def]
    def typer(typingctx, x_addr, x_stride, w_addr, w_stride, chunks):  # type: ignore[no-untyped-def]
        if not _ints(x_addr, x_stride, w_addr, w_stride, chunks):
            return None
        result = types.UniTuple(types.float32, wrows * xrows)

        def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
            kinds = signature.args
            x = _pointer(builder, context, values[0], kinds[0], I16)
            w = _pointer(builder, context, values[2], kinds[2], I16)
            xs, ws, n = (context.cast(builder, values[i], kinds[i], types.int64) for i in (1, 3, 4))
            return context.make_tuple(builder, result, _dots(builder, x, xs, w, ws, n, wrows, xrows))

        return result(x_addr, x_stride, w_addr, w_stride, chunks), codegen
    return intrinsic(typer)


#: tile_{w}x{x}(x_addr, x_stride, w_addr, w_stride, chunks) -> the w x x float32 dots of w bf16 weight rows with
#: x bf16 rows of x (weight row major), over chunks * 32 values; strides in bytes
tile_2x4, tile_2x1 = _tile(2, 4), _tile(2, 1)


@njit(parallel=True, error_model="numpy", nogil=True, cache=True)
def bf16_parts(x_addr, m, k, w_addr, n0s, n1s, out, n):  # type: ignore[no-untyped-def]
    """out[b * n + r] = x[b] . W[r] for the m bf16 rows of x (at ``x_addr``) and W's bf16 rows n0s[p]..n1s[p]
    of each part p (one parallel iteration each); k a multiple of 32."""
    row = k * 2
    chunks = k // CHUNK
    for p in prange(n0s.shape[0]):
        r = n0s[p]
        while r < n1s[p]:
            pair = r + 1 < n1s[p]
            stride = row if pair else 0  # an odd last row: the pair's tiles on that row twice, one half unused
            wa = w_addr + r * row
            b = 0
            while b + 4 <= m:
                t = tile_2x4(x_addr + b * row, row, wa, stride, chunks)
                for j in range(4):
                    out[(b + j) * n + r] = t[j]
                    if pair:
                        out[(b + j) * n + r + 1] = t[4 + j]
                b += 4
            while b < m:
                t1 = tile_2x1(x_addr + b * row, row, wa, stride, chunks)
                out[b * n + r] = t1[0]
                if pair:
                    out[b * n + r + 1] = t1[1]
                b += 1
            r += 2


def usable(x: Any, weight: Any) -> bool:
    """Whether ``bf16_parts`` can take ``x @ weight.T``: both bf16, contiguous, on the CPU, K a multiple of 32."""
    import torch

    return (native() and x.dtype == torch.bfloat16 and isinstance(weight, torch.Tensor)
            and weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu" and x.dim() == 2
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and x.shape[1] % CHUNK == 0
            and x.is_contiguous() and weight.is_contiguous())


tie_caches_to_sources(globals())
