"""The frozen program a backend's PersistentKernel runtime is built from.

``PersistentKernel.compile()`` freezes what it built (tensors, layers, task
graph, descriptor rows, meta tensors) into one ``PersistentProgram`` and
hands it to ``backend.persistent_runtime(program, config)``. Runtimes read
only the program: adding a layer to the kernel afterwards cannot change what
a runtime already runs (the kernel drops its runtime and compiles again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from yirage.persistent.descriptor import Descriptors, encode
from yirage.persistent.layers import Layer, PKTensor
from yirage.persistent.task_graph import TaskGraph, build_task_graph


@dataclass(frozen=True, eq=False)
class PersistentProgram:
    """Everything a runtime needs; frozen (see the module docstring).

    ``tensors`` is ordered by ``PKTensor.index`` (the numbers descriptors
    store); ``values`` maps the attached tensors' names to their torch
    tensors (``tokens`` included; ``step`` is separate: it is not a named
    tensor). The task graph's lists are read-only by convention.
    """

    batch: int
    max_seq_length: int
    eos_token_ids: tuple[int, ...]
    tensors: tuple[PKTensor, ...]
    values: Mapping[str, Any]
    step: Any
    tokens: Any
    layers: tuple[Layer, ...]
    task_graph: TaskGraph
    descriptors: Descriptors
    profiler_tensor: Any = None

    @property
    def picker(self) -> Layer:
        """The last layer: it picks every row's next token."""
        return self.layers[-1]

    @property
    def tokens_id(self) -> int:
        return self.tensor("tokens").index

    @property
    def pick_id(self) -> int:
        return self.picker.output.index

    def tensor(self, name: str) -> PKTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"{name!r} is not a tensor of this program; it has {', '.join(t.name for t in self.tensors)}")

    @property
    def vocab(self) -> int | None:
        """Rows of the table the current tokens index (the embed weight), if a layer reads one."""
        for layer in self.layers:
            if layer.spec.token_table is not None:
                return layer.inputs[layer.spec.token_table].dims[0]
        return None


def build_program(
    *,
    batch: int,
    max_seq_length: int,
    eos_token_ids: list[int],
    tensors: Mapping[str, PKTensor],
    torch_tensors: Mapping[str, Any],
    step: Any,
    tokens: Any,
    layers: list[Layer],
    profiler_tensor: Any = None,
) -> PersistentProgram:
    """Build the task graph and the descriptor rows, and freeze them with the rest."""
    ordered = tuple(sorted(tensors.values(), key=lambda t: t.index))
    if [t.index for t in ordered] != list(range(len(ordered))):
        raise AssertionError("PersistentKernel tensor indices are not 0..n-1")  # a build bug, not user input
    frozen_layers = tuple(layers)
    return PersistentProgram(
        batch=int(batch), max_seq_length=int(max_seq_length), eos_token_ids=tuple(int(e) for e in eos_token_ids),
        tensors=ordered, values=MappingProxyType(dict(torch_tensors)), step=step, tokens=tokens,
        layers=frozen_layers, task_graph=build_task_graph(list(frozen_layers)), descriptors=encode(frozen_layers),
        profiler_tensor=profiler_tensor,
    )
