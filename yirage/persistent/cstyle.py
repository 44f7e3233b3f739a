"""A PersistentProgram's task bodies as C-family kernels, for runtimes that enqueue one step as kernels.

``render_persistent(program, dialect)`` spells every layer of a frozen
PersistentProgram (``yirage.persistent.program``) as one or two kernels in a
``Dialect`` (OpenCL C, CUDA C, HIP, Metal) and returns them with the launch
order of one decode step: ``begin`` (which rows are still decoding, token ids
in range), the layers in index order, ``commit`` (append the picked token,
advance ``step``) and ``begin`` again, so the host reads one small control
buffer per step. Layers are read through their descriptor rows (the named
columns of ``yirage.persistent.specs``), shapes are baked in as constants,
and layers with equal shapes and dtypes share one kernel.

Work split: GEMV layers run a slice of a work-group's threads per output
row, every batch row at once (``cstyle_gemv``: wide coalesced loads, warp
shuffles where the dialect has them); an RMSNorm before a GEMV runs inside
it (each work-group stages the normalized rows in local memory) where they
fit, else one work-group per row; attention one work-group per query head
(slices of up to 16 threads take the cached positions, their lanes split
each key's columns, several positions in flight a thread; then the head's
columns), which also rotates the new key and, for float32 caches, stores the
new key/value itself (16-bit caches: a kernel before it stores them); argmax one
work-group per row, or per chunk of a long row and then one per row over
the chunks' partials; sampling one work-item per row. Loops over memory
issue ``ILP`` loads before using one (a GPU issues in order). The first
H100 profile of a SmolLM2-shaped decode (launched runtime, per call:
attention 25 us, RMSNorm 5 us, argmax 74 us, a GEMV 3 us) is why; the
attention's split of positions over lane slices took a decode from 1.39 to
0.91 ms/token there (benchmark/device_decode.py, 2026-11-27).

The math follows the reference runtime: float32 compute,
weights widened from bfloat16/float16 as they load, IEEE (no fast math, no
contraction), NaN-propagating max, first index on argmax ties.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from yirage.codegen.dialect import Dialect
from yirage.codegen.emit import ILP, Emitter, ilp_loop
from yirage.errors import NotSupportedError
from yirage.persistent import control, cstyle_gemv, cstyle_sample
from yirage.persistent.control import Ctl, CtlError
from yirage.persistent.cstyle_buffers import CTL, SCORES, STEP, XS, PKLaunch, tensor_name
from yirage.persistent.program import PersistentProgram
from yirage.persistent.runtime import NO_SCREEN, SINGLE_DEVICE, TaskBodies
from yirage.persistent.specs import FloatCol, IntCol

RENDERER_VERSION = "2"
GROUP = 64  # work-group size of GEMV, norm and argmax kernels (a power of two)
#: argmax elements per work-group of its first pass (the partial maxima of a row's chunks; a second pass picks)
ARGMAX_CHUNK = GROUP * ILP



@dataclass(frozen=True)
class PKRendered:
    source: str
    begin: PKLaunch
    layers: tuple[PKLaunch, ...]  # one step's layer kernels in order
    commit: PKLaunch
    scratch: dict[str, int]  # XS / SCORES: float32 elements the runtime allocates
    ctl_size: int
    ctypes: dict[str, str] = field(default_factory=dict)  # buffer -> its element type as the kernels declare it

    @property
    def step(self) -> tuple[PKLaunch, ...]:
        """What one decode step enqueues: the layers, commit, and the next step's begin."""
        return (*self.layers, self.commit, self.begin)



def _f(value: float, d: Dialect) -> str:
    """A float32 literal of ``value`` (rounded to float32 first, so every dialect reads the same number)."""
    v = float(np.float32(value))
    if math.isinf(v):
        return f"({'-' if v < 0 else ''}{d.infinity['float32']})"
    return repr(v) + d.float_suffix


