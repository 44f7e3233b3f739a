"""The GEMV task body of the C-family PersistentKernel renderer (yirage.persistent.cstyle).

``out[b, n] = x[b] . W[n] (+ bias[n]) (+ residual[b, n])`` for every batch row ``b`` at once: the projections
of rmsnorm_linear, linear_with_residual, silu_mul_linear_with_residual and the LM head. A decode step is these
GEMVs reading the weights once each, so on a GPU their share of HBM bandwidth is the step time (issue 27: one
64-thread group per column, scalar 2-byte loads and a barrier per reduction level took 10.2 ms/token for a
SmolLM2-135M shape where Triton took 1.6 ms).

Two layouts:

- ``lanes`` > 0 (CPU devices): one work-item per column, ``lanes`` independent partial sums over contiguous
  weights that the compiler may vectorize without reassociating anything.
- otherwise (GPUs): a work-group of ``group`` threads is ``group / S`` slices of ``S`` threads, one output row
  per slice. A slice's threads read consecutive elements of its row (coalesced), ``width`` at a time with the
  dialect's ``WideLoad`` (16 bytes: 8 bfloat16/float16 or 4 float32) where ``K`` is a multiple of the width
  and, for loads that need it, both base addresses are aligned (a uniform run-time test; scalar loads
  otherwise), up to ``UNROLL`` loads in flight per thread before any is used (fewer at large batches). The
  slice then sums its threads' partials: by register shuffles where the dialect declares them
  (``Dialect.shuffle_xor``: S is its width, no local memory, no barrier), else by a tree in local memory
  (S = ``SLICE``, a barrier per level).

The work-group size stays ``group`` (the megakernel runs every task body in blocks of that size). Math:
float32 accumulation, IEEE, no contraction; each thread sums its elements in order, the slice combines
those partials pairwise, so the order differs from the reference runtime's (tests compare at tolerances).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from yirage.codegen.dialect import Dialect, WideLoad
from yirage.codegen.emit import ILP, ilp_loop
from yirage.persistent.cstyle_buffers import PKLaunch, tensor_name
from yirage.persistent.cstyle_sample import Renderer as SampleRenderer
from yirage.persistent.specs import IntCol

COLUMNS_PER_GROUP = 64  # CPU layout: work-items (one column each) per work-group
SLICE = 32  # threads per row where the dialect has no shuffles (a warp on NVIDIA, half a wavefront on AMD)
#: wide loads a thread issues before it uses one (8 x 16 bytes: a K = 1536 bfloat16 row in one round trip)
UNROLL = 8
#: ... and fewer at larger batches, at most this many (loads x batch rows) per round: with 8 loads at batch 32 and 64
#: NVRTC stopped unrolling the batch loop and acc[] went to local memory (ptxas -v: 128 and 256 bytes of stack)
LOAD_BUDGET = 64
MAX_LOCAL_FLOATS = 4096  # the local-memory tree's partial sums: threads x batch floats at most
#: the most floats (batch rows x K) of a normalized ``x`` a GEMV stages in local memory (8 KiB: the megakernel holds
#: every distinct task function's local arrays at once, and 8 of its blocks share an SM)
STAGED_FLOATS = 2048
STAGED_GROUPS = 2048  # ... and at most this many work-groups stage it (see ``stages``)
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class Renderer(SampleRenderer, Protocol):
    """What the GEMV uses of the C-family renderer (``cstyle._Renderer``, which passes itself)."""

    group: int
    lanes: int

    def pairwise(self, names: list[str]) -> str: ...
    def tree(self, local: int, combine: list[str]) -> list[str]: ...


@dataclass(frozen=True)
class Stage:
    """What a GEMV's work-groups compute into local memory before its rows read it there: ``rmsnorm`` (of ``x`` times
    ``gamma``, epsilon ``eps``) or ``silu_mul`` (``silu(gate) * up`` of ``x``'s two halves). The kernel it replaces
    (``y_rmsnorm``, ``y_silu_mul``), its XS round trip through global memory and, in the megakernel, a grid-wide
    barrier go; the bits stay theirs (same expressions, same order)."""

    kind: str
    gamma: str = ""
    eps: float = 0.0


def stages(r: Renderer, k: int, n: int) -> bool:
    """Whether a GEMV of ``K = k``, ``N = n`` stages its input (``gemv(..., stage=...)``): the GPU layout, every batch
    row's staged ``x`` fits the work-group's ``STAGED_FLOATS`` of local memory, and there are at most
    ``STAGED_GROUPS`` work-groups. Every work-group stages the whole ``x`` (reads of 2 x batch x K floats, from L2,
    before its first weight load): with two rows a group that is twice the weights' bytes, worth a kernel launch
    where the groups are few (the projections) and not for an LM head's tens of thousands."""
    rows, _, _ = slice_shape(r.d, r.group, r.p.batch)
    return not r.lanes and r.p.batch * k <= STAGED_FLOATS and -(-n // rows) <= STAGED_GROUPS


def gemv(r: Renderer, i: int, x: str, k: int, weight: str, bias: str | None, residual: str | None,
         stage: Stage | None = None) -> PKLaunch:
    """The GEMV kernel of layer ``i`` (module docstring); ``x`` and ``weight`` name its buffers. With ``stage`` (only
    where ``stages``), each work-group first computes its ``x`` from buffer ``x`` into local memory (``Stage``)."""
    batch, n = r.p.batch, r.col(i, IntCol.N)
    prologue: list[str] = []
    if stage is not None:
        if not stages(r, k, n):
            raise ValueError(f"a GEMV of K = {k}, N = {n} at batch {batch} does not stage its input (see stages)")
        prologue = _prefetch(r, k, n, r.dtypes[weight]) + _staged(r, k, batch, stage)
    if r.lanes:
        body, groups, local = _columns(r, k, n, batch)
    else:
        body, groups, local = _slices(r, k, n, batch, r.dtypes[weight], "local" if stage else r.dtypes[x])
    body = prologue + body
    params = [("out", tensor_name(r.col(i, IntCol.OUTPUT)), True), ("xin" if stage else "x", x, False),
              ("w", weight, False)]
    if stage is not None and stage.kind == "rmsnorm":
        params.append(("gamma", stage.gamma, False))
    if bias is not None:
        body.append("        s = s + READ(bias, n);")
        params.append(("bias", bias, False))
    if residual is not None:
        body.append(f"        s = s + res[b * {n} + n];")
        params.append(("res", residual, False))
    body += [f"        out[b * {n} + n] = s;", "    }", "}"]
    return r.kernel("y_gemv", params, body, groups, local, i)


def silu_mul(r: Renderer, a: str, m: str) -> str:
    """``silu(a) * m`` as the silu_mul kernel (``cstyle``) and the stage a GEMV computes both spell it: one home for
    the expression, so both give the same bits."""
    return f"{a} / ({r.f(1)} + {r.d.math['exp']}(-{a})) * {m}"


def silu_mul_row(r: Renderer, k: int, src: str, dst: str) -> list[str]:
    """Lines that write ``dst[b * k + c] = silu(src[b * 2k + c]) * src[b * 2k + k + c]`` for batch row ``b``, by the
    work-group's threads (``lid`` declared by the caller)."""
    f32 = r.f32
    return ilp_loop(r.it, "c", "lid", k, r.group,
                    lambda u, c: [f"{f32} a{u} = {src}[b * {2 * k} + {c}];",
                                  f"{f32} m{u} = {src}[b * {2 * k} + {k} + {c}];"],
                    lambda u, c: [f"{dst}[b * {k} + {c}] = {silu_mul(r, f'a{u}', f'm{u}')};"])


def norm_row(r: Renderer, k: int, eps: float, src: str, dst: str, red: str) -> list[str]:
    """Lines that write ``dst[b * k + c] = src[b * k + c] * inv * gamma[c]`` for batch row ``b`` with ``inv = 1 /
    sqrt(mean(src[b]^2) + eps)``, by the whole work-group (``b``, ``lid`` and a local ``red[group]`` declared by the
    caller): ILP partial sums per thread added pairwise, then a tree. One home for the RMSNorm kernel
    (``cstyle.rmsnorm``) and the norm a GEMV stages, so both give the same bits."""
    f32, g = r.f32, r.group
    squares = ilp_loop(r.it, "c", "lid", k, g, lambda u, c: [f"{f32} v{u} = {src}[b * {k} + {c}];"],
                       lambda u, c: [f"ss{u} = ss{u} + v{u} * v{u};"])
    scaled = ilp_loop(r.it, "c", "lid", k, g,
                      lambda u, c: [f"{f32} v{u} = {src}[b * {k} + {c}];", f"{f32} m{u} = READ(gamma, {c});"],
                      lambda u, c: [f"{dst}[b * {k} + {c}] = v{u} * inv * m{u};"])
    return [*(f"{f32} ss{u} = {r.f(0)};" for u in range(ILP)), *squares,
            f"{red}[lid] = {r.pairwise([f'ss{u}' for u in range(ILP)])};",
            *r.tree(g, [f"{red}[lid] = {red}[lid] + {red}[lid + h];"]),
            f"{f32} inv = {r.f(1)} / {r.d.math['sqrt']}({red}[0] / {r.f(k)} + {r.f(eps)});", *scaled]


def _staged(r: Renderer, k: int, batch: int, stage: Stage) -> list[str]:
    """Local ``x`` = every batch row's ``norm_row`` or ``silu_mul_row`` of ``xin``: the bits the kernel it replaces
    would have written to XS."""
    if stage.kind == "rmsnorm":
        row = norm_row(r, k, stage.eps, "xin", "x", "nred")
        red = [f"{r.d.local} {r.f32} nred[{r.group}];"]
    elif stage.kind == "silu_mul":
        row, red = silu_mul_row(r, k, "xin", "x"), []
    else:
        raise ValueError(f"unknown GEMV stage {stage.kind!r}: rmsnorm or silu_mul")
    lines = [f"{r.it} lid = {r.ids()[2]};", f"for (int b = 0; b < {batch}; b++) {{", *(f"    {line}" for line in row),
             f"    {r.d.barrier}",  # x complete before the rows read it; nred[0] read before the next row's tree
             "}"]
    return [f"{r.d.local} {r.f32} x[{batch * k}];", *red, "{", *(f"    {line}" for line in lines), "}"]


#: bytes of the cache line a prefetch asks for (NVIDIA's L2 line; a hint: a different line size costs nothing but
#: reach)
PREFETCH_LINE = 128


def prefetching() -> bool:
    """``YIRAGE_PK_PREFETCH=0`` renders the staged GEMVs without their weight prefetch (to compare the two)."""
    return os.environ.get("YIRAGE_PK_PREFETCH", "1").strip() != "0"


def _prefetch(r: Renderer, k: int, n: int, w_dtype: str) -> list[str]:
    """Before a staged GEMV computes its input, each slice asks for its weight row's cache lines (lane l: lines l,
    l + width, ...), so the weights' DRAM latency runs under the stage's (an RMSNorm's reads and tree, or silu_mul)
    instead of after it; the GEMV's own loads then find the lines in L2. A hint only: no value changes. On an H100
    a staged GEMV took 4-5 us against 2.7 for an unstaged one of the same size (torch.profiler), with 5-14% of
    the DRAM bandwidth in use (Nsight Compute)."""
    if not r.d.prefetch or not prefetching() or w_dtype not in _BYTES:
        return []
    rows, width, _ = slice_shape(r.d, r.group, r.p.batch)
    line = PREFETCH_LINE // _BYTES[w_dtype]  # elements a line holds
    it, (_, grp, lid) = r.it, r.ids()
    return ["{", f"    {it} pn = ({it}){grp} * {rows} + ({it}){lid} / {width};",
            f"    if (pn < {n}) {{",
            f"        for ({it} pc = ({it})({lid} % {width}) * {line}; pc < {k}; pc += {width * line}) {{",
            f"            {r.d.prefetch.format(p='w', i=f'pn * {k} + pc')};",
            "        }", "    }", "}"]


def _columns(r: Renderer, k: int, n: int, batch: int) -> tuple[list[str], int, int]:
    """CPU layout: one work-item per column; the body ends inside ``for b`` with the column's sum in ``s``."""
    lanes, f32, it = r.lanes, r.f32, r.it
    body = [
        f"{it} n = {r.ids()[0]};", f"if (n >= {n}) return;",
        f"{f32} acc[{batch * lanes}];",
        f"for (int q = 0; q < {batch * lanes}; q++) acc[q] = {r.f(0)};",
        f"{it} c = 0;",
        f"for (; c + {lanes} <= {k}; c += {lanes}) {{",
        f"    for (int u = 0; u < {lanes}; u++) {{",
        f"        {f32} wv = READ(w, n * {k} + c + u);",
        f"        for (int b = 0; b < {batch}; b++) acc[b * {lanes} + u] = acc[b * {lanes} + u] + "
        f"x[b * {k} + c + u] * wv;",
        "    }",
        "}",
        f"for (; c < {k}; c++) {{",
        f"    {f32} wv = READ(w, n * {k} + c);",
        f"    for (int b = 0; b < {batch}; b++) acc[b * {lanes}] = acc[b * {lanes}] + x[b * {k} + c] * wv;",
        "}",
        "{",
        f"    for (int b = 0; b < {batch}; b++) {{",
        f"        {f32} s = {r.f(0)};",
        f"        for (int u = 0; u < {lanes}; u++) s = s + acc[b * {lanes} + u];",
    ]
    return body, -(-n // COLUMNS_PER_GROUP), COLUMNS_PER_GROUP


def slice_shape(d: Dialect, group: int, batch: int) -> tuple[int, int, bool]:
    """(rows per work-group, threads per row, by shuffles) of the GPU layout for work-groups of ``group``."""
    if d.shuffle_xor and d.shuffle_width and group >= d.shuffle_width:
        return group // d.shuffle_width, d.shuffle_width, True
    width = min(SLICE, group)
    rows = group // width
    while rows * width * batch > MAX_LOCAL_FLOATS and rows * width > 1:  # fewer rows first, then narrower rows
        rows, width = (rows // 2, width) if rows > 1 else (rows, width // 2)
    return rows, width, False


def _slices(r: Renderer, k: int, n: int, batch: int, w_dtype: str, x_dtype: str) -> tuple[list[str], int, int]:
    """GPU layout: a slice of threads per row; the body ends inside ``for b`` with the row's sum in ``s``."""
    d, f32, it = r.d, r.f32, r.it
    rows, width, shuffles = slice_shape(d, r.group, batch)
    local = rows * width
    _, grp, lid = r.ids()
    body = [f"{it} lid = {lid};", f"{it} n = ({it}){grp} * {rows} + lid / {width};",
            f"int lane = (int)(lid % {width});",
            f"{f32} acc[{batch}];", f"for (int b = 0; b < {batch}; b++) acc[b] = {r.f(0)};",
            f"if (n < {n}) {{"]
    scalar = [f"for ({it} c = lane; c < {k}; c += {width}) {{",
              f"    {f32} wv = READ(w, n * {k} + c);",
              f"    for (int b = 0; b < {batch}; b++) acc[b] = acc[b] + READ(x, b * {k} + c) * wv;",
              "}"]
    wide, xwide = _fits(d, w_dtype, k), _fits(d, x_dtype, k) if x_dtype == "float32" else None
    if wide is None:
        body += [f"    {line}" for line in scalar]
    else:
        if xwide is not None and wide.width % xwide.width:
            xwide = None
        vector = _wide_loop(r, k, batch, width, wide, xwide)
        tests = [d.aligned.format(p=p, n=ld.align) for p, ld in (("w", wide), ("x", xwide)) if ld and ld.align]
        if tests:
            body += [f"    if ({' && '.join(tests)}) {{", *(f"        {line}" for line in vector), "    } else {",
                     *(f"        {line}" for line in scalar), "    }"]
        else:
            body += [f"    {line}" for line in vector]
    body.append("}")
    if shuffles:  # every lane holds the same total after the butterfly (a + b == b + a, bit for bit)
        total = "acc[b]"
        body += [f"for (int m = {width // 2}; m > 0; m >>= 1) {{",
                 f"    for (int b = 0; b < {batch}; b++) acc[b] = acc[b] + {d.shuffle_xor.format(v='acc[b]', m='m')};",
                 "}"]
    else:
        total = f"red[b * {local} + lid]"
        body = [f"{d.local} {f32} red[{batch * local}];", *body,
                f"for (int b = 0; b < {batch}; b++) red[b * {local} + lid] = acc[b];", d.barrier,
                f"for (int h = {width // 2}; h > 0; h >>= 1) {{",
                "    if (lane < h) {",
                f"        for (int b = 0; b < {batch}; b++) red[b * {local} + lid] = red[b * {local} + lid] + "
                f"red[b * {local} + lid + h];",
                "    }",
                f"    {d.barrier}",
                "}"]
    body += [f"if (n < {n} && lane == 0) {{", f"    for (int b = 0; b < {batch}; b++) {{",
             f"        {f32} s = {total};"]
    return body, -(-n // rows), local


def _fits(d: Dialect, dtype: str, k: int) -> WideLoad | None:
    """The dialect's wide load of ``dtype`` where rows of ``k`` elements split into whole loads, each aligned
    when the row's buffer is (else None: scalar loads)."""
    load = d.wide_loads.get(dtype)
    if load is None or k % load.width or (load.align and load.width * _BYTES[dtype] % load.align):
        return None
    return load


def _wide_loop(r: Renderer, k: int, batch: int, width: int, wide: WideLoad, xwide: WideLoad | None) -> list[str]:
    """Row ``n``'s elements in wide loads: rounds of ``UNROLL`` loads per thread in a loop, then one round with the
    loop's remainder and, where ``K`` is not a multiple of what a load of the whole slice covers, a last load for
    the first threads (its address clamped into the row so that it issues with the others, its products guarded).
    """
    v = wide.width
    span = width * v  # elements one load of every thread of the slice covers
    full, rest = divmod(k, span)
    chunk = min(full, UNROLL, max(1, LOAD_BUDGET // batch))
    trips = full // chunk if chunk else 0
    lines: list[str] = []
    if trips > 1:
        loads = [(_plus("c0", u * span), "") for u in range(chunk)]
        lines += [f"for (int j = 0; j < {trips * chunk}; j += {chunk}) {{",
                  f"    int c0 = j * {span} + lane * {v};", *_round(r, k, batch, loads, wide, xwide), "}"]
    first = trips * chunk if trips > 1 else 0
    loads = [(_plus(f"lane * {v}", u * span), "") for u in range(first, full)]
    if rest:  # a multiple of the load width: the first rest / v threads take one more load
        loads.append((f"{full * span} + (lane * {v} < {rest} ? lane * {v} : 0)", f"lane * {v} < {rest}"))
    if loads:
        lines += ["{", *_round(r, k, batch, loads, wide, xwide), "}"]
    return lines


def _plus(expr: str, offset: int) -> str:
    return f"{expr} + {offset}" if offset else expr


def _round(r: Renderer, k: int, batch: int, loads: list[tuple[str, str]], wide: WideLoad,
           xwide: WideLoad | None) -> list[str]:
    """Wide loads of row ``n`` at the offsets ``loads`` gives (with the condition under which each counts), all
    issued before any is used, then every batch row's products with them in element order (indented one level
    for the caller's block)."""
    lines = [wide.load.format(o=f"w{u}", p="w", i=f"n * {k} + {at}") for u, (at, _) in enumerate(loads)]
    lines.append(f"for (int b = 0; b < {batch}; b++) {{")
    for u, (at, guard) in enumerate(loads):
        pad = "        " if guard else "    "
        if guard:
            lines.append(f"    if ({guard}) {{")
        if xwide is None:
            xs = [f"READ(x, b * {k} + {at} + {e})" for e in range(wide.width)]
        else:
            xs = []
            for q in range(wide.width // xwide.width):
                lines.append(pad + xwide.load.format(o=f"x{u}_{q}", p="x", i=_plus(f"b * {k} + {at}", q * xwide.width)))
                xs += [e.format(o=f"x{u}_{q}") for e in xwide.elements]
        lines += [f"{pad}acc[b] = acc[b] + {xe} * {we.format(o=f'w{u}')};"
                  for xe, we in zip(xs, wide.elements, strict=True)]
        if guard:
            lines.append("    }")
    lines.append("}")
    return [f"    {line}" for line in lines]
