"""What one C-family language spells differently: the ``Dialect`` a dialect module fills in.

The renderer (``yirage.codegen.cstyle``) writes every kernel once; a dialect
holds only the words that differ between OpenCL C, CUDA C, HIP and Metal:
qualifiers, thread and group indices, barriers, local memory, scalar type
names and the math library. Modeled on tinygrad's ``CStyleLanguage``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from yirage.codegen.exprs import UnsupportedExprError, check_primitive, compute_type
from yirage.compiler.kernel_ir import FUNCTIONS, Call, Expr, KernelPlan, Matmul, Pointwise, Row

#: the math-library names each IR function needs from a dialect ("" = plain operators only)
NEEDS: dict[str, tuple[str, ...]] = {
    "add": (), "sub": (), "mul": (), "div": (), "max": (), "min": (), "relu": (), "square": (), "neg": (),
    "exp": ("exp",), "silu": ("exp",), "sqrt": ("sqrt",), "pow": ("pow",),
    "gelu": ("erf",),
}
assert set(NEEDS) == set(FUNCTIONS), "every IR function needs an entry in NEEDS"

#: IR functions that only make sense on floating-point values
FLOAT_ONLY = frozenset({"exp", "silu", "sqrt", "pow", "gelu", "div"})


@dataclass(frozen=True)
class WideLoad:
    """One load of ``width`` consecutive elements of a dtype, widened to float32 element by element.

    ``load`` is a statement declaring ``{o}`` from the elements of pointer ``{p}`` starting at element ``{i}``;
    ``elements[j]`` spells element ``j`` of ``{o}`` as a float32 expression. ``align`` is the byte alignment
    the load's address needs (0: element alignment is enough, as OpenCL's ``vloadn``); the renderer tests a
    buffer's base address with ``Dialect.aligned`` at run time and falls back to scalar loads where it fails.
    ``align`` must divide ``width`` x the element's bytes, so every load of an aligned row is aligned too.
    """

    width: int
    load: str
    elements: tuple[str, ...]
    align: int = 0


@dataclass(frozen=True)
class Dialect:
    """Spellings of one C-family language; ``functions`` is derived from ``math``.

    ``param(i, ctype, name, writable)`` spells kernel parameter ``i``;
    ``ids`` maps "global", "group", "local" and "local_size" to their spelling
    (Metal's come in as extra kernel parameters, listed in ``id_params``).
    ``types`` maps compute types (float32, float64, int32, int64) to C names; a
    dtype missing there is one the language cannot compute in. float16 and
    bfloat16 are computed in float32: ``narrow`` spells their loads and stores.
    """

    name: str
    preamble: str
    kernel: str  # qualifiers before the kernel name, e.g. "__kernel void"
    param: Callable[[int, str, str, bool], str]
    ids: Mapping[str, str]
    barrier: str
    local: str  # qualifier of a work-group-shared array
    inline: str  # qualifiers of a helper function
    index_type: str
    types: Mapping[str, str]
    math: Mapping[str, str]  # generic name (exp, sqrt, erf, pow; int_as_float: int bits -> float) -> spelling
    id_params: tuple[str, ...] = ()
    float_suffix: str = "f"
    infinity: Mapping[str, str] = field(default_factory=dict)  # compute type -> +inf
    double_pragma: str = ""  # emitted when a kernel computes in float64
    launch_bounds: Callable[[int], str] = lambda n: ""  # e.g. CUDA's __launch_bounds__(n)
    #: float16/bfloat16 graph tensors: dtype -> (storage type, load "{p}[{i}]" as float, store {v} there)
    narrow: Mapping[str, tuple[str, str, str]] = field(default_factory=dict)
    narrow_helpers: Mapping[str, str] = field(default_factory=dict)  # dtype -> helper source they need
    #: unsigned integers (the PersistentKernel's sampler hashes and bisects float bits with them)
    unsigned: Mapping[str, str] = field(default_factory=dict)  # "uint32"/"uint64" -> C name
    bits: str = ""  # reinterpret float32 {x} as its uint32 bits ("" = the dialect cannot)
    #: large float matmuls become prologue kernel -> host GEMM (``Gemm`` step: the vendor BLAS) -> epilogue kernel
    host_gemm: bool = False
    host_gemm_min_m: int = 1  # ... when the product has at least this many rows (M): below it the kernels run
    #: a GEMV (M = 1) over a row-major B splits K across work-groups of one work-item, each streaming whole rows
    #: of B into a partial sum, then sums the partials in a second kernel: the right shape on a CPU device, where
    #: a work-group is one thread's loop (set by a backend for its CPU devices)
    gemv_split_k: bool = False
    #: a work-group barrier that also orders the group's global-memory writes before its later reads ("" = the
    #: dialect has none); CUDA's ``__syncthreads`` does both, OpenCL and Metal name the global fence
    barrier_global: str = ""
    #: a register exchange inside a slice of ``shuffle_width`` consecutive threads that run in lockstep: the value
    #: ``{v}`` of the slice's thread whose lane differs in the bits of ``{m}`` ("" = none: a reduction goes through
    #: local memory with a barrier per level). Every thread of the slice must reach it.
    shuffle_xor: str = ""
    shuffle_width: int = 0
    #: dtype -> its wide load (GEMV weights and activations: one 16-byte load instead of 4 or 8 scalar ones)
    wide_loads: Mapping[str, WideLoad] = field(default_factory=dict)
    aligned: str = ""  # true when pointer {p} is a multiple of {n} bytes (needed by a WideLoad with align > 0)
    #: a statement that asks for the cache line holding element {i} of global buffer {p} to be fetched (into L2 on
    #: NVIDIA), a hint with no effect on any value; "" = none
    prefetch: str = ""

    @property
    def functions(self) -> frozenset[str]:
        """The IR functions this dialect spells: those whose math-library needs it covers."""
        return frozenset(fn for fn, needs in NEEDS.items() if all(n in self.math for n in needs))


def plan_functions(plan: KernelPlan) -> dict[str, set[str]]:
    """Every IR function the plan calls, with the compute types it is called at."""
    found: dict[str, set[str]] = {}

    def walk(e: Expr | None, ct: str) -> None:
        if isinstance(e, Call):
            found.setdefault(e.fn, set()).add(ct)
            for a in e.args:
                walk(a, ct)

    for k in plan.kernels:
        ct = compute_type(plan.buffers[k.out])
        exprs: list[Expr | None] = []
        if isinstance(k, Pointwise):
            exprs = [k.expr]
        elif isinstance(k, Row):
            exprs = [r.expr for r in k.reductions] + [k.out_expr]
        elif isinstance(k, Matmul):
            exprs = [k.a, k.epilogue, k.row_scale]
        for e in exprs:
            walk(e, ct)
    return found


def check_supported(plan: KernelPlan, dialect: Dialect) -> None:
    """Raise one clear error naming every function or dtype of ``plan`` that ``dialect`` cannot spell."""
    for fn in plan_functions(plan):
        check_primitive(fn, f"C-family ({dialect.name})")
    missing = sorted(fn for fn in plan_functions(plan) if fn not in dialect.functions)
    if missing:
        raise UnsupportedExprError(
            f"the {dialect.name} dialect cannot spell the IR function(s) {', '.join(missing)} (its math library "
            f"lacks {', '.join(sorted({n for fn in missing for n in NEEDS.get(fn, ())} - set(dialect.math)))}); "
            f"add the spelling to yirage/codegen/dialects/{dialect.name}.py, or compile with another backend "
            "(e.g. backend='cpu' or 'reference')")
    ints = sorted(fn for fn, cts in plan_functions(plan).items() if fn in FLOAT_ONLY and cts & {"int32", "int64"})
    if ints:
        raise UnsupportedExprError(
            f"the C-family renderer has no integer spelling of {', '.join(ints)}; cast the inputs to a float "
            "dtype first, or compile with backend='cpu' or 'reference'")
    types = sorted(({compute_type(b) for b in plan.buffers.values()} - set(dialect.types))
                   | ({b.dtype.name for b in plan.buffers.values() if b.role != "temp"}
                      & {"float16", "bfloat16"}) - set(dialect.narrow))
    if types:
        raise UnsupportedExprError(
            f"the {dialect.name} dialect cannot compute in {', '.join(types)} (it has "
            f"{', '.join(sorted(dialect.types))}); cast the graph's tensors to one of those, or compile with "
            "another backend (e.g. backend='cpu')")
