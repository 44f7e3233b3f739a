"""Code-generation helpers of the numba renderer: its spellings of expressions, indices and kernels.

The backend-neutral parts (``Emitter``, index arithmetic, expression walking,
``compute_type``) live in ``yirage.codegen``; this module only spells them in numba-Python.

Generated kernels index flat 1-D buffers with uint64 arithmetic only (``U``
is ``np.uint64`` in the generated module): numba then skips its negative-
index wraparound checks, which otherwise block LLVM's vectorizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from yirage.codegen import indexing
from yirage.codegen.emit import Emitter
from yirage.codegen.exprs import Spelling, compute_type, spell_expr
from yirage.codegen.indexing import IndexSyntax
from yirage.compiler.kernel_ir import Buffer, Expr, Load

RENDERER_VERSION = "3"  # 2: IEEE special values (no fast-math flags, racc/rfma/rmax); 3: row stash, grouped attention
PARALLEL_MIN_WORK = 1 << 16  # below this many weighted scalar ops, waking the thread pool costs more than it saves
POINTWISE_CHUNK = 4096


def threads() -> int:
    """numba's thread count, baked into the source (and so into the cache key)."""
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def const(value: float, ct: str) -> str:
    if ct.startswith("int"):
        return f"np.{ct}({int(value)})"
    if math.isinf(value):
        return f"np.{ct}({'-' if value < 0 else ''}np.inf)"
    return f"np.{ct}({value!r})"


def _spellings(ct: str) -> dict[str, Spelling]:
    """numba-Python for each IR function at compute type ``ct``."""
    f32 = ct == "float32"
    return {
        "add": lambda a: f"({a[0]} + {a[1]})",
        "sub": lambda a: f"({a[0]} - {a[1]})",
        "mul": lambda a: f"({a[0]} * {a[1]})",
        "div": lambda a: f"({a[0]} / {a[1]})",
        "pow": lambda a: f"({a[0]} ** {a[1]})",
        "max": lambda a: f"fmax({a[0]}, {a[1]})",  # NaN-propagating, like torch.maximum and torch.clamp
        "min": lambda a: f"fmin({a[0]}, {a[1]})",
        "exp": lambda a: f"fexp({a[0]})" if f32 else f"math.exp({a[0]})",
        "sqrt": lambda a: f"math.sqrt({a[0]})",
        "silu": lambda a: f"fsilu({a[0]})" if f32 else f"dsilu({a[0]})",
        "gelu": lambda a: f"fgelu({a[0]})" if f32 else f"dgelu({a[0]})",
        "relu": lambda a: f"fmax({a[0]}, {const(0, ct)})",
        "square": lambda a: f"({a[0]} * {a[0]})",
        "neg": lambda a: f"(-{a[0]})",
    }


_SPELLINGS = {ct: _spellings(ct) for ct in ("float32", "float64", "int32", "int64")}


def expr_src(expr: Expr, load: Callable[[Load], str], ct: str) -> str:
    """Spell an expression in numba-Python for compute type ``ct``."""
    table = _SPELLINGS.get(ct) or _spellings(ct)
    return spell_expr(expr, load=load, var=lambda v: f"v_{v.name}", const=lambda c: const(c.value, ct),
                      table=table, renderer="cpu (numba)")


def rms_scale_src(ss: str, n: int, eps: float, ct: str) -> str:
    """A fused RMSNorm's ``1 / sqrt(ss / n + eps)`` in ``ct`` (a matmul's row scale, attention's QK-norm), as the
    row kernel's decomposed rsqrt computes it."""
    return f"{const(1, ct)} / math.sqrt({ss} / {const(n, ct)} + {const(eps, ct)})"


def acc_src(acc: str, x: str, ct: str) -> str:
    """``acc + x`` for a sum over a loop: reassociable for floats (``racc``), so the loop vectorizes."""
    return f"racc({acc}, {x})" if ct.startswith("float") else f"({acc} + {x})"


def fma_src(acc: str, x: str, y: str, ct: str) -> str:
    """``acc + x * y`` for a dot product: one reassociable FMA for floats (``rfma``)."""
    return f"rfma({acc}, {x}, {y})" if ct.startswith("float") else f"({acc} + {x} * {y})"


#: numba spelling of index arithmetic: every index is uint64 so numba skips wraparound checks
INDEX = IndexSyntax(const=lambda n: f"U({n})", declare=lambda n, v: f"{n} = {v}",
                    assign=lambda n, v: f"{n} = {v}", floordiv="//")


def decompose(emit: Emitter, flat: str, dims: Sequence[int], names: Sequence[str]) -> None:
    """Emit ``names[i] = index along dims[i]`` for the row-major flat index ``flat`` (uint64)."""
    indexing.decompose(emit, flat, dims, names, INDEX)


def offset(names: Sequence[str], strides: Sequence[int]) -> str:
    """uint64 offset expression; every index is uint64 so numba skips wraparound checks."""
    return indexing.offset(names, strides, INDEX)


def at(base: str, index: str, stride: int) -> str:
    return indexing.at(base, index, stride, INDEX)


@contextmanager
def kernel_def(emit: Emitter, name: str, args: Sequence[Buffer], parallel: bool) -> Iterator[Emitter]:
    """Emit a kernel taking raw addresses; its body sees each buffer as a flat 1-D array.

    Passing ``tensor.data_ptr()`` ints costs a fraction of building numpy
    views per call, which is most of a tiny graph's call overhead.
    """
    ints = ", ".join(["int64"] * len(args))
    emit(f'@njit("int64({ints})", parallel={parallel}, fastmath=FASTMATH, error_model="numpy", nogil=True, cache=True)')
    emit(f"def {name}({', '.join(f'{b.name}_p' for b in args)}):")
    emit.depth += 1
    for b in args:
        span = max(1, math.prod(b.dims))
        emit(f"{b.name} = numba.carray(as_pointer({b.name}_p), ({span},), np.{compute_type(b)})")
    yield emit
    emit.depth -= 1


def outer_loop(emit: Emitter, var: str, count: int, parallel: bool) -> Emitter:
    """A (p)range over ``count`` whose body sees ``var`` as uint64."""
    emit(f"for {var}_ in {'prange' if parallel else 'range'}({count}):")
    emit.depth += 1
    emit(f"{var} = U({var}_)")
    emit.depth -= 1
    return emit


