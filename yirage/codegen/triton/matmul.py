"""Matmul kernels of the Triton renderer: ``tl.dot`` tiles, and a GEMV path for small M.

One launch per matmul, everything fused: A's tile is the prologue expression
evaluated on the fly; a fused RMSNorm first sums its squares over the row (a
pass over A) and scales A's rows by ``rsqrt(ss / K + eps)`` before the product,
as the C-family renderer does (scaling the product instead would turn an
overflowed sum of squares, scale 0, times an infinite product into NaN where
torch has 0); the epilogue reads ``$acc`` (``$scale`` is 1).

- **dot** (float32 compute, M >= 16): a ``BLOCK_M x BLOCK_N`` output tile per
  program, K in ``BLOCK_K`` steps through ``tl.dot(..., input_precision="ieee")``
  (no TF32: results stay within float32's tolerances). float16/bfloat16
  operands are widened to float32 as they load.
- **gemv** (M < 16, where a ``tl.dot`` tile would be mostly padding, and float64
  or integer compute, which ``tl.dot`` does not take in every Triton 3.x):
  one output row by ``BLOCK_N`` columns per program, each K step a
  ``BLOCK_K x BLOCK_N`` product summed over K with ``tl.sum``.

Lanes outside M, N or K are zeros in both operands (``tl.where`` over the masks),
so padding never reaches a sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from yirage.codegen import indexing
from yirage.codegen.emit import Emitter
from yirage.codegen.exprs import compute_type
from yirage.codegen.indexing import IndexSyntax, broadcast_strides
from yirage.codegen.launch import Check
from yirage.codegen.triton.blocks import TL_TYPE, next_pow2, warps
from yirage.compiler.kernel_ir import Buffer, Expr, KernelPlan, Load, Matmul
from yirage.compiler.schedule import Knob, choice


class Renderer(Protocol):
    """What the matmul kernels use of the Triton renderer that calls them (``render._Renderer``).

    The renderer hands itself in; this module sees only these members, so it never imports ``render``.
    """

    buffers: dict[str, Buffer]
    plan: KernelPlan
    emit: Emitter
    ix: IndexSyntax
    masks: dict[str, str]  # vector index name -> its mask, for the kernel being rendered

    def const(self, value: float, ct: str) -> str: ...
    def expr(self, e: Expr, load: Callable[[Load], str], ct: str, shape: str = "") -> str: ...
    def read(self, name: str, off: str) -> str: ...
    def write(self, name: str, off: str, value: str, mask: str = "") -> str: ...
    def loader(self, space: Sequence[int], idx: Sequence[str]) -> Callable[[Load], str]: ...
    def kernel(self, name: str, args: Sequence[str], programs: int, constexprs: dict[str, int],
               num_warps: int = 4, check: Check | None = None, doc: str = "",
               tiles: Sequence[tuple[int, str]] = ()) -> None: ...
    def pid(self) -> str: ...
    def vector(self, name: str, value: str, bound: str | int, mask: str | None = None) -> None: ...
    def close(self) -> None: ...


DOT_MIN_M = 16  # tl.dot tiles are at least 16 x 16 x 16
DOT_MAX = (64, 64, 32)  # largest BLOCK_M, BLOCK_N, BLOCK_K of the dot path
GEMV_MAX = (64, 128)  # largest BLOCK_K, BLOCK_N of the gemv path


GEMV_BLOCKS = {"block_n": (16, 32, 64, 128, 256), "block_k": (16, 32, 64, 128)}  # what a search may pick instead


def matmul(r: Renderer, k: Matmul) -> None:
    """Emit ``k`` in the dot shape where tl.dot fits, else the gemv shape."""
    if _uses_dot(r.buffers, k):
        _dot(r, k, compute_type(r.buffers[k.out]))
    else:
        _gemv(r, k, compute_type(r.buffers[k.out]))


def _uses_dot(buffers: dict[str, Buffer], k: Matmul) -> bool:
    return compute_type(buffers[k.out]) == "float32" and k.m >= DOT_MIN_M


def gemv_blocks(k: Matmul) -> dict[str, int]:
    """The gemv shape's own BLOCK_K and BLOCK_N picks (the ``block_k`` / ``block_n`` knobs' defaults)."""
    return {"block_k": min(GEMV_MAX[0], next_pow2(k.k)), "block_n": min(GEMV_MAX[1], next_pow2(k.n))}


def matmul_knobs(buffers: dict[str, Buffer], k: Matmul) -> list[Knob]:
    """BLOCK_N and BLOCK_K of a gemv-shaped product: how many columns a program owns and how far it reads ahead."""
    if _uses_dot(buffers, k):
        return []
    knobs = []
    bound = {"block_k": next_pow2(k.k), "block_n": next_pow2(k.n)}
    for name, pick in gemv_blocks(k).items():
        others = [b for b in GEMV_BLOCKS[name] if b != pick and b <= bound[name]]
        if others:
            knobs.append(Knob(k.name, name, (pick, *others), f"{name.upper()} of the gemv program"))
    return knobs


def _batch(r: Renderer, k: Matmul, qb: str) -> list[str]:
    bidx = [f"q{i}" for i in range(len(k.batch))]
    indexing.decompose(r.emit, qb, k.batch, bidx, r.ix, scratch="_q")
    return bidx


def _scale(r: Renderer, k: Matmul, ct: str, ss: str) -> str:
    return rms_scale(ss, k.k, k.eps, ct, r.const)


def rms_scale(ss: str, n: int, eps: float, ct: str, const: Callable[[float, str], str]) -> str:
    """An RMSNorm's ``rsqrt(ss / n + eps)`` in ``ct`` (a fused norm: a matmul's rows, attention's key rows):
    IEEE division and square root."""
    if ct == "float32":
        return f"tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn({ss}, {float(n)}) + {const(eps, ct)}))"
    return f"1.0 / tl.sqrt({ss} / {float(n)} + {const(eps, ct)})"


def _dot(r: Renderer, k: Matmul, ct: str) -> None:
    emit = r.emit
    nb = max(1, math.prod(k.batch))
    bm = min(DOT_MAX[0], max(16, next_pow2(k.m)))
    bn = min(DOT_MAX[1], max(16, next_pow2(k.n)))
    bk = min(DOT_MAX[2], max(16, next_pow2(k.k)))
    args = list(dict.fromkeys([k.out] + k.reads()))
    r.kernel(k.name, args, nb, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, warps(bm * bn // 2),
             doc=f"{k.out} = epilogue(prologue(A) @ {k.b}): tl.dot tiles", tiles=[(k.m, "BLOCK_M"), (k.n, "BLOCK_N")])
    emit(f"pid = {r.pid()}")
    emit(f"pn = pid % tl.cdiv({k.n}, BLOCK_N)")
    emit(f"rest = pid // tl.cdiv({k.n}, BLOCK_N)")
    emit(f"pm = rest % tl.cdiv({k.m}, BLOCK_M)")
    emit(f"qb = rest // tl.cdiv({k.m}, BLOCK_M)")
    bidx = _batch(r, k, "qb")
    r.vector("am", "(pm * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]", k.m)
    r.vector("on", "(pn * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]", k.n)
    a_load = r.loader(k.a_space, bidx + ["am", "ak"])
    scaled = ""
    if k.row_scale is not None:  # a first pass over the rows of A: the RMSNorm scale
        emit("ss = tl.zeros([BLOCK_M], tl.float32)")
        with emit.block(f"for ko in range(0, {k.k}, BLOCK_K):"):
            r.vector("ak", "(ko + tl.arange(0, BLOCK_K))[None, :]", k.k)
            emit(f"x = tl.where(m_am & m_ak, {r.expr(k.row_scale, a_load, ct)}, 0.0)")
            emit("ss = ss + tl.sum(x * x, 1)")
        emit(f"sc = ({_scale(r, k, ct, 'ss')})[:, None]")
        scaled = " * sc"
    emit("acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)")
    b_strides = broadcast_strides(r.buffers[k.b], k.batch + (k.k, k.n))
    with emit.block(f"for ko in range(0, {k.k}, BLOCK_K):"):
        r.vector("ak", "(ko + tl.arange(0, BLOCK_K))[None, :]", k.k)
        r.vector("bk", "(ko + tl.arange(0, BLOCK_K))[:, None]", k.k)
        emit(f"a = tl.where(m_am & m_ak, ({r.expr(k.a, a_load, ct)}){scaled}, 0.0)")
        b = r.read(k.b, indexing.offset(bidx + ["bk", "on"], b_strides, r.ix))
        emit(f"b = tl.where(m_bk & m_on, {b}, 0.0)")
        emit('acc = tl.dot(a, b, acc, input_precision="ieee")')
    emit("v_acc = acc")
    if k.row_scale is not None:
        emit("v_scale = 1.0  # A's rows are scaled already")
    load = r.loader(k.space, bidx + ["am", "on"])
    emit(r.write(k.out, f"(qb * {k.m} + am) * {k.n} + on", r.expr(k.epilogue, load, ct), "m_am & m_on"))
    r.close()


def _gemv(r: Renderer, k: Matmul, ct: str) -> None:
    emit = r.emit
    tt = TL_TYPE[ct]
    zero = r.const(0, ct)
    nb = max(1, math.prod(k.batch))
    picks = gemv_blocks(k)
    bk, bn = (choice(r.plan, k.name, name, picks[name]) for name in ("block_k", "block_n"))
    args = list(dict.fromkeys([k.out] + k.reads()))
    r.kernel(k.name, args, nb * k.m, {"BLOCK_N": bn, "BLOCK_K": bk}, warps(bk * bn // 8),
             doc=f"{k.out} = epilogue(prologue(A) @ {k.b}): one row by BLOCK_N columns per program",
             tiles=[(k.n, "BLOCK_N")])
    emit(f"pid = {r.pid()}")
    emit(f"pn = pid % tl.cdiv({k.n}, BLOCK_N)")
    emit(f"row = pid // tl.cdiv({k.n}, BLOCK_N)")
    emit(f"mm = row % {k.m}")
    emit(f"qb = row // {k.m}")
    bidx = _batch(r, k, "qb")
    r.vector("nn", "pn * BLOCK_N + tl.arange(0, BLOCK_N)", k.n)
    emit("on = nn[None, :]")
    r.masks["on"] = "m_nn[None, :]"
    a_load = r.loader(k.a_space, bidx + ["mm", "ak"])
    scaled = ""
    if k.row_scale is not None:  # a first pass over the row of A: the RMSNorm scale
        emit(f"ss = tl.zeros([BLOCK_K, 1], {tt})")
        with emit.block(f"for ko in range(0, {k.k}, BLOCK_K):"):
            r.vector("ak", "(ko + tl.arange(0, BLOCK_K))[:, None]", k.k)
            emit(f"x = tl.where(m_ak, {r.expr(k.row_scale, a_load, ct)}, {zero})")
            emit("ss = ss + x * x")
        emit(f"sc = {_scale(r, k, ct, 'tl.sum(tl.sum(ss, 1), 0)')}")
        scaled = " * sc"
    emit(f"acc = tl.zeros([BLOCK_N], {tt})")
    b_strides = broadcast_strides(r.buffers[k.b], k.batch + (k.k, k.n))
    with emit.block(f"for ko in range(0, {k.k}, BLOCK_K):"):
        r.vector("ak", "(ko + tl.arange(0, BLOCK_K))[:, None]", k.k)
        emit(f"a = tl.where(m_ak, ({r.expr(k.a, a_load, ct)}){scaled}, {zero})")
        b = r.read(k.b, indexing.offset(bidx + ["ak", "on"], b_strides, r.ix))
        emit(f"b = tl.where(m_ak & m_nn[None, :], {b}, {zero})")
        emit("acc = acc + tl.sum(a * b, 0)")
    emit("v_acc = acc")
    if k.row_scale is not None:
        emit("v_scale = 1.0  # A's row is scaled already")
    load = r.loader(k.space, bidx + ["mm", "nn"])
    emit(r.write(k.out, f"(qb * {k.m} + mm) * {k.n} + nn", r.expr(k.epilogue, load, ct, "[BLOCK_N]"), "m_nn"))
    r.close()