class _Renderer:
    def __init__(self, program: PersistentProgram, d: Dialect, group: int, lanes: int) -> None:
        self.p, self.d, self.group, self.lanes = program, d, group, lanes
        self.emit = Emitter()
        self.bodies: dict[str, str] = {}  # kernel text (name elided) -> kernel name: equal layers share one
        self.dtypes = {tensor_name(t.index): t.dtype for t in program.tensors}
        self.dtypes.update({CTL: "int64", STEP: "int64", XS: "float32", SCORES: "float32"})
        self.scratch = {XS: 1, SCORES: 1}
        self.it = d.index_type
        self.f32 = d.types["float32"]
        self.i64 = d.types["int64"]

    # -- spellings ------------------------------------------------------------------
    def ctype(self, dtype: str) -> str:
        if dtype in self.d.narrow:
            return self.d.narrow[dtype][0]
        return self.d.types[dtype]

    def f(self, value: float) -> str:
        return _f(value, self.d)

    def col(self, layer: int, column: IntCol) -> int:
        return self.p.descriptors.int_value(layer, column)

    def fcol(self, layer: int, column: FloatCol) -> float:
        return self.p.descriptors.float_value(layer, column)

    def arg(self, layer: int, role: str) -> str:
        """The buffer of input ``role`` of ``layer``, found through its descriptor row."""
        spec = self.p.layers[layer].spec
        return tensor_name(self.col(layer, spec.column(role)))

    # -- kernels ----------------------------------------------------------------------
    def kernel(self, base: str, params: Sequence[tuple[str, str, bool]], body: list[str], groups: int,
               local: int, layer: int = -1) -> PKLaunch:
        """Declare a kernel (``params``: parameter name, buffer, written) unless an equal one exists.

        Inside ``body``, parameter names spell the buffers; ``READ(p, i)`` widens narrow loads.
        """
        d = self.d
        decls = [d.param(i, self.ctype(self.dtypes[buf]), name, written)
                 for i, (name, buf, written) in enumerate(params)] + list(d.id_params)
        dtypes = {name: self.dtypes[buf] for name, buf, _ in params}
        lines = [self._reads(line, dtypes) for line in body]
        text = f"{d.kernel} {d.launch_bounds(local)}@({', '.join(decls)}) {{\n" + "".join(
            f"    {line}\n" for line in lines) + "}\n"
        name = self.bodies.get(text)
        if name is None:
            name = f"{base}_{len(self.bodies)}"
            self.bodies[text] = name
            self.emit("")
            for line in text.replace("@(", f"{name}(", 1).rstrip("\n").splitlines():
                self.emit(line)
        return PKLaunch(name, tuple(buf for _, buf, _ in params), groups, local, layer=layer)

    def _reads(self, line: str, dtypes: dict[str, str]) -> str:
        """Replace every ``READ(p, i)`` with the dialect's load of parameter ``p`` (widened to float)."""
        while "READ(" in line:
            start = line.index("READ(")
            depth, end = 0, start + 4
            for end in range(start + 4, len(line)):
                depth += {"(": 1, ")": -1}.get(line[end], 0)
                if depth == 0:
                    break
            p, _, i = line[start + 5:end].partition(", ")
            dtype = dtypes.get(p, "float32")  # not a parameter: a float32 array of the kernel's own (local memory)
            load = self.d.narrow[dtype][1].format(p=p, i=i) if dtype in self.d.narrow else f"{p}[{i}]"
            line = line[:start] + load + line[end + 1:]
        return line

    def ids(self) -> tuple[str, str, str]:
        return self.d.ids["global"], self.d.ids["group"], self.d.ids["local"]

    def tree(self, local: int, combine: list[str]) -> list[str]:
        """A local-memory tree reduction over ``local`` threads; ``combine`` folds slot lid + h into lid."""
        lines = [self.d.barrier, f"for (int h = {local // 2}; h > 0; h >>= 1) {{", "    if (lid < h) {"]
        lines += [f"        {c}" for c in combine]
        return lines + ["    }", f"    {self.d.barrier}", "}"]

    @staticmethod
    def pairwise(names: list[str]) -> str:
        """The sum of ``names`` as a balanced tree of additions (a fixed order: the same bits on every device)."""
        while len(names) > 1:
            names = [f"({a} + {b})" for a, b in zip(names[::2], names[1::2], strict=False)] + (
                [names[-1]] if len(names) % 2 else [])
        return names[0]

    def begin(self) -> PKLaunch:
        p, it = self.p, self.it
        vocab = p.vocab
        tok_cols = p.tokens.shape[1]
        eos = "".join(f" && tok != {e}" for e in p.eos_token_ids)
        body = [
            f"if ({self.ids()[0]} != 0) return;",
            f"{self.i64} alive = 0;",
            f"for ({it} b = 0; b < {p.batch}; b++) {{",
            f"    {self.i64} pos = step[b];",
            f"    {self.i64} tok = tokens[b * {tok_cols} + pos];",
            f"    {self.i64} ok = (pos + 1 < {p.max_seq_length}{eos}) ? 1 : 0;",
            f"    ctl[{Ctl.ACTIVE} + b] = ok;",
            "    alive += ok;",
        ]
        if vocab is not None:
            error = f"ctl[{Ctl.ERROR}] = {CtlError.TOKEN}; ctl[{Ctl.ERR_ROW}] = b; ctl[{Ctl.ERR_VALUE}] = tok;"
            body += [f"    if ((tok < 0 || tok >= {vocab}) && ctl[{Ctl.ERROR}] == 0) {{", f"        {error}", "    }"]
        body += ["}", f"ctl[{Ctl.ALIVE}] = alive;"]
        params = [("ctl", CTL, True), ("tokens", tensor_name(p.tokens_id), False), ("step", STEP, False)]
        return self.kernel("y_begin", params, body, 1, 1)

    def commit(self) -> PKLaunch:
        p = self.p
        tok_cols = p.tokens.shape[1]
        body = [
            f"{self.it} b = {self.ids()[0]};",
            f"if (b >= {p.batch}) return;",
            f"if (ctl[{Ctl.ACTIVE} + b] != 0) {{",
            f"    tokens[b * {tok_cols} + step[b] + 1] = ({self.i64})picked[b];",
            "    step[b] = step[b] + 1;",
            "}",
            f"if (b == 0 && ctl[{Ctl.ALIVE}] > 0) ctl[{Ctl.STEPS}] = ctl[{Ctl.STEPS}] + 1;",
        ]
        params = [("tokens", tensor_name(p.tokens_id), True), ("step", STEP, True), ("ctl", CTL, True),
                  ("picked", tensor_name(p.pick_id), False)]
        return self.kernel("y_commit", params, body, p.batch, 1)

    # -- layers -------------------------------------------------------------------------
    def embed(self, i: int) -> list[PKLaunch]:
        p, it = self.p, self.it
        n = self.col(i, IntCol.N)
        rows = p.layers[i].inputs["weight"].dims[0]
        total = p.batch * n
        body = [
            f"{it} gid = {self.ids()[0]};", f"if (gid >= {total}) return;",
            f"{it} b = gid / {n};", f"{it} c = gid - b * {n};",
            f"{self.i64} tok = tokens[b * {p.tokens.shape[1]} + step[b]];",
            f"out[gid] = (tok < 0 || tok >= {rows}) ? {self.f(0)} : READ(w, tok * {n} + c);",
        ]
        params = [("out", tensor_name(self.col(i, IntCol.OUTPUT)), True), ("tokens", tensor_name(p.tokens_id), False),
                  ("step", STEP, False), ("w", self.arg(i, "weight"), False)]
        return [self.kernel("y_embed", params, body, -(-total // GROUP), GROUP, i)]

    def rmsnorm(self, i: int, x: str, k: int) -> PKLaunch:
        """XS = rmsnorm(x) * weight_norm, one work-group per batch row (``cstyle_gemv.norm_row``)."""
        g = self.group
        self.scratch[XS] = max(self.scratch[XS], self.p.batch * k)
        _, grp, lid = self.ids()
        body = [f"{self.d.local} {self.f32} red[{g}];", f"{self.it} b = {grp};", f"{self.it} lid = {lid};",
                *cstyle_gemv.norm_row(self, k, self.fcol(i, FloatCol.EPS), "x", "xs", "red")]
        params = [("xs", XS, True), ("x", x, False), ("gamma", self.arg(i, "weight_norm"), False)]
        return self.kernel("y_rmsnorm", params, body, self.p.batch, g, i)

    def gemv(self, i: int, x: str, k: int, weight: str, bias: str | None, residual: str | None) -> PKLaunch:
        """out[b, n] = x[b] . W[n] (+ bias[n]) (+ residual[b, n]): see ``cstyle_gemv``."""
        return cstyle_gemv.gemv(self, i, x, k, weight, bias, residual)

    def rmsnorm_linear(self, i: int) -> list[PKLaunch]:
        k = self.col(i, IntCol.K)
        has_bias = self.col(i, self.p.layers[i].spec.column("bias")) >= 0
        bias = self.arg(i, "bias") if has_bias else None
        if cstyle_gemv.stages(self, k, self.col(i, IntCol.N)):
            stage = cstyle_gemv.Stage("rmsnorm", self.arg(i, "weight_norm"), self.fcol(i, FloatCol.EPS))
            return [cstyle_gemv.gemv(self, i, self.arg(i, "input"), k, self.arg(i, "weight_linear"), bias, None, stage)]
        return [self.rmsnorm(i, self.arg(i, "input"), k), self.gemv(i, XS, k, self.arg(i, "weight_linear"), bias, None)]

    def linear_with_residual(self, i: int) -> list[PKLaunch]:
        return [self.gemv(i, self.arg(i, "input"), self.col(i, IntCol.K), self.arg(i, "weight"), None,
                          self.arg(i, "residual"))]

    def silu_mul_linear_with_residual(self, i: int) -> list[PKLaunch]:
        k, batch = self.col(i, IntCol.K), self.p.batch
        if cstyle_gemv.stages(self, k, self.col(i, IntCol.N)):
            return [cstyle_gemv.gemv(self, i, self.arg(i, "input"), k, self.arg(i, "weight"), None,
                                     self.arg(i, "residual"), cstyle_gemv.Stage("silu_mul"))]
        self.scratch[XS] = max(self.scratch[XS], batch * k)
        it, f32 = self.it, self.f32
        body = [
            f"{it} gid = {self.ids()[0]};", f"if (gid >= {batch * k}) return;",
            f"{it} b = gid / {k};", f"{it} c = gid - b * {k};",
            f"{f32} a = gu[b * {2 * k} + c];",
            f"xs[gid] = {cstyle_gemv.silu_mul(self, 'a', f'gu[b * {2 * k} + {k} + c]')};",
        ]
        params = [("xs", XS, True), ("gu", self.arg(i, "input"), False)]
        prep = self.kernel("y_silu_mul", params, body, -(-(batch * k) // GROUP), GROUP, i)
        return [prep, self.gemv(i, XS, k, self.arg(i, "weight"), None, self.arg(i, "residual"))]

    def _rope(self, d: int, src: str) -> list[str]:
        """``rot`` = ``src`` rotated at position ``pos`` for element ``c`` (rotate-half pairs)."""
        h = d // 2
        return [f"{self.f32} x0 = qkv[{src} + c];",
                f"{self.f32} x1 = c < {h} ? -qkv[{src} + c + {h}] : qkv[{src} + c - {h}];",
                f"{self.f32} rot = x0 * READ(cos, pos * {d} + c) + x1 * READ(sin, pos * {d} + c);"]

    def attention(self, i: int) -> list[PKLaunch]:
        p, it, f32 = self.p, self.it, self.f32
        kv, grp_size, d = (self.col(i, c) for c in (IntCol.KV_HEADS, IntCol.GROUP, IntCol.HEAD_DIM))
        seq, n_out = self.col(i, IntCol.CACHE_SEQ), self.col(i, IntCol.N)
        width = (grp_size + 2) * d
        batch = p.batch
        total = batch * kv * d
        qkv, kc, vc = self.arg(i, "input"), self.arg(i, "k_cache"), self.arg(i, "v_cache")
        cos, sin = self.arg(i, "cos"), self.arg(i, "sin")
        store = [f"{it} at = ((b * {kv} + g) * {seq} + pos) * {d} + c;"]
        for cache, value in (("kc", "rot"), ("vc", f"qkv[base + {(grp_size + 1) * d} + c]")):
            dtype = self.dtypes[kc if cache == "kc" else vc]
            if dtype in self.d.narrow:
                store.append(self.d.narrow[dtype][2].format(p=cache, i="at", v=value) + ";")
            else:
                store.append(f"{cache}[at] = {value};")
        body = [
            f"{it} gid = {self.ids()[0]};", f"if (gid >= {total}) return;",
            f"{it} b = gid / {kv * d};", f"{it} r = gid - b * {kv * d};",
            f"{it} g = r / {d};", f"{it} c = r - g * {d};",
            f"{self.i64} pos = step[b];",
            f"{it} base = b * {kv * width} + g * {width};",
            *self._rope(d, f"base + {grp_size * d}"),
            *store,
        ]
        params = [("kc", kc, True), ("vc", vc, True), ("qkv", qkv, False), ("step", STEP, False),
                  ("cos", cos, False), ("sin", sin, False)]
        # float32 caches: each query head's work-group rotates the new key itself and the first of its KV group
        # stores it, so no kernel (no grid barrier) runs before the attention; a 16-bit cache keeps y_kv_store,
        # whose store rounds what the attention then reads
        fused = not {self.dtypes[kc], self.dtypes[vc]} & set(self.d.narrow)
        launches = [] if fused else [self.kernel("y_kv_store", params, body, -(-total // GROUP), GROUP, i)]
        heads = batch * kv * grp_size
        self.scratch[SCORES] = max(self.scratch[SCORES], heads * seq)
        if not self.d.barrier_global:
            raise NotSupportedError(f"the {self.d.name} dialect spells no barrier over global memory; the "
                                    "PersistentKernel's attention needs one")
        g = self.group
        _, grp, lid = self.ids()
        scale = self.f(1.0 / math.sqrt(d))
        nan_max = "(red[lid + h] > red[lid] || red[lid + h] != red[lid + h]) ? red[lid + h] : red[lid]"
        lanes = self._score_lanes(d)
        body = [  # one work-group per query head: slices of its threads split the positions, then the head's columns
            f"{self.d.local} {f32} qs[{d}];", f"{self.d.local} {f32} red[{g}];",
            f"{it} gid = {grp};", f"{it} lid = {lid};",
            f"{it} b = gid / {kv * grp_size};", f"{it} r = gid - b * {kv * grp_size};",
            f"{it} g = r / {grp_size};", f"{it} j = r - g * {grp_size};",
            f"{self.i64} pos = step[b];",
            f"{it} base = b * {kv * width} + g * {width} + j * {d};",
            *(f"{self.d.local} {f32} {name}[{d}];" for name in (("ks", "vs") if fused else ())),
            f"for ({it} c = lid; c < {d}; c += {g}) {{",
            *(f"    {line}" for line in self._rope(d, "base")),
            "    qs[c] = rot;",
            "}",
            *([f"for ({it} c = lid; c < {d}; c += {g}) {{",
               *(f"    {line}" for line in self._new_kv(kv, grp_size, d, seq, width)), "}"] if fused else []),
            self.d.barrier,
            f"{it} kb = (b * {kv} + g) * {seq * d};",
            f"{it} sb = gid * {seq};",
            f"{f32} mx = {self.f(-math.inf)};",
            *self._scores(d, lanes, scale, fused),
            "red[lid] = mx;",
            *self.tree(g, [f"red[lid] = {nan_max};"]),
            "mx = red[0];",
            self.d.barrier,
            f"{f32} tot = {self.f(0)};",
            f"for ({it} s = lid; s <= pos; s += {g}) {{ {f32} e = {self.d.math['exp']}(sc[sb + s] - mx); "
            "sc[sb + s] = e; tot = tot + e; }",
            "red[lid] = tot;",
            *self.tree(g, ["red[lid] = red[lid] + red[lid + h];"]),
            "tot = red[0];",
            # each thread turns the exp(score)s it stored into probabilities (what softmax returns) once, so the
            # columns' loop below multiplies, with no division per position and column
            f"for ({it} s = lid; s <= pos; s += {g}) sc[sb + s] = sc[sb + s] / tot;",
            self.d.barrier_global,  # every thread's probabilities stored before any thread reads them all
            f"{it} ob = b * {n_out} + (g * {grp_size} + j) * {d};",
            f"for ({it} c = lid; c < {d}; c += {g}) {{",
            f"    {f32} o = {self.f(0)};",
            *(f"    {line}" for line in self._rounds(
                "s", "pos + 1", 1, 2 * ILP,
                lambda u, s: [f"{f32} p{u} = {s} <= pos ? sc[sb + {s}] : {self.f(0)};",
                              f"{f32} v{u} = {self._cached('vc', 'vs', s, 'c', d, fused)};"],
                lambda u, s: [f"if ({s} <= pos) o = o + p{u} * v{u};"])),
            "    out[ob + c] = o;",
            "}",
            *([f"if (j == {grp_size - 1}) {{",
               f"    for ({it} c = lid; c < {d}; c += {g}) {{",
               f"        {it} at = ((b * {kv} + g) * {seq} + pos) * {d} + c; kc[at] = ks[c]; vc[at] = vs[c];",
               "    }", "}"] if fused else []),
        ]
        params = [("out", tensor_name(self.col(i, IntCol.OUTPUT)), True), ("sc", SCORES, True),
                  ("qkv", qkv, False), ("kc", kc, fused), ("vc", vc, fused), ("step", STEP, False),
                  ("cos", cos, False), ("sin", sin, False)]
        launches.append(self.kernel("y_attention", params, body, heads, g, i))
        return launches

    def _score_lanes(self, d: int) -> int:
        """Threads per cached position in the attention's scores: 1 on CPU devices (``lanes`` > 0: a work-item is a
        loop there); else up to 16 that split the key's columns (coalesced loads, several positions in flight per
        thread, summed by shuffles or a local tree). 64 threads, one a position, took 25 us a call on an H100 at
        80 positions: each read its key row 8 loads at a time."""
        if self.lanes:
            return 1
        width = 1
        while width < 16 and d % (2 * width) == 0 and self.group % (2 * width) == 0:
            width *= 2
        return width

    def _cached(self, cache: str, new: str, s: str, c: str, d: int, fused: bool) -> str:
        """Column ``c`` of position ``s`` of a cache, 0 past ``pos``; with float32 caches fused, position ``pos``
        is still in local ``new`` (ks / vs), stored into the cache at the kernel's end."""
        load = f"READ({cache}, kb + {s} * {d} + {c})"
        if fused:
            return f"({s} < pos ? {load} : ({s} == pos ? {new}[{c}] : {self.f(0)}))"
        return f"({s} <= pos ? {load} : {self.f(0)})"

    def _rounds(self, var: str, count: str, stride: int | str, per: int, values, fold) -> list[str]:  # noqa: ANN001
        """``for (var = 0; var < count; var += stride)`` as rounds of ``per`` iterations, each round's ``values``
        (loads) before its ``fold``s in iteration order: the plain loop's result, bit for bit. Past ``count`` the
        loads are predicated off, so a short tail costs one round, not one round trip per iteration; every thread
        of a work-group runs the same number of rounds when ``count`` is the same for all (shuffles need that)."""
        it = self.it
        lines = [f"for ({it} {var} = 0; {var} < {count}; {var} += {per} * {stride}) {{"]
        lines += [f"    {it} {var}_{u} = {var} + {u} * {stride};" for u in range(per)]
        for u in range(per):
            lines += [f"    {line}" for line in values(u, f"{var}_{u}")]
        for u in range(per):
            lines += [f"    {line}" for line in fold(u, f"{var}_{u}")]
        return lines + ["}"]

    def _scores(self, d: int, lanes: int, scale: str, fused: bool) -> list[str]:
        """Each position's scaled q.k into ``sc`` and the thread's running max into ``mx``. Slice ``q`` of
        ``lanes`` threads takes positions q, q + slices, ...; its lanes split the columns (lane + m * lanes)
        and sum their partials by a butterfly of shuffles, or a local-memory tree where the dialect has none:
        either way every lane ends with the same sum, in the same order."""
        it, f32, g = self.it, self.f32, self.group
        slices, cols = g // lanes, d // lanes
        per = max(1, 2 * ILP // cols)  # positions a round: about 16 loads in flight a thread
        shuffles = lanes > 1 and bool(self.d.shuffle_xor) and lanes <= self.d.shuffle_width

        def values(u: int, s: str) -> list[str]:
            return [f"{f32} k{u}_{m} = {self._cached('kc', 'ks', s, f'lane + {m * lanes}', d, fused)};"
                    for m in range(cols)]

        def fold(u: int, s: str) -> list[str]:
            return [f"{f32} a{u} = {self.f(0)};", *(f"a{u} = a{u} + qs[lane + {m * lanes}] * k{u}_{m};"
                                                   for m in range(cols))]

        lines = [f"int lane = (int)(lid % {lanes});", f"{it} q = lid / {lanes};"]
        if lanes > 1 and not shuffles:
            lines.append(f"{self.d.local} {f32} part[{per * g}];")
        body = self._rounds("s", "pos + 1", slices, per, lambda u, s: values(u, f"(q + {s})"),
                            lambda u, s: fold(u, f"(q + {s})"))
        reduce: list[str] = []
        if shuffles:
            reduce = [f"for (int m = {lanes // 2}; m > 0; m >>= 1) {{",
                      *(f"    a{u} = a{u} + {self.d.shuffle_xor.format(v=f'a{u}', m='m')};" for u in range(per)),
                      "}"]
        elif lanes > 1:
            reduce = [*(f"part[{u * g} + lid] = a{u};" for u in range(per)), self.d.barrier,
                      f"for (int h = {lanes // 2}; h > 0; h >>= 1) {{", "    if (lane < h) {",
                      *(f"        part[{u * g} + lid] = part[{u * g} + lid] + part[{u * g} + lid + h];"
                        for u in range(per)),
                      "    }", f"    {self.d.barrier}", "}",
                      *(f"a{u} = part[{u * g} + lid - lane];" for u in range(per)), self.d.barrier]
        keep = [f"if (s_{u} + q <= pos) {{ {f32} a = a{u} * {scale}; if (lane == 0) sc[sb + s_{u} + q] = a; "
                "mx = (a > mx || a != a) ? a : mx; }" for u in range(per)]
        return lines + body[:-1] + [f"    {line}" for line in reduce + keep] + ["}"]

    def _new_kv(self, kv: int, grp_size: int, d: int, seq: int, width: int) -> list[str]:
        """Column ``c`` of this row's new key (rotated) and value into local ``ks``/``vs``. The work-group of the KV
        group's last query head stores them into the float32 caches at ``pos`` at its end (read there from the next
        step on; no work-group reads the cache at ``pos`` in this step, and a test on PoCL, which runs work-groups
        about in order, sees the stale value if one does)."""
        it = self.it
        return ["{", f"    {it} nb = b * {kv * width} + g * {width} + {grp_size * d};",
                *(f"    {line}" for line in self._rope(d, "nb")),
                f"    ks[c] = rot; vs[c] = qkv[nb + {d} + c];",
                "}"]

    #: (va, ia) is replaced by (vb, ib) when (vb, ib) comes first in argmax's order: a NaN beats every number, the
    #: lower index wins a tie (equal values, or two NaNs), and an index < 0 is an empty slot
    TAKE = ("(ib >= 0 && (ia < 0 || (vb != vb && (va == va || ib < ia)) || "
            "(va == va && vb == vb && (vb > va || (vb == va && ib < ia)))))")

    def argmax(self, i: int) -> list[PKLaunch]:
        """The first index of each row's maximum (NaN-propagating). A row of more than ``ARGMAX_CHUNK`` logits
        takes two kernels: one work-group per chunk folds its elements (``ILP`` loads in flight per thread) into a
        (value, index) partial in SCORES, then one work-group per row picks among the partials; a vocabulary on
        one work-group's threads alone took 74 us on an H100."""
        vocab, g = self.col(i, IntCol.K), self.group
        it, f32, i64 = self.it, self.f32, self.i64
        out_name = tensor_name(self.col(i, IntCol.OUTPUT))
        out_type = self.ctype(self.dtypes[out_name])
        _, grp, lid = self.ids()
        parts = -(-vocab // ARGMAX_CHUNK)
        fold = ["if (bi < 0 || (bv == bv && (v{u} > bv || v{u} != v{u}))) {{ bv = v{u}; bi = {c}; }}"]
        tree = self.tree(g, [f"{f32} va = rv[lid]; {f32} vb = rv[lid + h]; {i64} ia = ri[lid]; {i64} ib = ri[lid + h];",
                             f"if {self.TAKE} {{ rv[lid] = vb; ri[lid] = ib; }}"])
        head = [f"{self.d.local} {f32} rv[{g}];", f"{self.d.local} {i64} ri[{g}];", f"{it} lid = {lid};",
                f"{f32} bv = {self.f(0)};", f"{i64} bi = -1;"]
        params = [("out", out_name, True), ("x", self.arg(i, "input"), False)]
        if parts == 1:
            body = [*head, f"{it} b = {grp};",
                    *ilp_loop(it, "c", "lid", vocab, g, lambda u, c: [f"{f32} v{u} = x[b * {vocab} + {c}];"],
                              lambda u, c: [line.format(u=u, c=c) for line in fold]),
                    "rv[lid] = bv;", "ri[lid] = bi;", *tree, f"if (lid == 0) out[b] = ({out_type})ri[0];"]
            return [self.kernel("y_argmax", params, body, self.p.batch, g, i)]
        if vocab >= 1 << 24:
            raise NotSupportedError(f"argmax over {vocab} logits: the partial maxima keep their index as a float32, "
                                    "exact below 2**24; decode with a smaller vocabulary or on the cpu backend")
        self.scratch[SCORES] = max(self.scratch[SCORES], self.p.batch * parts * 2)
        # pass 1: chunk p of row b, each thread ILP elements at once (its last ones clamped into the row, unused)
        loads = [f"{it} c{u} = cb + {u * g};" for u in range(ILP)]
        body = [*head, f"{it} b = {grp} / {parts};", f"{it} p = {grp} - b * {parts};",
                f"{it} cb = p * {ARGMAX_CHUNK} + lid;", *loads,
                *(f"{f32} v{u} = x[b * {vocab} + (c{u} < {vocab} ? c{u} : 0)];" for u in range(ILP)),
                *(f"if (c{u} < {vocab}) {fold[0].format(u=u, c=f'c{u}')}" for u in range(ILP)),
                "rv[lid] = bv;", "ri[lid] = bi;", *tree,
                f"if (lid == 0) {{ sc[({grp}) * 2] = rv[0]; sc[({grp}) * 2 + 1] = ({f32})ri[0]; }}"]
        first = self.kernel("y_argmax_parts", [("sc", SCORES, True), ("x", self.arg(i, "input"), False)], body,
                            self.p.batch * parts, g, i)
        # pass 2: row b's partials in chunk order (each keeps the first index of its chunk's maximum)
        body = [*head, f"{it} b = {grp};",
                f"for ({it} q = lid; q < {parts}; q += {g}) {{", f"    {f32} v = sc[(b * {parts} + q) * 2];",
                "    if (bi < 0 || (bv == bv && (v > bv || v != v))) {",
                f"        bv = v; bi = ({i64})sc[(b * {parts} + q) * 2 + 1];", "    }",
                "}",
                "rv[lid] = bv;", "ri[lid] = bi;", *tree, f"if (lid == 0) out[b] = ({out_type})ri[0];"]
        second = self.kernel("y_argmax", [("out", out_name, True), ("sc", SCORES, False)], body, self.p.batch, g, i)
        return [first, second]

    def sample(self, i: int) -> list[PKLaunch]:
        return cstyle_sample.sample(self, i)

    def render(self) -> PKRendered:
        d = self.d
        self.emit(f"// Generated by yirage's PersistentKernel renderer {RENDERER_VERSION} ({d.name}): "
                  f"{len(self.p.layers)} layers, batch {self.p.batch}.")
        for line in d.preamble.splitlines():
            self.emit(line)
        narrow = sorted({t.dtype for t in self.p.tensors} & set(d.narrow))
        missing = sorted({t.dtype for t in self.p.tensors if t.dtype.startswith("float")} - set(d.narrow)
                         - {k for k in d.types if k.startswith("float")})
        if missing:
            raise NotSupportedError(f"the {d.name} dialect cannot load {', '.join(missing)} tensors; convert the "
                                    "model's weights to float32, bfloat16 or float16")
        for dtype in narrow:
            for line in d.narrow_helpers.get(dtype, "").splitlines():
                self.emit(line)
        if self.p.tokens.shape[1] < 1:
            raise NotSupportedError("the tokens tensor has no columns")
        begin, layers = self.begin(), []
        for layer in self.p.layers:
            layers += TASKS.body(layer.kind)(self, layer.index)
        commit = self.commit()
        return PKRendered(self.emit.source(), begin, tuple(layers), commit, dict(self.scratch),
                          control.size(self.p.batch), {name: self.ctype(dt) for name, dt in self.dtypes.items()})


#: the C-family task bodies by LayerSpec kind; the runtimes that enqueue these kernels (OpenCL, CUDA) register
#: them under their own names (yirage.persistent.runtime.register_task_bodies)
TASKS = TaskBodies("C-family", {
    "embed": _Renderer.embed, "rmsnorm_linear": _Renderer.rmsnorm_linear, "attention": _Renderer.attention,
    "linear_with_residual": _Renderer.linear_with_residual,
    "silu_mul_linear_with_residual": _Renderer.silu_mul_linear_with_residual,
    "argmax": _Renderer.argmax, "sample": _Renderer.sample,
}, declined={**SINGLE_DEVICE, **NO_SCREEN},
   where="yirage.persistent.cstyle (a _Renderer method, named in cstyle.TASKS)")


def render_persistent(program: PersistentProgram, dialect: Dialect, group: int = GROUP,
                      lanes: int = 0) -> PKRendered:
    """The program's kernels in ``dialect`` and one step's launch order (see the module docstring).

    ``group`` is the work-group size of the reducing kernels (a power of two; a device's limit may need
    less). ``lanes`` > 0 picks the GEMV layout for CPU devices (see ``cstyle_gemv``).
    """
    if group < 1 or group & (group - 1):
        raise ValueError(f"group must be a power of two >= 1, got {group}")
    if lanes < 0:
        raise ValueError(f"lanes must be >= 0, got {lanes}")
    return _Renderer(program, dialect, group, lanes).render()
