"""Index arithmetic every renderer needs: broadcast strides and dim coalescing."""

from __future__ import annotations

from collections.abc import Sequence

from yirage.compiler.kernel_ir import Buffer

Dims = tuple[int, ...]


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
