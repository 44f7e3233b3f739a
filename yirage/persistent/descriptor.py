"""The one task-descriptor encoder: every layer as a row of named integer and float columns.

Runtimes that cannot walk Python objects (compiled task loops) read a layer
through its row: ``ints[layer][IntCol.N]``, the tensor of role ``r`` at
``ints[layer][spec.column(r)]``. The rows are built here from the LayerSpec
table alone, so the reference runtime, the CPU runtime and any later one see
the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from yirage.persistent.layers import Layer
from yirage.persistent.specs import ARG_COLUMNS, FloatCol, IntCol, LayerError, kind_code

ABSENT = -1  # an integer column that does not apply to the layer (or an absent optional input)


@dataclass(frozen=True)
class Descriptors:
    """Per-layer descriptor rows: ``ints[layer]`` by IntCol, ``floats[layer]`` by FloatCol."""

    ints: tuple[tuple[int, ...], ...]
    floats: tuple[tuple[float, ...], ...]

    def int_value(self, layer: int, column: IntCol) -> int:
        return self.ints[layer][column]

    def float_value(self, layer: int, column: FloatCol) -> float:
        return self.floats[layer][column]


def encode_layer(layer: Layer) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """One layer's (int row, float row); a missing role or parameter is a LayerError naming it."""
    spec = layer.spec
    ints = [ABSENT] * len(IntCol)
    floats = [0.0] * len(FloatCol)
    ints[IntCol.KIND] = kind_code(layer.kind)
    ints[IntCol.OUTPUT] = layer.output.index
    ints[IntCol.N] = layer.output.dims[1]
    ints[IntCol.TASKS] = layer.tasks
    if len(spec.roles) > len(ARG_COLUMNS):
        raise LayerError(f"layer kind {layer.kind!r} has {len(spec.roles)} input roles but descriptors hold "
                         f"{len(ARG_COLUMNS)}; add ARG columns to IntCol")
    unknown = set(layer.inputs) - set(spec.roles)
    if unknown:
        raise LayerError(f"{layer}: input roles {sorted(unknown)} are not roles of {layer.kind!r} "
                         f"({', '.join(spec.roles)})")
    for role in spec.roles:
        tensor = layer.inputs.get(role)
        if tensor is not None:
            ints[spec.column(role)] = tensor.index
        elif role not in spec.optional:
            raise LayerError(f"{layer}: the required input {role!r} is missing")
    for dim in spec.dims:
        ints[dim.column] = layer.inputs[dim.role].dims[dim.axis] // dim.divisor
    for param in spec.params:
        if param.name not in layer.params:
            raise LayerError(f"{layer}: parameter {param.name!r} ({param.type.__name__}) is missing")
        value = layer.params[param.name]
        if param.type is int:
            ints[param.column] = int(value)
        else:
            floats[param.column] = float(value)
    return tuple(ints), tuple(floats)


def encode(layers: Sequence[Layer]) -> Descriptors:
    """The descriptor rows of ``layers``, row ``i`` for the layer with index ``i``."""
    for i, layer in enumerate(layers):
        if layer.index != i:
            raise LayerError(f"layer {layer} sits at position {i}; layers must be encoded in index order")
    rows = [encode_layer(layer) for layer in layers]
    return Descriptors(tuple(r[0] for r in rows), tuple(r[1] for r in rows))
