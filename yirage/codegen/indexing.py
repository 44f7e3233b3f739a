"""Flat-index arithmetic for generated kernels, spelled through a small syntax table.

Every renderer turns a row-major flat index into per-dim indices and per-buffer
offsets the same way; only the spelling differs (numba wraps constants in
``U(...)`` so all index math stays uint64, C writes ``16UL`` and declares its
variables). ``IndexSyntax`` holds those spellings; the functions here hold the
arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from yirage.codegen.emit import Emitter


@dataclass(frozen=True)
class IndexSyntax:
    """How a language spells index arithmetic.

    ``const(n)``: an unsigned index constant; ``declare(name, value)``: a new
    index variable (a statement); ``assign(name, value)``: a new value for an
    existing one; ``floordiv``: the integer-division operator.
    """

    const: Callable[[int], str]
    declare: Callable[[str, str], str]
    assign: Callable[[str, str], str]
    floordiv: str = "/"


def decompose(emit: Emitter, flat: str, dims: Sequence[int], names: Sequence[str], syntax: IndexSyntax,
              scratch: str = "_r") -> None:
    """Emit ``names[i] = index along dims[i]`` for the row-major flat index ``flat``.

    ``scratch`` is the temporary that carries the remaining quotient; a language
    with block-scoped declarations needs a fresh one per scope.
    """
    if len(names) != len(dims):
        raise ValueError(f"decompose: {len(names)} names for {len(dims)} dims; pass one name per dim")
    if not dims:
        return
    if len(dims) == 1:
        emit(syntax.declare(names[0], flat))
        return
    emit(syntax.declare(scratch, flat))
    for i in range(len(dims) - 1, 0, -1):
        emit(syntax.declare(names[i], f"{scratch} % {syntax.const(dims[i])}"))
        emit(syntax.assign(scratch, f"{scratch} {syntax.floordiv} {syntax.const(dims[i])}"))
    emit(syntax.declare(names[0], scratch))


def offset(names: Sequence[str], strides: Sequence[int], syntax: IndexSyntax) -> str:
    """The offset expression ``sum(names[i] * strides[i])``; zero strides (broadcast) drop out."""
    terms = [f"{n} * {syntax.const(s)}" if s != 1 else n for n, s in zip(names, strides, strict=True) if s]
    return " + ".join(terms) or syntax.const(0)


def at(base: str, index: str, stride: int, syntax: IndexSyntax) -> str:
    """``base + index * stride``, simplified for strides 0 and 1."""
    if not stride:
        return base
    return f"{base} + {index}" if stride == 1 else f"{base} + {index} * {syntax.const(stride)}"
