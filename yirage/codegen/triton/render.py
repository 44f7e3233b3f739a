"""The Triton renderer's frame and its element, row, embedding and attention kernels.

``_Renderer`` holds what every kernel shares: expression spellings per compute
type, loads that widen float16/bfloat16 to float32, stores that round back to
nearest even, index decomposition with one mask per vector index, and the
launch list. Matmuls live in ``yirage.codegen.triton.matmul``.

Every index vector (``offs``, a row's ``l``, a tile's ``am``/``ak``) has a mask
of its own; a load is masked by the masks of the index vectors its offset uses,
and a load whose offset uses none is a scalar load of an element that exists.
Lanes outside the shape are replaced by the reduction's identity before they
reach a sum or a max, never left to whatever the expression makes of zeros.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from yirage.codegen import indexing
from yirage.codegen.dialect import FLOAT_ONLY, plan_functions
from yirage.codegen.emit import Emitter
from yirage.codegen.exprs import Spelling, UnsupportedExprError, compute_type, spell_expr
from yirage.codegen.indexing import IndexSyntax, broadcast_strides
from yirage.codegen.launch import Check, Scratch, TritonLaunch
from yirage.codegen.triton import matmul
from yirage.codegen.triton.blocks import TL_TYPE, next_pow2, warps
from yirage.compiler.kernel_ir import (
    Attention,
    Call,
    Embedding,
    Expr,
    Kernel,
    KernelPlan,
    Load,
    Matmul,
    Pointwise,
    Row,
    Var,
)
from yirage.compiler.schedule import Knob, choice
from yirage.graph.kernel_graph import contiguous_strides

RENDERER_VERSION = "1"
POINTWISE_BLOCK = 1024  # elements per program of a pointwise kernel (at most)
ROW_BLOCK_MAX = 4096  # lanes per program of a row kernel; longer rows loop ...
ROW_BLOCKS = (256, 512, 1024, 2048)  # ... and the narrower blocks a search may pick (the ``block`` knob)
EMBED_BLOCK_MAX = 1024
ATTN_SEQ_BLOCK = 64  # cache rows per step of decode attention
INT32_SAFE = (1 << 31) - 1
COMPUTE_TYPES = frozenset(TL_TYPE)


@dataclass(frozen=True)
class TritonRendered:
    """A Python module of ``@triton.jit`` kernels and how to launch them, in order."""

    source: str
    launches: tuple[TritonLaunch, ...]
    scratch: tuple[Scratch, ...]


def row_block(length: int) -> int:
    """BLOCK of a row kernel over rows of ``length``: the row's power of two, at most ROW_BLOCK_MAX."""
    return min(ROW_BLOCK_MAX, next_pow2(length))


def schedule_knobs(plan: KernelPlan) -> list[Knob]:
    """The decisions of the Triton renderer a measured search may overturn (``yirage.compiler.schedule``): a row
    kernel's BLOCK (narrower blocks loop more but keep fewer registers live per program) and a gemv-shaped
    product's BLOCK_N / BLOCK_K."""
    knobs = []
    for k in plan.kernels:
        if isinstance(k, Row):
            pick = row_block(k.space[k.axis])
            narrower = [b for b in ROW_BLOCKS if b < pick]
            if narrower:
                knobs.append(Knob(k.name, "block", (pick, *narrower), "BLOCK lanes of the row program"))
        elif isinstance(k, Matmul):
            knobs += matmul.matmul_knobs(plan.buffers, k)
    return knobs


def _loads(e: Expr) -> list[Load]:
    if isinstance(e, Load):
        return [e]
    return [ld for a in getattr(e, "args", ()) for ld in _loads(a)]


def _has_leaf(e: Expr) -> bool:
    """Whether ``e`` reads a buffer or a kernel variable (else it is constants only)."""
    if isinstance(e, (Load, Var)):
        return True
    return isinstance(e, Call) and any(_has_leaf(a) for a in e.args)


