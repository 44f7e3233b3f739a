"""One C-family renderer over ``KernelPlan``; a ``Dialect`` spells what differs per language.

``render(plan, dialect)`` returns the source of every kernel of the plan and,
per kernel, a ``Launch``: its work-group count and size, its arguments in
order (plan buffers, then scratch buffers the launcher allocates) and an
optional status check (``Rendered.steps``: the launches, and the ``Gemm``
steps a ``host_gemm`` dialect hands to the host's BLAS, in the order a call
runs them; see ``cstyle_matmul``). One work-item per output element (pointwise, embedding;
a pointwise kernel whose loads are all contiguous indexes them by the global
id alone, loop-free, so a CPU OpenCL compiler vectorizes across work-items),
a block of outputs per work-item for matmul (``cstyle_matmul``), one
work-group per row with a local-memory tree reduction (row kernels), one
work-item per (batch, head) (attention). Semantics follow the cpu backend:
IEEE (no fast math, no contraction), NaN-propagating max/min that return the
first operand on ties, rsqrt as ``1 / sqrt``; float32 exp is an inline
polynomial within 1 ulp (``exp_helper``) where the dialect spells an
int->float bit cast, the library's exp elsewhere; matmul sums in a fixed
order that may differ from a sequential loop. float16/bfloat16 graph tensors stay in their storage
type: kernels widen them to float32 as they load and round to nearest even as
they store (the dialect's ``narrow`` spellings); temporaries are float32.
``check_supported`` runs first: a plan the dialect cannot spell is refused
with every missing function and dtype named, before any text is produced.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from yirage.codegen import cstyle_matmul, indexing
from yirage.codegen.dialect import Dialect, check_supported
from yirage.codegen.emit import ILP, Emitter, ilp_loop
from yirage.codegen.exprs import STASH, Spelling, UnsupportedExprError, compute_type, row_stash, spell_expr
from yirage.codegen.indexing import IndexSyntax, broadcast_strides
from yirage.codegen.launch import Check, Gemm, Launch, Scratch
from yirage.compiler.kernel_ir import (
    Attention,
    Embedding,
    Expr,
    Kernel,
    KernelPlan,
    Load,
    Matmul,
    Pointwise,
    Row,
)
from yirage.compiler.schedule import Knob, choice
from yirage.graph.kernel_graph import contiguous_strides

RENDERER_VERSION = "3"  # 3: a row kernel stashes what its last sum and its output share (softmax exp)
GROUP = 64  # work-group size of element-wise kernels
FLAT_GROUP = 256  # work-group size of pointwise kernels over contiguous memory (PoCL vectorizes across them)
ROW_GROUP_MAX = 256  # work-group size of row kernels (a power of two, at most this) ...
ROW_GROUPS = (64, 128, 256, 512, 1024)  # ... and the sizes a search may pick instead (the ``group`` knob)
SUFFIX = {"float32": "f32", "float64": "f64", "int32": "i32", "int64": "i64"}


@dataclass(frozen=True)
class Rendered:
    """``launches``: every kernel of ``source``, in source order; ``steps``: what a call runs, in order.

    Without ``Gemm`` steps (every dialect but a ``host_gemm`` one with a large matmul) ``steps`` is
    ``launches``; with them, each Gemm's ``fallback`` kernel is in ``launches`` but not in ``steps``.
    """

    source: str
    launches: tuple[Launch, ...]
    scratch: tuple[Scratch, ...]
    steps: tuple[Launch | Gemm, ...] = ()


class _Renderer:
    def __init__(self, plan: KernelPlan, dialect: Dialect) -> None:
        self.plan, self.d = plan, dialect
        self.buffers = dict(plan.buffers)
        #: graph inputs and outputs stored as float16/bfloat16 (temporaries are kept at compute type)
        self.narrow = {n: b.dtype.name for n, b in plan.buffers.items()
                       if b.role != "temp" and b.dtype.name in ("float16", "bfloat16")}
        self.emit = Emitter()
        self.launches: list[Launch] = []
        self.steps: list[Launch | Gemm] = []
        self.scratch: list[Scratch] = []
        it = dialect.index_type
        self.ix = IndexSyntax(const=str, declare=lambda n, v: f"{it} {n} = {v};", assign=lambda n, v: f"{n} = {v};")

    # -- spellings ----------------------------------------------------------------
    def ctype(self, ct: str) -> str:
        return self.d.types[ct]

    def const(self, value: float, ct: str) -> str:
        if ct.startswith("int"):
            v = int(value)
            return f"({v + 1} - 1)" if v <= -(1 << 31) else str(v)
        if math.isinf(value):
            return f"({'-' if value < 0 else ''}{self.d.infinity[ct]})"
        text = repr(float(value))
        return text + (self.d.float_suffix if ct == "float32" else "")

    def table(self, ct: str) -> dict[str, Spelling]:
        m, s = self.d.math, SUFFIX[ct]
        table: dict[str, Spelling] = {
            "add": lambda a: f"({a[0]} + {a[1]})", "sub": lambda a: f"({a[0]} - {a[1]})",
            "mul": lambda a: f"({a[0]} * {a[1]})", "div": lambda a: f"({a[0]} / {a[1]})",
            "max": lambda a: f"y_max_{s}({a[0]}, {a[1]})", "min": lambda a: f"y_min_{s}({a[0]}, {a[1]})",
            "relu": lambda a: f"y_max_{s}({a[0]}, {self.const(0, ct)})",
            "square": lambda a: f"y_square_{s}({a[0]})", "neg": lambda a: f"(-{a[0]})",
        }
        if "exp" in m:
            table["exp"] = lambda a: f"{self.exp(ct)}({a[0]})"
            table["silu"] = lambda a: f"y_silu_{s}({a[0]})"
        if "sqrt" in m:
            table["sqrt"] = lambda a: f"{m['sqrt']}({a[0]})"
        if "pow" in m:
            table["pow"] = lambda a: f"{m['pow']}({a[0]}, {a[1]})"
        if "erf" in m:
            table["gelu"] = lambda a: f"y_gelu_{s}({a[0]})"
        return table

    def expr(self, e: Expr, load: Callable[[Load], str], ct: str) -> str:
        return spell_expr(e, load=load, var=lambda v: f"v_{v.name}", const=lambda c: self.const(c.value, ct),
                          table=self.table(ct), renderer=f"C-family ({self.d.name})")

    def helpers(self, cts: set[str]) -> None:
        emit, d = self.emit, self.d
        for ct in sorted(cts):
            t, s = self.ctype(ct), SUFFIX[ct]
            nan = " || b != b" if ct.startswith("float") else ""  # NaN-propagating; ties keep a
            emit(f"{d.inline} {t} y_max_{s}({t} a, {t} b) {{ return (b > a{nan}) ? b : a; }}")
            emit(f"{d.inline} {t} y_min_{s}({t} a, {t} b) {{ return (b < a{nan}) ? b : a; }}")
            emit(f"{d.inline} {t} y_square_{s}({t} a) {{ return a * a; }}")
            if ct == "float32" and self.exp(ct) == "y_exp_f32":
                self.exp_helper()
            if ct.startswith("float") and "exp" in d.math:
                emit(f"{d.inline} {t} y_silu_{s}({t} x) {{ return x / ({self.const(1, ct)} + {self.exp(ct)}(-x)); }}")
            if ct.startswith("float") and "erf" in d.math:
                emit(f"{d.inline} {t} y_gelu_{s}({t} x) {{ return {self.const(0.5, ct)} * x * ({self.const(1, ct)} "
                     f"+ {d.math['erf']}(x * {self.const(0.7071067811865476, ct)})); }}")

    def exp(self, ct: str) -> str:
        """float32 exp inline (vectorizable) when the dialect spells an int->float bit cast, else the library's."""
        return "y_exp_f32" if ct == "float32" and "int_as_float" in self.d.math else self.d.math["exp"]

    def exp_helper(self) -> None:
        """``y_exp_f32``: Cody-Waite reduction by ln 2, Cephes' degree-6 polynomial, 2^n as two exact scalings.

        Within 1 ulp of exp on [-104, 89] (subnormal results included); +inf above 88.7228394, +0 below
        -103.972084, NaN in -> NaN out. Plain arithmetic and selects only, so compilers vectorize it where a
        library ``exp`` call stays scalar (PoCL: 6x faster on W2).
        """
        f, bits, inline = (lambda v: self.const(v, "float32")), self.d.math["int_as_float"], self.d.inline
        poly = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                5.0000001201e-1)
        emit = self.emit
        with emit.block(f"{inline} float y_exp_f32(float x) {{"):
            emit(f"float t = x * {f(1.4426950408889634)};")
            emit(f"t = t < {f(160.0)} ? t : {f(160.0)};  // NaN lands here too: no NaN reaches the int conversion")
            emit(f"t = t > {f(-160.0)} ? t : {f(-160.0)};")
            emit(f"float n = (t + {f(12582912.0)}) - {f(12582912.0)};  // round to nearest integer")
            emit(f"float g = (x - n * {f(0.693359375)}) - n * {f(-2.12194440e-4)};")
            emit(f"float p = {f(poly[0])};")
            emit(" ".join(f"p = p * g + {f(c)};" for c in poly[1:]))
            emit(f"p = p * g * g + g + {f(1.0)};")
            emit("int ni = (int)n;")
            emit("int h = ni >> 1;")
            emit(f"float y = p * {bits}((h + 127) << 23) * {bits}((ni - h + 127) << 23);")
            emit(f"y = x > {f(88.72283935546875)} ? {self.const(math.inf, 'float32')} : y;")
            emit(f"y = x < {f(-103.97208404541016)} ? {f(0.0)} : y;")
            emit("return x != x ? x + x : y;")
        emit("}")

    # -- kernel frame ---------------------------------------------------------------
    def kernel(self, name: str, args: Sequence[str], groups: int, local: int, check: Check | None = None,
               step: bool = True) -> None:
        """Emit the signature (one parameter per argument; the first and scratch ones written) and open the body.

        ``step=False``: a kernel the call runs only in place of a ``Gemm`` step (its fallback).
        """
        params = []
        scratch = {s.name for s in self.scratch}
        for i, a in enumerate(args):
            ctype = self.d.narrow[self.narrow[a]][0] if a in self.narrow else self.ctype(self._ct(a))
            params.append(self.d.param(i, ctype, a, i == 0 or a in scratch))
        params += list(self.d.id_params)
        self.emit("")
        self.emit(f"{self.d.kernel} {self.d.launch_bounds(local)}{name}({', '.join(params)}) {{")
        self.emit.depth += 1
        self.body_start = len(self.emit.lines)
        self.launches.append(Launch(name, tuple(args), groups, local, check))
        if step:
            self.steps.append(self.launches[-1])

    def close(self) -> None:
        self.prune_unused()
        self.emit.depth -= 1
        self.emit("}")

    def prune_unused(self) -> None:
        """Drop index variables nothing reads (broadcast strides leave some): compilers warn about them."""
        body = self.emit.lines[self.body_start:]
        decl = re.compile(rf"^\s*{re.escape(self.d.index_type)} (\w+) = [^;]*;$")
        while True:
            names = [m.group(1) for line in body if (m := decl.match(line))]
            dead = next((n for n in names if not any(
                re.search(rf"\b{n}\b", line) and not re.match(rf"^\s*({re.escape(self.d.index_type)} )?{n} = ", line)
                for line in body)), None)
            if dead is None:
                break
            own = re.compile(rf"^\s*({re.escape(self.d.index_type)} )?{dead} = ")
            body = [line for line in body if not own.match(line)]
        self.emit.lines[self.body_start:] = body

    def read(self, name: str, off: str) -> str:
        """``name[off]`` as a compute-type value; float16/bfloat16 graph tensors are widened here."""
        if name in self.narrow:
            return self.d.narrow[self.narrow[name]][1].format(p=name, i=off)
        return f"{name}[{off}]"

    def write(self, name: str, off: str, value: str) -> str:
        """The statement storing ``value`` at ``name[off]``, rounded to nearest even for narrow floats."""
        if name in self.narrow:
            return self.d.narrow[self.narrow[name]][2].format(p=name, i=off, v=value) + ";"
        return f"{name}[{off}] = {value};"

    def _ct(self, name: str) -> str:
        if name in self.buffers:
            return compute_type(self.buffers[name])
        return next(s.dtype for s in self.scratch if s.name == name)

    def add_scratch(self, name: str, count: int, dtype: str) -> str:
        self.scratch.append(Scratch(name, max(1, count), dtype))
        return name

    def loader(self, space: Sequence[int], idx: Sequence[str], ct: str) -> Callable[[Load], str]:
        """Loads over ``space`` whose per-dim indices are ``idx``; rotate_half pairs along the last dim."""
        last, half = idx[-1] if idx else "0", (space[-1] // 2 if space else 0)

        def load(ld: Load) -> str:
            strides = broadcast_strides(self.buffers[ld.buffer], space)
            if not ld.rotate_half:
                return self.read(ld.buffer, indexing.offset(idx, strides, self.ix))
            partner = list(idx[:-1]) + [f"({last} < {half} ? {last} + {half} : {last} - {half})"]
            value = self.read(ld.buffer, indexing.offset(partner, strides, self.ix))
            return f"({last} < {half} ? -{value} : {value})"

        return load

    def gid(self, total: int) -> None:
        self.emit(f"{self.d.index_type} gid = {self.d.ids['global']};")
        self.emit(f"if (gid >= {total}) return;")

    # -- kernels ------------------------------------------------------------------------
    def pointwise(self, k: Pointwise) -> None:
        """One work-item per element; when every load is contiguous over the space, no index decomposition."""
        ct = compute_type(self.buffers[k.out])
        total = max(1, math.prod(k.space))
        flat = all(not ld.rotate_half and broadcast_strides(self.buffers[ld.buffer], k.space)
                   == tuple(s if d > 1 else 0 for d, s in zip(k.space, contiguous_strides(k.space), strict=True))
                   for ld in _loads(k.expr))
        group = FLAT_GROUP if flat else GROUP
        self.kernel(k.name, [k.out] + k.reads(), -(-total // group), group)
        if flat:  # a loop-free body over contiguous memory: a CPU compiler vectorizes across work-items
            self.emit(f"{self.d.index_type} gid = {self.d.ids['global']};")
            if total % group:
                self.emit(f"if (gid >= {total}) return;")
            load: Callable[[Load], str] = lambda ld: self.read(ld.buffer, "gid")  # noqa: E731
        else:
            self.gid(total)
            idx = [f"i{d}" for d in range(len(k.space))]
            indexing.decompose(self.emit, "gid", k.space, idx, self.ix)
            load = self.loader(k.space, idx, ct)
        self.emit(self.write(k.out, "gid", self.expr(k.expr, load, ct)))
        self.close()

    @staticmethod
    def combiner(kind: str, ct: str) -> Callable[[str, str], str]:
        """How a row reduction combines two partial values: a sum, or a NaN-propagating max."""
        if kind == "sum":
            return lambda a, b: f"{a} + {b}"
        return lambda a, b: f"y_max_{SUFFIX[ct]}({a}, {b})"

    def row(self, k: Row) -> None:
        emit, d = self.emit, self.d
        ct = compute_type(self.buffers[k.out])
        t = self.ctype(ct)
        length = k.space[k.axis]
        row_dims = [x for i, x in enumerate(k.space) if i != k.axis]
        rows = max(1, math.prod(row_dims))
        local = choice(self.plan, k.name, "group", row_group(length))
        self.kernel(k.name, [k.out] + k.reads(), rows, local)
        emit(f"{d.local} {t} red[{local}];")
        emit(f"{d.index_type} r = {d.ids['group']};")
        emit(f"{d.index_type} lid = {d.ids['local']};")
        ridx = [f"i{i}" for i in range(len(row_dims))]
        indexing.decompose(emit, "r", row_dims, ridx, self.ix)
        idx = list(ridx)
        idx.insert(k.axis, "l")
        load = self.loader(k.space, idx, ct)
        # a value both the last sum and the output compute (softmax's exp) is stored in the output row by the sum
        # and read back by the output loop: each thread reads only what it wrote (both loops give element l to
        # thread l % local), exact where the output holds the compute type
        stashed, out_expr = row_stash(k.reductions, k.out_expr, k.per_row, exact=k.out not in self.narrow)
        for red in k.reductions:
            init = self.const(0 if red.combine == "sum" else -math.inf, ct)
            combine = self.combiner(red.combine, ct)
            emit(f"{t} p_{red.var} = {init};")

            def value(u: int, at: str, red=red) -> list[str]:
                at_idx = [at if x == "l" else x for x in idx]
                return [f"{t} e{u} = {self.expr(red.expr, self.loader(k.space, at_idx, ct), ct)};"]

            def fold(u: int, at: str, red=red, combine=combine) -> list[str]:
                line = f"p_{red.var} = {combine(f'p_{red.var}', f'e{u}')};"
                if stashed is None or red is not k.reductions[-1]:
                    return [line]
                at_idx = [at if x == "l" else x for x in idx]  # stored after every load of the round is in flight
                return [self.write(k.out, indexing.offset(at_idx, contiguous_strides(k.space), self.ix), f"e{u}"), line]

            self.ilp_loop("l", "lid", length, local, value, fold)
            self.group_reduce(f"p_{red.var}", local, combine, into=f"{t} v_{red.var}")
        if k.per_row:
            out_dims = tuple(1 if i == k.axis else x for i, x in enumerate(k.space))
            out_off = indexing.offset(ridx, [s for i, s in enumerate(contiguous_strides(out_dims)) if i != k.axis],
                                      self.ix)
            row_idx = list(ridx)
            row_idx.insert(k.axis, "0")
            with emit.block("if (lid == 0) {"):
                emit(self.write(k.out, out_off, self.expr(k.out_expr, self.loader(k.space, row_idx, ct), ct)))
            emit("}")
        else:
            out_off = indexing.offset(idx, contiguous_strides(k.space), self.ix)
            with emit.block(f"for ({d.index_type} l = lid; l < {length}; l += {local}) {{"):
                if stashed is not None:
                    emit(f"{t} v_{STASH} = {self.read(k.out, out_off)};")
                emit(self.write(k.out, out_off, self.expr(out_expr, load, ct)))
            emit("}")
        self.close()

    def matmul(self, k: Matmul) -> None:
        cstyle_matmul.matmul(self, k)

    def embedding(self, k: Embedding) -> None:
        ids, table = self.buffers[k.ids], self.buffers[k.table]
        status = self.add_scratch(f"{k.name}_st", 1, "int32")
        message = (f"embedding ids must lie in [0, {k.vocab}); the id at flat position {{pos}} of input {k.ids} "
                   "is out of range")
        total = k.tokens * k.dim
        check = Check(status, "IndexError", message)
        self.kernel(k.name, [k.out, k.ids, k.table, status], -(-total // GROUP), GROUP, check)
        self.gid(total)
        it = self.d.index_type
        self.emit(f"{it} t = gid / {k.dim};")
        self.emit(f"{it} dd = gid - t * {k.dim};")
        idx = [f"i{d}" for d in range(len(ids.dims))]
        indexing.decompose(self.emit, "t", ids.dims, idx, self.ix)
        self.emit(f"{it} tok = ({it}){k.ids}[{indexing.offset(idx, ids.strides, self.ix)}];")
        with self.emit.block(f"if (tok < 0 || tok >= {k.vocab}) {{"):
            self.emit(f"{status}[0] = (int)(t + 1);")
            self.emit("return;")
        self.emit("}")
        sv, sd = table.strides
        self.emit(self.write(k.out, "gid", self.read(k.table, indexing.offset(["tok", "dd"], (sv, sd), self.ix))))
        self.close()

    def attention(self, k: Attention) -> None:
        emit, it = self.emit, self.d.index_type
        out, q, kc, vc = (self.buffers[x] for x in (k.out, k.q, k.k, k.v))
        ct = compute_type(out)
        t = self.ctype(ct)
        s = SUFFIX[ct]
        pairs = k.batch * k.heads
        sc = self.add_scratch(f"s_{k.name}_sc", pairs * k.seq, ct)
        args = [k.out, k.q, k.k, k.v] + [b for b in (k.lengths, *k.gains()) if b]
        check = None
        if k.lengths:
            status = self.add_scratch(f"{k.name}_st", 1, "int32")
            check = Check(status, "ValueError",
                          f"attention lengths must lie in [1, {k.seq}]; batch {{pos}} has length {{value}}", k.lengths)
            args.append(status)
        args.append(sc)
        if not self.d.barrier_global:
            raise UnsupportedExprError(f"the {self.d.name} dialect spells no work-group barrier over global memory; "
                                       "decode attention needs one")
        d = self.d
        local = min(GROUP, 1 << max(0, (max(k.seq, k.head_dim) - 1).bit_length()))
        # one work-group per (batch, head): its threads split the positions (scores, max, exp-sum), then the
        # head's columns; the sums over positions for one column stay in position order, as in the reference
        self.kernel(k.name, args, pairs, local, check)
        emit(f"{d.local} {t} red[{local}];")
        emit(f"{it} gid = {d.ids['group']};")
        emit(f"{it} lid = {d.ids['local']};")
        emit(f"{it} b = gid / {k.heads};")
        emit(f"{it} h = gid - b * {k.heads};")
        emit(f"{it} g = h / {k.heads // k.kv_heads};")
        if k.lengths:
            ls = self.buffers[k.lengths].strides[0]
            emit(f"{it} n = ({it}){k.lengths}[b * {ls}];")
            with emit.block(f"if (n < 1 || n > {k.seq}) {{"):  # reported; the group reads nothing and goes on
                emit(f"if (lid == 0) {status}[0] = (int)(b + 1);")  # to its barriers (no early return before them)
                emit("n = 0;")
            emit("}")
        else:
            emit(f"{it} n = {k.seq};")
        qs, ks, vs = q.strides, kc.strides, vc.strides
        emit(f"{it} qb = {indexing.offset(['b', 'h'], qs[:2], self.ix)};")
        emit(f"{it} kb = {indexing.offset(['b', 'g'], ks[:2], self.ix)};")
        emit(f"{it} vb = {indexing.offset(['b', 'g'], vs[:2], self.ix)};")
        emit(f"{it} sb = gid * {k.seq};")
        emit(f"{t} mx = {self.const(-math.inf, ct)};")
        if k.q_eps is not None:  # the fused RMSNorm of the query row (each thread its own copy of the scale)
            self.rms_scale("rq", k.q, "qb", qs[2], k.head_dim, k.q_eps, ct)

        def normed(buffer: str, base: str, stride: int, at: str, eps: float | None, scale: str,
                   gain: str | None) -> str:  # a query or key element, normalized (times the gain) where fused
            x = self.read(buffer, indexing.at(base, at, stride, self.ix))
            x = x if eps is None else f"{x} * {scale}"
            if gain:
                gs = self.buffers[gain].strides[-1]
                x = f"{x} * {self.read(gain, indexing.at('0', at, gs, self.ix))}"
            return x

        with emit.block(f"for ({it} s = lid; s < n; s += {local}) {{"):
            emit(f"{t} acc = {self.const(0, ct)};")
            emit(f"{it} kr = {indexing.at('kb', 's', ks[2], self.ix)};")
            if k.k_eps is not None:  # the fused RMSNorm of this key row
                self.rms_scale("rk", k.k, "kr", ks[3], k.head_dim, k.k_eps, ct)
            self.ilp_loop("d", "0", k.head_dim, 1, lambda u, at: [
                f"{t} q{u} = {normed(k.q, 'qb', qs[2], at, k.q_eps, 'rq', k.q_gain)};",
                f"{t} k{u} = {normed(k.k, 'kr', ks[3], at, k.k_eps, 'rk', k.k_gain)};"],
                lambda u, _: [f"acc = acc + q{u} * k{u};"])
            emit(f"acc = acc * {self.const(k.scale, ct)};")
            emit(f"{sc}[sb + s] = acc;")
            emit(f"mx = y_max_{s}(mx, acc);")
        emit("}")
        self.group_reduce("mx", local, lambda a, b_: f"y_max_{s}({a}, {b_})")
        emit(f"{t} tot = {self.const(0, ct)};")
        with emit.block(f"for ({it} s = lid; s < n; s += {local}) {{"):
            emit(f"{t} e = {self.exp(ct)}({sc}[sb + s] - mx);")
            emit(f"{sc}[sb + s] = e;")
            emit("tot = tot + e;")
        emit("}")
        self.group_reduce("tot", local, lambda a, b_: f"{a} + {b_}")
        emit(d.barrier_global)  # every thread's exp(score) stored before any thread reads them all
        emit(f"{it} ob = gid * {k.head_dim};")
        with emit.block(f"for ({it} d = lid; d < {k.head_dim}; d += {local}) {{"):
            emit(f"{t} o = {self.const(0, ct)};")
            def v_at(at: str) -> str:
                return indexing.at(indexing.at("vb", at, vs[2], self.ix), "d", vs[3], self.ix)

            self.ilp_loop("s", "0", "n", 1, lambda u, at: [
                f"{t} w{u} = {sc}[sb + {at}];", f"{t} v{u} = {self.read(k.v, v_at(at))};"],
                lambda u, _: [f"o = o + (w{u} / tot) * v{u};"], ilp=ILP // 2)
            emit(self.write(k.out, "ob + d", "o"))
        emit("}")
        self.close()

    def ilp_loop(self, var: str, start: str, count: int | str, stride: int, values: Callable[[int, str], list[str]],
                 fold: Callable[[int, str], list[str]], ilp: int = ILP) -> None:
        """Emit ``emit.ilp_loop``'s lines (loads of ``ilp`` iterations in flight, folded in iteration order)."""
        for line in ilp_loop(self.d.index_type, var, start, count, stride, values, fold, ilp):
            self.emit(line)

    def rms_scale(self, scale: str, buffer: str, base: str, stride: int, n: int, eps: float, ct: str) -> None:
        """Declare ``scale`` = an RMSNorm's ``1 / sqrt(sum(x^2) / n + eps)`` over the ``n`` values of ``buffer`` from
        ``base``, ``stride`` apart, as a row kernel computes it (QK-norm fused into attention)."""
        t = self.ctype(ct)
        self.emit(f"{t} {scale}_ss = {self.const(0, ct)};")
        self.ilp_loop("d", "0", n, 1, lambda u, at: [
            f"{t} {scale}_x{u} = {self.read(buffer, indexing.at(base, at, stride, self.ix))};"],
            lambda u, _: [f"{scale}_ss = {scale}_ss + {scale}_x{u} * {scale}_x{u};"])
        self.emit(f"{t} {scale} = {self.rms_scale_expr(f'{scale}_ss', n, eps, ct)};")

    def rms_scale_expr(self, ss: str, n: int, eps: float, ct: str) -> str:
        """A fused RMSNorm's ``1 / sqrt(ss / n + eps)`` in ``ct`` (a matmul's row scale, attention's QK-norm)."""
        return f"{self.const(1, ct)} / {self.d.math['sqrt']}({ss} / {self.const(n, ct)} + {self.const(eps, ct)})"

    def group_reduce(self, var: str, local: int, combine: Callable[[str, str], str], into: str | None = None) -> None:
        """``into`` (default ``var``) := ``combine`` of every thread's ``var``: a local-memory tree over ``red``,
        free again after (row kernels and attention share it)."""
        emit, d = self.emit, self.d
        emit(f"red[lid] = {var};")
        emit(d.barrier)
        with emit.block(f"for (int h = {local // 2}; h > 0; h >>= 1) {{"):
            with emit.block("if (lid < h) {"):
                emit(f"red[lid] = {combine('red[lid]', 'red[lid + h]')};")
            emit("}")
            emit(d.barrier)
        emit("}")
        emit(f"{into or var} = red[0];")
        emit(d.barrier)  # red is reused by the next reduction

    def render(self) -> Rendered:
        check_supported(self.plan, self.d)
        cts = {compute_type(b) for b in self.buffers.values()}
        self.emit(f"// Generated by yirage's C-family renderer {RENDERER_VERSION} ({self.d.name}) for plan "
                  f"{self.plan.digest}.")
        if self.d.preamble:
            for line in self.d.preamble.splitlines():
                self.emit(line)
        if "float64" in cts and self.d.double_pragma:
            self.emit(self.d.double_pragma)
        for dtype in sorted(set(self.narrow.values())):
            for line in self.d.narrow_helpers.get(dtype, "").splitlines():
                self.emit(line)
        self.helpers(cts | {"float32"} if self.d.types.get("float32") else cts)
        for k in self.plan.kernels:
            self.KERNELS[type(k)](self, k)
        return Rendered(self.emit.source(), tuple(self.launches), tuple(self.scratch), tuple(self.steps))

    KERNELS: dict[type, Callable[[_Renderer, Kernel], None]] = {}  # filled below


_Renderer.KERNELS.update({Pointwise: _Renderer.pointwise, Row: _Renderer.row, Matmul: _Renderer.matmul,
                          Embedding: _Renderer.embedding, Attention: _Renderer.attention})


def _loads(e: Expr) -> list[Load]:
    if isinstance(e, Load):
        return [e]
    return [ld for a in getattr(e, "args", ()) for ld in _loads(a)]


def row_group(length: int) -> int:
    """The work-group size of a row kernel over rows of ``length``: the row's power of two, at most ROW_GROUP_MAX."""
    return min(ROW_GROUP_MAX, 1 << max(0, (length - 1).bit_length()))


def schedule_knobs(plan: KernelPlan, dialect: Dialect, max_group: int = 1024) -> list[Knob]:
    """The decisions of this renderer a measured search may overturn (``yirage.compiler.schedule``): a row kernel's
    work-group size (``group``: wider groups put more loads in flight on a GPU, narrower ones leave more groups per
    core), and on a ``host_gemm`` dialect whether a float product goes to the vendor BLAS (``host_gemm``) or to the
    generated kernel, where the size threshold ``HOST_GEMM_MIN_MNK`` decides by itself. ``max_group``: the
    device's largest work-group."""
    from yirage.codegen.cstyle_matmul import host_gemm_choices

    renderer, knobs = _Renderer(plan, dialect), []
    for k in plan.kernels:
        if isinstance(k, Row):
            length = k.space[k.axis]
            pick = row_group(length)
            sizes = [g for g in ROW_GROUPS if g != pick and g // 2 < length and g <= max_group]  # none twice the row
            if sizes:
                knobs.append(Knob(k.name, "group", (pick, *sizes), "work-group size of the row kernel"))
        elif isinstance(k, Matmul) and (values := host_gemm_choices(renderer, k)):
            knobs.append(Knob(k.name, "host_gemm", values, "the vendor BLAS or the generated product"))
    return knobs


def render(plan: KernelPlan, dialect: Dialect) -> Rendered:
    """The plan's kernels in ``dialect``, with how to launch each; raises UnsupportedExprError first."""
    return _Renderer(plan, dialect).render()


def render_plan(plan: KernelPlan, dialect: Dialect) -> str:
    """Just the source of ``render(plan, dialect)``."""
    return render(plan, dialect).source
