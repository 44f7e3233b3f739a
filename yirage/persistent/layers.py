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

from yirage.errors import NotSupportedError
from yirage.persistent.specs import LayerError, LayerSpec, Partition, layer_spec

__all__ = ["Layer", "LayerError", "PKTensor", "check_collective_layer", "check_world", "require", "split_ok"]


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


# -- multi-rank kernels (tensor parallelism): what must hold before collectives can be built in ------------------
def _process_group() -> tuple[int, int] | None:
    """(world size, rank) of the torch.distributed process group this process joined, None without one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size(), dist.get_rank()


def check_world(backend: Any, world_size: Any, mpi_rank: Any) -> tuple[int, int]:
    """(world_size, mpi_rank) of a PersistentKernel, after checking the backend and the process group."""
    for what, value, low in (("world_size", world_size, 1), ("mpi_rank", mpi_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise LayerError(f"PersistentKernel({what}={value!r}): pass an int >= {low}")
    if mpi_rank >= world_size:
        raise LayerError(f"PersistentKernel(world_size={world_size}, mpi_rank={mpi_rank}): ranks are 0 .. "
                         f"{world_size - 1}; pass this process's rank (yirage.distributed.resolve_world() reads it "
                         "from torchrun's environment)")
    if world_size == 1:
        return world_size, mpi_rank
    if backend.collective_backend() is None:
        raise NotSupportedError(f"PersistentKernel(world_size={world_size}): backend {backend.name!r} cannot run "
                                "multi-rank (its collective_backend() is None); use a backend that names one (the "
                                "CPU backend: gloo), or world_size=1")
    group = _process_group()
    if group is None:
        raise LayerError(f"PersistentKernel(world_size={world_size}, mpi_rank={mpi_rank}) needs the process group: "
                         f"call yirage.distributed.init_world({backend.name!r}) on every rank first (start the "
                         "ranks with torchrun, or mpirun with MASTER_ADDR/MASTER_PORT exported)")
    if group != (world_size, mpi_rank):
        raise LayerError(f"PersistentKernel(world_size={world_size}, mpi_rank={mpi_rank}), but this process joined "
                         f"the process group as rank {group[1]} of {group[0]}: pass world_size={group[0]}, "
                         f"mpi_rank={group[1]}")
    return world_size, mpi_rank


def check_collective_layer(layer: str, world: tuple[int, int], label: Any, grid_dim: Any) -> None:
    """A collective layer needs a label for its errors, one task, and the process group of the kernel's ranks."""
    require(isinstance(label, str) and bool(label.strip()), layer,
            f"label={label!r}: pass a short description such as 'layer 3 o_proj all-reduce'; a failed collective "
            "names it")
    require(grid_dim in (1, (1,), (1, 1, 1), [1, 1, 1]), layer,
            f"grid_dim={grid_dim!r}: a collective is one task; pass grid_dim=1")
    group = _process_group()
    require(group == world, layer,
            f"this kernel is rank {world[1]} of {world[0]}, but "
            f"{'there is no process group' if group is None else f'this process is rank {group[1]} of {group[0]}'}"
            ": call yirage.distributed.init_world(backend) on every rank (a group of one for world_size=1) and "
            "build the kernel with this process's world_size= and mpi_rank=")
