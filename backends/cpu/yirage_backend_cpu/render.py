"""The Python renderer: kernel IR -> one numba module per plan.

Each kernel becomes an ``@njit(parallel, fastmath, nogil, cache)`` function
over flat 1-D buffers with every shape and stride baked in as a constant; a
plain-Python ``run(inputs)`` launcher converts torch tensors to numpy views,
allocates outputs and temporaries and calls the kernels in order. Each
``render_*`` returns the launcher lines that call what it emitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from yirage.codegen.emit import Emitter
from yirage.codegen.exprs import STASH, compute_type, has_rotate, row_stash
from yirage.codegen.indexing import broadcast_strides, coalesce
from yirage.compiler.kernel_ir import Attention, Buffer, Embedding, KernelPlan, Load, Matmul, Pointwise, Row
from yirage.compiler.schedule import ScheduleError
from yirage.graph.kernel_graph import contiguous_strides
from yirage_backend_cpu.codegen import (
    PARALLEL_MIN_WORK,
    POINTWISE_CHUNK,
    RENDERER_VERSION,
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
)
from yirage_backend_cpu.knobs import heads_per_pass, pointwise_parallel, row_parallel
from yirage_backend_cpu.render_matmul import render_matmul

# -- kernels ----------------------------------------------------------------


def _call(k_name: str, args: list[Buffer]) -> list[str]:
    return [f"{k_name}({', '.join(b.name for b in args)})"]


def render_pointwise(k: Pointwise, buffers: dict[str, Buffer], emit: Emitter, knobs: Mapping[str, Any]) -> list[str]:
    names = k.reads()
    out = buffers[k.out]
    ct = compute_type(out)
    strides = [contiguous_strides(k.space)] + [broadcast_strides(buffers[n], k.space) for n in names]
    keep = [len(k.space) - 1] if has_rotate(k.expr) else []
    space, cstrides, _ = coalesce(k.space, strides, keep)
    inner, outer_dims = space[-1], space[:-1]
    outer = math.prod(outer_dims)
    parallel = knobs.get("parallel", pointwise_parallel(k))
    chunk = min(inner, max(1024, -(-inner // 8))) if parallel else inner
    chunk = min(chunk, POINTWISE_CHUNK) if outer > 1 else chunk
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

    with kernel_def(emit, k.name, args, parallel):
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
    return _call(k.name, args)


def render_row(k: Row, buffers: dict[str, Buffer], emit: Emitter, knobs: Mapping[str, Any]) -> list[str]:
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
    parallel = knobs.get("parallel", row_parallel(k))
    assert rows == math.prod(k.space) // k.space[k.axis]  # what row_parallel counts
    args = [out] + [buffers[n] for n in names]
    all_names = [k.out] + names
    step = {n: s[axis] for n, s in zip(all_names, cstrides, strict=True)}

    def load(ld: Load) -> str:
        return f"{ld.buffer}[{at(f'b_{ld.buffer}', 'l', step[ld.buffer])}]"

    def row_load(ld: Load) -> str:
        return f"{ld.buffer}[b_{ld.buffer}]"

    # the output row holds the compute type (narrowed after the last kernel): a stashed value reads back exactly
    stashed, out_expr = row_stash(k.reductions, k.out_expr, k.per_row, exact=True)
    out_at = f"{k.out}[{at(f'b_{k.out}', 'l', step[k.out])}]"

    with kernel_def(emit, k.name, args, parallel):
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
                    if red is k.reductions[-1] and stashed is not None:  # keep it in the output row
                        emit(f"v_{STASH} = {value}")
                        emit(f"{out_at} = v_{STASH}")
                        value = f"v_{STASH}"
                    if red.combine == "sum":
                        emit(f"v_{red.var} = {acc_src(f'v_{red.var}', value, ct)}")
                    else:
                        vmax = "rmax" if ct.startswith("float") else "fmax"  # rmax: NaN-propagating, vectorizes
                        emit(f"v_{red.var} = {vmax}(v_{red.var}, {value})")
            if k.per_row:
                emit(f"{k.out}[b_{k.out}] = {expr_src(k.out_expr, row_load, ct)}")
            else:
                with emit.block(f"for l in range(U({length})):"):
                    if stashed is not None:
                        emit(f"v_{STASH} = {out_at}")
                    emit(f"{out_at} = {expr_src(out_expr, load, ct)}")
        emit("return 0")
    return _call(k.name, args)


def render_embedding(k: Embedding, buffers: dict[str, Buffer], emit: Emitter, knobs: Mapping[str, Any]) -> list[str]:
    out, ids, table = buffers[k.out], buffers[k.ids], buffers[k.table]
    sv, sd = table.strides
    parallel = k.tokens * k.dim >= PARALLEL_MIN_WORK and k.tokens > 1
    idx = [f"i{d}" for d in range(len(ids.dims))]
    with kernel_def(emit, k.name, [out, ids, table], parallel):
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
    return [
        f"s = {k.name}({k.out}, {k.ids}, {k.table})",
        "if s:",
        f'    raise IndexError(f"embedding ids must lie in [0, {k.vocab}); the id at flat position {{s - 1}} '
        f'of input {k.ids} is out of range")',
    ]


def render_attention(k: Attention, buffers: dict[str, Buffer], emit: Emitter, knobs: Mapping[str, Any]) -> list[str]:
    """One (batch, KV head) per parallel iteration, each K and V row read once for the group's query heads, or
    one (batch, head) (``knobs.heads_per_pass``, or the ``heads_per_pass`` knob): the same operations in the same
    order per head either way, so the same bits."""
    out, q, kc, vc = (buffers[x] for x in (k.out, k.q, k.k, k.v))
    ct = compute_type(out)
    args = [out, q, kc, vc] + [buffers[b] for b in (k.lengths, *k.gains()) if b]
    group = k.heads // k.kv_heads
    per = knobs.get("heads_per_pass", heads_per_pass(k))
    if per not in (1, group):
        raise ScheduleError(f"attention {k.name}: heads_per_pass {per!r} is neither 1 nor the group size {group}: "
                            "the plan's schedule and the cpu renderer disagree (a yirage bug: report it with "
                            "g.to_json(); YIRAGE_SUPEROPTIMIZE=0 meanwhile)")
    items = k.batch * k.heads // per
    parallel = items > 1 and k.batch * k.heads * k.seq * k.head_dim >= PARALLEL_MIN_WORK
    qs, ks, vs = q.strides, kc.strides, vc.strides
    ls = buffers[k.lengths].strides[0] if k.lengths else 0
    exp = "fexp" if ct == "float32" else "math.exp"

    def gain(name: str | None) -> str | None:  # a gain over the head dim at d
        return f"{name}[{at('U(0)', 'd', buffers[name].strides[-1])}]" if name else None

    with kernel_def(emit, k.name, args, parallel):
        if k.lengths:
            with emit.block(f"for b in range({k.batch}):"):
                emit(f"n = {k.lengths}[U(b) * U({ls})]")
                with emit.block(f"if n < 1 or n > {k.seq}:"):
                    emit("return b + 1")
        with outer_loop(emit, "t", items, parallel):
            if per == 1:
                emit(f"b = t // U({k.heads})")
                emit(f"h0 = t - b * U({k.heads})")
                emit(f"g = h0 // U({group})")
            else:
                emit(f"b = t // U({k.kv_heads})")
                emit(f"g = t - b * U({k.kv_heads})")
                emit(f"h0 = g * U({group})")
            emit(f"n = U({k.lengths}[b * U({ls})])" if k.lengths else f"n = U({k.seq})")
            emit(f"kb = {offset(['b', 'g'], ks[:2])}")
            emit(f"vb = {offset(['b', 'g'], vs[:2])}")
            emit(f"sc = np.empty(n * U({per}), np.{ct})")
            emit(f"mxs = np.full({per}, {const(-math.inf, ct)})")
            if k.k_eps is not None:
                emit(f"kn = np.empty({k.head_dim}, np.{ct})")
            if k.q_eps is not None:  # the pass's query rows normalized once (QK-norm)
                emit(f"qn = np.empty({per * k.head_dim}, np.{ct})")
                with emit.block(f"for j in range(U({per})):"):
                    emit(f"qb = {offset(['b', '(h0 + j)'], qs[:2])}")
                    _rms_row(emit, f"{k.q}[{at('qb', 'd', qs[2])}]", k.head_dim, k.q_eps, gain(k.q_gain),
                             f"qn[j * U({k.head_dim}) + d]", ct)
            with emit.block("for s in range(n):"):
                emit(f"kr = {at('kb', 's', ks[2])}")
                k_d = f"{k.k}[{at('kr', 'd', ks[3])}]"
                if k.k_eps is not None:  # this key row normalized once for the pass's heads (QK-norm)
                    _rms_row(emit, k_d, k.head_dim, k.k_eps, gain(k.k_gain), "kn[d]", ct)
                    k_d = "kn[d]"
                with emit.block(f"for j in range(U({per})):"):
                    emit(f"qb = {offset(['b', '(h0 + j)'], qs[:2])}")
                    emit(f"acc = {const(0, ct)}")
                    with emit.block(f"for d in range(U({k.head_dim})):"):
                        q_d = f"{k.q}[{at('qb', 'd', qs[2])}]" if k.q_eps is None else f"qn[j * U({k.head_dim}) + d]"
                        emit(f"acc = {fma_src('acc', q_d, k_d, ct)}")
                    emit(f"acc *= {const(k.scale, ct)}")
                    emit("sc[j * n + s] = acc")
                    emit("mxs[j] = fmax(mxs[j], acc)")
            emit(f"tots = np.empty({per}, np.{ct})")
            with emit.block(f"for j in range(U({per})):"):
                emit("mx = mxs[j]")
                emit(f"tot = {const(0, ct)}")
                with emit.block("for s in range(n):"):
                    emit(f"e = {exp}(sc[j * n + s] - mx)")
                    emit("sc[j * n + s] = e")
                    emit(f"tot = {acc_src('tot', 'e', ct)}")
                emit("tots[j] = tot")
                emit(f"ob = (b * U({k.heads}) + h0 + j) * U({k.head_dim})")
                with emit.block(f"for d in range(U({k.head_dim})):"):
                    emit(f"{k.out}[ob + d] = {const(0, ct)}")
            with emit.block("for s in range(n):"):
                emit(f"vr = {at('vb', 's', vs[2])}")
                with emit.block(f"for j in range(U({per})):"):
                    emit("w = sc[j * n + s] / tots[j]")
                    emit(f"ob = (b * U({k.heads}) + h0 + j) * U({k.head_dim})")
                    with emit.block(f"for d in range(U({k.head_dim})):"):
                        emit(f"{k.out}[ob + d] += w * {k.v}[{at('vr', 'd', vs[3])}]")
        emit("return 0")
    if not k.lengths:
        return _call(k.name, args)
    return [
        f"s = {k.name}({', '.join(b.name for b in args)})",
        "if s:",
        f'    raise ValueError(f"attention lengths must lie in [1, {k.seq}]; batch {{s - 1}} has length '
        f'{{int(T_{k.lengths}[s - 1])}}")',
    ]


def _rms_row(emit: Emitter, value: str, n: int, eps: float, gain: str | None, dst: str, ct: str) -> None:
    """``dst`` (an element at ``d``) = ``value`` (at ``d``) RMS-normalized over d < n, times ``gain`` (at ``d``)
    where one follows: a QK-norm fused into attention, each element as render_row computes an RMSNorm's."""
    emit(f"ss = {const(0, ct)}")
    with emit.block(f"for d in range(U({n})):"):
        emit(f"ss = {acc_src('ss', f'{value} * {value}', ct)}")
    emit(f"rs = {rms_scale_src('ss', n, eps, ct)}")
    with emit.block(f"for d in range(U({n})):"):
        emit(f"{dst} = {f'(({value} * rs) * {gain})' if gain else f'({value} * rs)'}")


