"""PersistentKernel layers: what each one reads and writes, and how its tasks split the work.

Every layer becomes ``grid`` tasks. A task writes one contiguous part of
the layer's output columns (all batch rows), or one (batch, kv-group) block
for attention. For each input a layer also says how many contiguous column
parts its tasks read (1: every task reads the whole input); events between
a producer and a consumer partition that shared dimension by the gcd of the
two splits. Those rules are data: the kind's LayerSpec (yirage.persistent.specs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from yirage.persistent.specs import LayerError, LayerSpec, Partition, layer_spec

__all__ = ["Layer", "LayerError", "PKTensor", "require", "split_ok"]


@dataclass(frozen=True)
class PKTensor:
    """A tensor of a PersistentKernel: attached (torch memory) or internal (arena)."""

    name: str
    dims: tuple[int, ...]
    dtype: str
    attached: bool
    index: int

    def __str__(self) -> str:
        return f"{self.name} {self.dims} {self.dtype}"


@dataclass(frozen=True, eq=False)
class Layer:
    """One layer: its kind, tensors, task count and parameters; frozen once added.

    How its tasks map to column parts comes from its kind's LayerSpec.
    """

    kind: str
    index: int
    inputs: Mapping[str, PKTensor]  # role -> tensor
    output: PKTensor
    tasks: int
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layer_spec(self.kind)  # an unknown kind fails here, with the list of known ones
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def spec(self) -> LayerSpec:
        return layer_spec(self.kind)

    def _parts(self, partition: Partition) -> int:
        if partition is Partition.WHOLE:
            return 1
        if partition is Partition.PER_TASK:
            return self.tasks
        return int(self.params["kv_heads"])

    def write_part(self, task: int) -> int:
        """Which output column part task ``task`` writes (attention: its kv group)."""
        return task % self.out_parts

    @property
    def out_parts(self) -> int:
        return self._parts(self.spec.output)

    def read_parts(self, role: str) -> int:
        """How many contiguous column parts the tasks read input ``role`` in (1: all of it)."""
        return self._parts(self.spec.read_partition(role))

    def read_part(self, role: str, task: int) -> int:
        return task % self.read_parts(role)

    def __str__(self) -> str:
        ins = ", ".join(f"{role}={t.name}" for role, t in self.inputs.items())
        return f"L{self.index} {self.kind}({ins}) -> {self.output.name}  [{self.tasks} tasks]"


def require(cond: bool, layer: str, message: str) -> None:
    if not cond:
        raise LayerError(f"{layer}: {message}")


def split_ok(layer: str, columns: int, grid: int) -> None:
    require(grid >= 1, layer, f"grid_dim must give at least one task, got {grid}")
    require(columns % grid == 0, layer,
            f"{columns} output columns do not split evenly into grid_dim={grid} tasks; pick a divisor of {columns}")
