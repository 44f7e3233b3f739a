"""Code-generation helpers of the numba renderer: emitting, spelling, indexing.

Generated kernels index flat 1-D buffers with uint64 arithmetic only (``U``
is ``np.uint64`` in the generated module): numba then skips its negative-
index wraparound checks, which otherwise block LLVM's vectorizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from yirage.compiler.kernel_ir import (
    Buffer,
    Call,
    Const,
    Expr,
    Load,
    Var,
)

RENDERER_VERSION = "2"  # 2: IEEE special values: no fast-math flags, reductions via racc/rfma/rmax
PARALLEL_MIN_WORK = 1 << 16  # below this many weighted scalar ops, waking the thread pool costs more than it saves
POINTWISE_CHUNK = 4096


def threads() -> int:
    """numba's thread count, baked into the source (and so into the cache key)."""
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def compute_type(buffer: Buffer) -> str:
    """Floats narrower than 32 bits are widened to float32 at the boundary."""
    name = buffer.dtype.name
    return "float32" if name in ("float16", "bfloat16") else name


class Emitter:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def block(self, header: str) -> Emitter:
        self(header)
        return self

    def __enter__(self) -> Emitter:
        self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


def const(value: float, ct: str) -> str:
    if ct.startswith("int"):
        return f"np.{ct}({int(value)})"
    if math.isinf(value):
        return f"np.{ct}({'-' if value < 0 else ''}np.inf)"
    return f"np.{ct}({value!r})"


def expr_src(expr: Expr, load: Callable[[Load], str], ct: str) -> str:
    """Spell an expression in numba-Python for compute type ``ct``."""
    if isinstance(expr, Load):
        return load(expr)
    if isinstance(expr, Var):
        return f"v_{expr.name}"
    if isinstance(expr, Const):
        return const(expr.value, ct)
    a = [expr_src(x, load, ct) for x in expr.args]
    f32 = ct == "float32"
    one = const(1.0, ct)
    spell = {
        "add": lambda: f"({a[0]} + {a[1]})",
        "sub": lambda: f"({a[0]} - {a[1]})",
        "mul": lambda: f"({a[0]} * {a[1]})",
        "div": lambda: f"({a[0]} / {a[1]})",
        "pow": lambda: f"({a[0]} ** {a[1]})",
        "max": lambda: f"fmax({a[0]}, {a[1]})",  # NaN-propagating, like torch.maximum and torch.clamp
        "min": lambda: f"fmin({a[0]}, {a[1]})",
        "exp": lambda: f"fexp({a[0]})" if f32 else f"math.exp({a[0]})",
        "sqrt": lambda: f"math.sqrt({a[0]})",
        "rsqrt": lambda: f"({one} / math.sqrt({a[0]}))",
        "silu": lambda: f"fsilu({a[0]})" if f32 else f"dsilu({a[0]})",
        "gelu": lambda: f"fgelu({a[0]})" if f32 else f"dgelu({a[0]})",
        "relu": lambda: f"fmax({a[0]}, {const(0, ct)})",
        "square": lambda: f"({a[0]} * {a[0]})",
        "neg": lambda: f"(-{a[0]})",
    }
    return spell[expr.fn]()


def acc_src(acc: str, x: str, ct: str) -> str:
    """``acc + x`` for a sum over a loop: reassociable for floats (``racc``), so the loop vectorizes."""
    return f"racc({acc}, {x})" if ct.startswith("float") else f"({acc} + {x})"


def fma_src(acc: str, x: str, y: str, ct: str) -> str:
    """``acc + x * y`` for a dot product: one reassociable FMA for floats (``rfma``)."""
    return f"rfma({acc}, {x}, {y})" if ct.startswith("float") else f"({acc} + {x} * {y})"


_COSTLY = {"exp": 8, "silu": 8, "gelu": 12, "pow": 12, "sqrt": 2, "rsqrt": 2, "div": 2}


def expr_cost(expr: Expr) -> int:
    """Rough scalar-op count of one evaluation: transcendental calls weigh more."""
    if isinstance(expr, Call):
        return _COSTLY.get(expr.fn, 1) + sum(expr_cost(a) for a in expr.args)
    return 1


def has_rotate(expr: Expr) -> bool:
    if isinstance(expr, Load):
        return expr.rotate_half
    if isinstance(expr, Call):
        return any(has_rotate(a) for a in expr.args)
    return False


def decompose(emit: Emitter, flat: str, dims: Sequence[int], names: Sequence[str]) -> None:
    """Emit ``names[i] = index along dims[i]`` for the row-major flat index ``flat`` (uint64)."""
    if not dims:
        return
    if len(dims) == 1:
        emit(f"{names[0]} = {flat}")
        return
    emit(f"_r = {flat}")
    for i in range(len(dims) - 1, 0, -1):
        emit(f"{names[i]} = _r % U({dims[i]})")
        emit(f"_r = _r // U({dims[i]})")
    emit(f"{names[0]} = _r")


def offset(names: Sequence[str], strides: Sequence[int]) -> str:
    """uint64 offset expression; every index is uint64 so numba skips wraparound checks."""
    terms = [f"{n} * U({s})" if s != 1 else n for n, s in zip(names, strides, strict=True) if s]
    return " + ".join(terms) or "U(0)"


def at(base: str, index: str, stride: int) -> str:
    if not stride:
        return base
    return f"{base} + {index}" if stride == 1 else f"{base} + {index} * U({stride})"


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


