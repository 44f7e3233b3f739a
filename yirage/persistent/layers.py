"""PersistentKernel layers: what each one reads and writes, and how its tasks split the work.

Every layer becomes ``grid`` tasks. A task writes one contiguous part of
the layer's output columns (all batch rows), or one (batch, kv-group) block
for attention. For each input a layer also says how many contiguous column
parts its tasks read (1: every task reads the whole input); events between
a producer and a consumer partition that shared dimension by the gcd of the
two splits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yirage.errors import YirageError


class LayerError(YirageError, ValueError):
    """A layer wired to tensors it cannot take; raised when the layer is added."""


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


@dataclass
class Layer:
    """One layer: its kind, tensors, task count and how tasks map to parts."""

    kind: str
    index: int
    inputs: dict[str, PKTensor]  # role -> tensor
    output: PKTensor
    tasks: int
    params: dict[str, Any] = field(default_factory=dict)

    def write_part(self, task: int) -> int:
        """Which output column part task ``task`` writes (attention: its kv group)."""
        return task % self.out_parts

    @property
    def out_parts(self) -> int:
        if self.kind == "attention":
            return self.params["kv_heads"]
        if self.kind in ("argmax", "sample"):
            return 1
        return self.tasks

    def read_parts(self, role: str) -> int:
        """How many contiguous column parts the tasks read input ``role`` in (1: all of it)."""
        if self.kind == "attention" and role == "input":
            return self.params["kv_heads"]
        if self.kind in ("linear_with_residual", "silu_mul_linear_with_residual") and role == "residual":
            return self.tasks
        return 1

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
