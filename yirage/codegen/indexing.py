"""Index arithmetic every renderer needs: broadcast strides, dim coalescing, flat-index decomposition.

Every renderer (the C-family and Triton renderers here, numba in backends/cpu) walks a kernel's iteration
space the same way: a buffer's strides over that space (0 where it broadcasts), adjacent dims merged where
every buffer walks them as one, and a row-major flat index turned into per-dim indices and per-buffer offsets.
Only the spelling differs (numba wraps constants in ``U(...)`` so all index math stays uint64, C writes
``16UL`` and declares its variables). ``IndexSyntax`` holds those spellings; the functions here hold the
arithmetic. It lives in codegen, not compiler, because only renderers use it (the compiler may not import
codegen: tests/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from yirage.codegen.emit import Emitter
from yirage.compiler.kernel_ir import Buffer

Dims = tuple[int, ...]


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


def broadcast_strides(buffer: Buffer, space: Sequence[int]) -> Dims:
    """Element strides of ``buffer`` over ``space``: right-aligned, 0 where broadcast."""
    pad = len(space) - len(buffer.dims)
    if pad < 0:
        raise ValueError(f"buffer {buffer.name} {buffer.dims} has more dims than the space {tuple(space)}")
    out = []
    for axis, extent in enumerate(space):
        if axis < pad:
            out.append(0)
            continue
        dim = buffer.dims[axis - pad]
        if dim == extent:
            out.append(buffer.strides[axis - pad] if extent > 1 else 0)
        elif dim == 1:
            out.append(0)
        else:
            raise ValueError(f"buffer {buffer.name} {buffer.dims} does not broadcast to {tuple(space)}")
    return tuple(out)


def coalesce(
    space: Sequence[int], strides: Sequence[Sequence[int]], keep: Sequence[int] = ()
) -> tuple[Dims, list[Dims], list[int]]:
    """Merge adjacent dims that every buffer walks as one; drop size-1 dims.

    ``keep`` lists axes that must survive unmerged (e.g. the axis a row
    kernel reduces). Returns the new space, each buffer's new strides, and
    for each new dim the original axis it starts at.
    """
    axes = [a for a, extent in enumerate(space) if extent > 1 or a in keep]
    if not axes:
        return (1,), [(0,) for _ in strides], [len(space) - 1]
    new_space = [space[axes[0]]]
    new_strides = [[s[axes[0]]] for s in strides]
    origin = [axes[0]]
    for prev, axis in zip(axes, axes[1:], strict=False):
        mergeable = axis not in keep and prev not in keep and all(
            s[prev] == s[axis] * space[axis] for s in strides
        )
        if mergeable:
            new_space[-1] *= space[axis]
            for ns, s in zip(new_strides, strides, strict=True):
                ns[-1] = s[axis]
        else:
            new_space.append(space[axis])
            origin.append(axis)
            for ns, s in zip(new_strides, strides, strict=True):
                ns.append(s[axis])
    return tuple(new_space), [tuple(ns) for ns in new_strides], origin