#: each takes the kernel, the plan's buffers, the emitter and the kernel's schedule choices (knobs.py)
RENDERERS: dict[type, Callable[[Any, dict[str, Buffer], Emitter, Mapping[str, Any]], list[str]]] = {
    Pointwise: render_pointwise,
    Row: render_row,
    Matmul: render_matmul,
    Embedding: render_embedding,
    Attention: render_attention,
}


# -- the launcher -------------------------------------------------------------


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
    helpers = "as_pointer, dgelu, dsilu, fexp, fgelu, fmax, fmin, fsilu, racc, rfma, rmax"
    emit(f"from yirage_backend_cpu.kernel_lib import FASTMATH, {helpers}")
    emit("")
    emit("U = np.uint64")
    emit(f"_keep = (math, prange, {helpers.removeprefix('as_pointer, ')})")
    launch: list[str] = []
    for k in plan.kernels:
        emit("")
        emit("")
        launch += RENDERERS[type(k)](k, plan.buffers, emit, plan.schedule.get(k.name, {}))
    emit("")
    emit("")
    with emit.block("def run(inputs):"):
        for name in plan.inputs:
            buf = plan.buffers[name]
            narrow = buf.dtype.name in ("float16", "bfloat16")
            emit(f"T_{name} = inputs[{buf.index}]{'.float()' if narrow else ''}")
            emit(f"{name} = T_{name}.data_ptr()")
        for buf in plan.buffers.values():
            if buf.role == "input":
                continue
            dims = buf.dims if buf.role == "output" else (math.prod(buf.dims),)
            emit(f"T_{buf.name} = torch.empty({dims}, dtype=torch.{compute_type(buf)}, device='cpu')")
            emit(f"{buf.name} = T_{buf.name}.data_ptr()")
        for line in launch:
            emit(line)
        results = []
        for name in plan.outputs:
            buf = plan.buffers[name]
            narrow = compute_type(buf) != buf.dtype.name
            results.append(f"T_{name}.to(torch.{buf.dtype.name})" if narrow else f"T_{name}")
        emit(f"return [{', '.join(results)}]")
    emit("")
    return "\n".join(emit.lines)