def check_supported(plan: KernelPlan) -> None:
    """Refuse, before any text is produced, what the Triton language subset cannot compute."""
    types = sorted({compute_type(b) for b in plan.buffers.values()} - COMPUTE_TYPES)
    if types:
        raise UnsupportedExprError(
            f"the Triton renderer cannot compute in {', '.join(types)} (it computes in "
            f"{', '.join(sorted(COMPUTE_TYPES))}; float16/bfloat16 are widened to float32); cast the graph's "
            "tensors to one of those, or compile with another backend (e.g. backend='cpu')")
    ints = sorted(fn for fn, cts in plan_functions(plan).items() if fn in FLOAT_ONLY and cts & {"int32", "int64"})
    if ints:
        raise UnsupportedExprError(
            f"the Triton renderer has no integer spelling of {', '.join(ints)}; cast the inputs to a float "
            "dtype first, or compile with backend='cpu' or 'reference'")
    for k in plan.kernels:
        if isinstance(k, Row) and compute_type(plan.buffers[k.out]).startswith("int") and any(
                r.combine == "max" for r in k.reductions):
            raise UnsupportedExprError(
                f"kernel {k.name}: the Triton renderer has no integer max reduction; cast the input to a float "
                "dtype first, or compile with backend='cpu'")


class _Renderer:
    def __init__(self, plan: KernelPlan) -> None:
        self.plan = plan
        self.buffers = dict(plan.buffers)
        #: graph inputs and outputs stored as float16/bfloat16 (temporaries are kept at compute type)
        self.narrow = {n: b.dtype.name for n, b in plan.buffers.items()
                       if b.role != "temp" and b.dtype.name in ("float16", "bfloat16")}
        self.emit = Emitter()
        self.launches: list[TritonLaunch] = []
        self.scratch: list[Scratch] = []
        self.helpers: set[str] = set()
        self.ix = IndexSyntax(const=str, declare=lambda n, v: f"{n} = {v}", assign=lambda n, v: f"{n} = {v}",
                              floordiv="//")
        self.masks: dict[str, str] = {}  # vector index name -> its mask, for the kernel being rendered
        self.wide = max((math.prod(b.dims) for b in plan.buffers.values()), default=1) > INT32_SAFE // 2

    # -- spellings ----------------------------------------------------------------
    @staticmethod
    def const(value: float, ct: str) -> str:
        if ct.startswith("int"):
            return str(int(value))
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return f'float("{"-" if value < 0 else ""}inf")'
        text = repr(float(value))
        if ct == "float64" and struct.unpack("f", struct.pack("f", value))[0] != value:
            # Triton 3.0 types a Python float as float32 before promoting it: keep every bit of a float64 one
            return f"tl.full([], {text}, tl.float64)"
        return text

    def use(self, helper: str) -> str:
        self.helpers.add(helper)
        return helper

    def table(self, ct: str) -> dict[str, Spelling]:
        f32 = ct == "float32"
        bits = "32" if f32 else "64"

        table: dict[str, Spelling] = {
            "add": lambda a: f"({a[0]} + {a[1]})", "sub": lambda a: f"({a[0]} - {a[1]})",
            "mul": lambda a: f"({a[0]} * {a[1]})", "neg": lambda a: f"(-{a[0]})",
            "max": lambda a: f"{self.use('y_max')}({a[0]}, {a[1]})",
            "min": lambda a: f"{self.use('y_min')}({a[0]}, {a[1]})",
            "relu": lambda a: f"{self.use('y_relu')}({a[0]})",
            "square": lambda a: f"{self.use('y_square')}({a[0]})",
        }
        if ct.startswith("float"):
            table.update({
                "div": (lambda a: f"tl.div_rn({a[0]}, {a[1]})") if f32 else (lambda a: f"({a[0]} / {a[1]})"),
                "exp": (lambda a: f"{self.use('y_exp32')}({a[0]})") if f32 else (lambda a: f"tl.exp({a[0]})"),
                "sqrt": (lambda a: f"tl.sqrt_rn({a[0]})") if f32 else (lambda a: f"tl.sqrt({a[0]})"),
                "silu": lambda a: f"{self.use('y_silu' + bits)}({a[0]})",
                "gelu": lambda a: f"{self.use('y_gelu' + bits)}({a[0]})",
                "pow": lambda a: f"{self.use('y_pow' + bits)}({a[0]}, {a[1]})",
            })
        return table

    def expr(self, e: Expr, load: Callable[[Load], str], ct: str, shape: str = "") -> str:
        """``e`` spelled in ``ct``; a constants-only expression is broadcast to ``shape`` when given."""
        text = spell_expr(e, load=load, var=lambda v: f"v_{v.name}", const=lambda c: self.const(c.value, ct),
                          table=self.table(ct), renderer="Triton")
        if shape and not _has_leaf(e):
            return f"tl.full({shape}, {text}, {TL_TYPE[ct]})"
        return text

    # -- memory -------------------------------------------------------------------
    def mask_of(self, offset: str) -> str:
        """The mask of a load at ``offset``: those of the vector indices it uses ('' for a scalar offset)."""
        used = [m for name, m in self.masks.items() if re.search(rf"\b{name}\b", offset)]
        return " & ".join(dict.fromkeys(used))

    def read(self, name: str, off: str) -> str:
        """``name[off]`` as a compute-type value; float16/bfloat16 graph tensors are widened here."""
        mask = self.mask_of(off)
        text = f"tl.load(p_{name} + {off}, mask={mask}, other=0)" if mask else f"tl.load(p_{name} + {off})"
        return self.widen(name, text)

    def widen(self, name: str, text: str) -> str:
        """A loaded value of buffer ``name`` at compute type: float16/bfloat16 become float32 exactly."""
        if self.narrow.get(name) == "bfloat16":
            return f"{self.use('y_widen_bf16')}({text})"
        return f"{text}.to(tl.float32)" if name in self.narrow else text

    def write(self, name: str, off: str, value: str, mask: str = "") -> str:
        """The statement storing ``value`` at ``name[off]``, rounded to nearest even for narrow floats."""
        if self.narrow.get(name) == "bfloat16":
            value = f"{self.use('y_bf16')}({value})"
        elif self.narrow.get(name) == "float16":
            value = f"({value}).to(tl.float16)"
        return f"tl.store(p_{name} + {off}, {value}{f', mask={mask}' if mask else ''})"

    def loader(self, space: Sequence[int], idx: Sequence[str]) -> Callable[[Load], str]:
        """Loads over ``space`` whose per-dim indices are ``idx``; rotate_half pairs along the last dim."""
        last, half = idx[-1] if idx else "0", (space[-1] // 2 if space else 0)

        def load(ld: Load) -> str:
            strides = broadcast_strides(self.buffers[ld.buffer], space)
            if not ld.rotate_half:
                return self.read(ld.buffer, indexing.offset(idx, strides, self.ix))
            partner = list(idx[:-1]) + [f"tl.where({last} < {half}, {last} + {half}, {last} - {half})"]
            value = self.read(ld.buffer, indexing.offset(partner, strides, self.ix))
            return f"{self.use('y_neg_where')}({last} < {half}, {value})"

        return load

    def add_scratch(self, name: str, count: int, dtype: str) -> str:
        self.scratch.append(Scratch(name, max(1, count), dtype))
        return name

    # -- kernel frame ---------------------------------------------------------------
    def kernel(self, name: str, args: Sequence[str], programs: int, constexprs: dict[str, int],
               num_warps: int = 4, check: Check | None = None, doc: str = "",
               tiles: Sequence[tuple[int, str]] = ()) -> None:
        """Emit ``@triton.jit def name(p_<arg>..., BLOCK...: tl.constexpr):`` and open its body."""
        params = [f"p_{a}" for a in args] + [f"{c}: tl.constexpr" for c in constexprs]
        self.emit("")
        self.emit("")
        self.emit("@triton.jit")
        self.emit(f"def {name}({', '.join(params)}):")
        self.emit.depth += 1
        if doc:
            self.emit(f'"""{doc}"""')
        self.masks = {}
        self.launches.append(TritonLaunch(name, tuple(args), max(1, programs), tuple(tiles),
                                          tuple(constexprs.items()), num_warps, check))

    def close(self) -> None:
        self.emit.depth -= 1

    def pid(self) -> str:
        return "tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)"

    def vector(self, name: str, value: str, bound: str | int, mask: str | None = None) -> None:
        """A vector index ``name = value`` with its mask ``name < bound``."""
        mask = mask or f"m_{name}"
        self.emit(f"{name} = {value}")
        self.emit(f"{mask} = {name} < {bound}")
        self.masks[name] = mask

    # -- kernels ------------------------------------------------------------------------
    def pointwise(self, k: Pointwise) -> None:
        """BLOCK elements per program; loads contiguous over the space index by the flat offset alone."""
        ct = compute_type(self.buffers[k.out])
        total = max(1, math.prod(k.space))
        block = min(POINTWISE_BLOCK, next_pow2(total))
        self.kernel(k.name, [k.out] + k.reads(), 1, {"BLOCK": block}, warps(block),
                    doc=f"{k.out}[i] = {k.expr} over {k.space}", tiles=[(total, "BLOCK")])
        self.vector("offs", f"{self.pid()} * BLOCK + tl.arange(0, BLOCK)", total, "mask")
        dense = tuple(s if d > 1 else 0 for d, s in zip(k.space, contiguous_strides(k.space), strict=True))
        flat = all(not ld.rotate_half and broadcast_strides(self.buffers[ld.buffer], k.space) == dense
                   for ld in _loads(k.expr))
        if flat:
            load: Callable[[Load], str] = lambda ld: self.read(ld.buffer, "offs")  # noqa: E731
        else:
            idx = [f"i{d}" for d in range(len(k.space))]
            indexing.decompose(self.emit, "offs", k.space, idx, self.ix)
            for name in idx:
                self.masks[name] = "mask"
            load = self.loader(k.space, idx)
        self.emit(self.write(k.out, "offs", self.expr(k.expr, load, ct, "[BLOCK]"), "mask"))
        self.close()

    def row(self, k: Row) -> None:
        """One program per row: each reduction loops over the row in BLOCK lanes, then the output pass."""
        emit = self.emit
        ct = compute_type(self.buffers[k.out])
        tt = TL_TYPE[ct]
        length = k.space[k.axis]
        row_dims = [x for i, x in enumerate(k.space) if i != k.axis]
        rows = max(1, math.prod(row_dims))
        block = choice(self.plan, k.name, "block", row_block(length))
        self.kernel(k.name, [k.out] + k.reads(), rows, {"BLOCK": block}, warps(block),
                    doc=f"one row of {k.space} along axis {k.axis} per program")
        emit(f"r = {self.pid()}")
        ridx = [f"i{i}" for i in range(len(row_dims))]
        indexing.decompose(emit, "r", row_dims, ridx, self.ix)
        idx = list(ridx)
        idx.insert(k.axis, "l")
        load = self.loader(k.space, idx)
        for red in k.reductions:
            init = self.const(0 if red.combine == "sum" else -math.inf, ct)
            emit(f"acc_{red.var} = tl.full([BLOCK], {init}, {tt})")
            with emit.block(f"for l0 in range(0, {length}, BLOCK):"):
                self.vector("l", "l0 + tl.arange(0, BLOCK)", length)
                value = f"tl.where(m_l, {self.expr(red.expr, load, ct, '[BLOCK]')}, {init})"
                if red.combine == "sum":
                    emit(f"acc_{red.var} = acc_{red.var} + {value}")
                else:
                    emit(f"acc_{red.var} = {self.use('y_max')}(acc_{red.var}, {value})")
            if red.combine == "sum":
                emit(f"v_{red.var} = tl.sum(acc_{red.var}, 0)")
            else:
                emit(f"v_{red.var} = tl.reduce(acc_{red.var}, 0, y_max)")
        if k.per_row:
            out_dims = tuple(1 if i == k.axis else x for i, x in enumerate(k.space))
            out_off = indexing.offset(ridx, [s for i, s in enumerate(contiguous_strides(out_dims)) if i != k.axis],
                                      self.ix)
            row_idx = list(ridx)
            row_idx.insert(k.axis, "0")
            emit(self.write(k.out, out_off, self.expr(k.out_expr, self.loader(k.space, row_idx), ct)))
        else:
            out_off = indexing.offset(idx, contiguous_strides(k.space), self.ix)
            with emit.block(f"for l0 in range(0, {length}, BLOCK):"):
                self.vector("l", "l0 + tl.arange(0, BLOCK)", length)
                emit(self.write(k.out, out_off, self.expr(k.out_expr, load, ct, "[BLOCK]"), "m_l"))
        self.close()

    def embedding(self, k: Embedding) -> None:
        """One program per token: the id is checked, a bad one recorded in the status buffer and not read."""
        emit = self.emit
        ids, table = self.buffers[k.ids], self.buffers[k.table]
        status = self.add_scratch(f"{k.name}_st", 1, "int32")
        message = (f"embedding ids must lie in [0, {k.vocab}); the id at flat position {{pos}} of input {k.ids} "
                   "is out of range")
        block = min(EMBED_BLOCK_MAX, next_pow2(k.dim))
        self.kernel(k.name, [k.out, k.ids, k.table, status], k.tokens, {"BLOCK": block}, warps(block),
                    Check(status, "IndexError", message), doc=f"{k.out}[t, :] = {k.table}[{k.ids}[t], :]")
        emit(f"t = {self.pid()}")
        idx = [f"i{d}" for d in range(len(ids.dims))]
        indexing.decompose(emit, "t", ids.dims, idx, self.ix)
        emit(f"tok = tl.load(p_{k.ids} + {indexing.offset(idx, ids.strides, self.ix)}).to(tl.int64)")
        emit(f"bad = (tok < 0) | (tok >= {k.vocab})")
        emit(f"tl.atomic_max(p_{status}, tl.where(bad, t + 1, 0).to(tl.int32))  # the last bad position")
        emit("tok = tl.where(bad, 0, tok)  # never read outside the table")
        sv, sd = table.strides
        with emit.block(f"for d0 in range(0, {k.dim}, BLOCK):"):
            self.vector("d", "d0 + tl.arange(0, BLOCK)", k.dim)
            value = f"tl.load(p_{k.table} + {indexing.offset(['tok', 'd'], (sv, sd), self.ix)}, mask=m_d, other=0)"
            value = self.widen(k.table, value)
            emit(self.write(k.out, f"t * {k.dim} + d", value, "m_d"))
        self.close()

    def attention(self, k: Attention) -> None:
        """One program per (batch, head): pass 1 finds the row max, pass 2 sums exp and exp * V (GQA: h // group)."""
        emit = self.emit
        out, q, kc, vc = (self.buffers[x] for x in (k.out, k.q, k.k, k.v))
        ct = compute_type(out)
        tt = TL_TYPE[ct]
        exp = (lambda a: f"{self.use('y_exp32')}({a})") if ct == "float32" else (lambda a: f"tl.exp({a})")
        args = [k.out, k.q, k.k, k.v] + [b for b in (k.lengths, *k.gains()) if b]
        check = None
        if k.lengths:
            status = self.add_scratch(f"{k.name}_st", 1, "int32")
            check = Check(status, "ValueError",
                          f"attention lengths must lie in [1, {k.seq}]; batch {{pos}} has length {{value}}", k.lengths)
            args.append(status)
        bd, bs = next_pow2(k.head_dim), min(ATTN_SEQ_BLOCK, next_pow2(k.seq))
        self.kernel(k.name, args, k.batch * k.heads, {"BLOCK_S": bs, "BLOCK_D": bd}, warps(bs * bd // 4), check,
                    doc=f"decode attention, {k.heads} heads over {k.kv_heads} KV heads")
        emit(f"pid = {self.pid()}")
        emit(f"b = pid // {k.heads}")
        emit(f"h = pid % {k.heads}")
        emit(f"g = h // {k.heads // k.kv_heads}")
        if k.lengths:
            ls = self.buffers[k.lengths].strides[0]
            emit(f"n = tl.load(p_{k.lengths} + b * {ls}).to(tl.int32)")
            emit(f"bad = (n < 1) | (n > {k.seq})")
            emit(f"tl.atomic_max(p_{args[-1]}, tl.where(bad, b + 1, 0).to(tl.int32))  # the last bad batch")
            emit(f"n = tl.where(bad, {k.seq}, n)  # the call raises; read only rows that exist")
        else:
            emit(f"n = {k.seq}")
        self.vector("d", "tl.arange(0, BLOCK_D)", k.head_dim)
        qs, ks, vs = q.strides, kc.strides, vc.strides
        emit(f"qv = {self.read(k.q, indexing.offset(['b', 'h', 'd'], qs, self.ix))}")
        def gain(name: str) -> str:  # a gain over the head dim, one value per lane of d
            return self.read(name, indexing.at("0", "d", self.buffers[name].strides[-1], self.ix))

        if k.q_eps is not None:  # the fused RMSNorm of the query row (times its gain), as a row kernel computes it
            emit(f"qv = qv * {matmul.rms_scale('tl.sum(qv * qv, 0)', k.head_dim, k.q_eps, ct, self.const)}")
            if k.q_gain:
                emit(f"qv = qv * {gain(k.q_gain)}")
        if k.k_gain:  # the gain over the head dim that follows the keys' norm
            emit(f"gv = {gain(k.k_gain)}")
        emit(f"kb = {indexing.offset(['b', 'g'], ks[:2], self.ix)}")
        emit(f"vb = {indexing.offset(['b', 'g'], vs[:2], self.ix)}")
        self.masks["sc"] = "m_s[:, None]"
        self.masks["dr"] = "m_d[None, :]"

        def scores() -> None:
            self.vector("s", "s0 + tl.arange(0, BLOCK_S)", "n")
            emit("sc = s[:, None]")
            emit("dr = d[None, :]")
            kt = self.read(k.k, f"kb + {indexing.offset(['sc', 'dr'], ks[2:], self.ix)}")
            if k.k_eps is not None:  # the fused RMSNorm of each key row, as a row kernel computes it
                emit(f"kt = {kt}")
                emit(f"rk = {matmul.rms_scale('tl.sum(kt * kt, 1)', k.head_dim, k.k_eps, ct, self.const)}")
                kt = "(kt * rk[:, None] * gv[None, :])" if k.k_gain else "(kt * rk[:, None])"
            emit(f"x = tl.where(m_s, tl.sum(qv[None, :] * {kt}, 1) * {self.const(k.scale, ct)}, "
                 f"{self.const(-math.inf, ct)})")

        emit(f"acc_m = tl.full([BLOCK_S], {self.const(-math.inf, ct)}, {tt})")
        with emit.block(f"for s0 in range(0, {k.seq}, BLOCK_S):"):
            scores()
            emit(f"acc_m = {self.use('y_max')}(acc_m, x)")
        emit("mx = tl.reduce(acc_m, 0, y_max)")
        emit(f"acc_t = tl.zeros([BLOCK_S], {tt})")
        emit(f"o = tl.zeros([BLOCK_D], {tt})")
        with emit.block(f"for s0 in range(0, {k.seq}, BLOCK_S):"):
            scores()
            emit(f"e = tl.where(m_s, {exp('x - mx')}, 0.0)")
            emit("acc_t = acc_t + e")
            vt = self.read(k.v, f"vb + {indexing.offset(['sc', 'dr'], vs[2:], self.ix)}")
            emit(f"o = o + tl.sum(e[:, None] * {vt}, 0)")
        emit("tot = tl.sum(acc_t, 0)")
        emit(self.write(k.out, f"pid * {k.head_dim} + d", "tl.div_rn(o, tot)" if ct == "float32" else "o / tot",
                        "m_d"))
        self.close()

    def matmul(self, k: Matmul) -> None:
        matmul.matmul(self, k)

    def render(self) -> TritonRendered:
        from yirage.codegen.triton.helpers import helper_source

        check_supported(self.plan)
        for k in self.plan.kernels:
            self.KERNELS[type(k)](self, k)
        head = [f'"""Generated by yirage\'s Triton renderer {RENDERER_VERSION} for plan {self.plan.digest}.',
                "", "Triton 3.0-3.5 language subset; float16/bfloat16 are computed in float32.", '"""',
                "import triton", "import triton.language as tl", ""]
        source = "\n".join(head) + helper_source(self.helpers) + self.emit.source()
        return TritonRendered(source, tuple(self.launches), tuple(self.scratch))

    KERNELS: dict[type, Callable[[_Renderer, Kernel], None]] = {}  # filled below


_Renderer.KERNELS.update({Pointwise: _Renderer.pointwise, Row: _Renderer.row, Matmul: _Renderer.matmul,
                          Embedding: _Renderer.embedding, Attention: _Renderer.attention})
