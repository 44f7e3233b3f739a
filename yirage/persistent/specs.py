"""The LayerSpec table: every PersistentKernel layer kind described as data.

One row per kind says which input roles it reads (in descriptor order), how
its tasks partition the output columns and each input, which parameters it
takes (name, type, descriptor column), which dimensions the task bodies need,
which meta tensors it reads, which inputs it writes in place and whether it
picks the next token. The task graph, the descriptor encoder, the kernel's
checks and every runtime read this table instead of switching on kind names,
so a new layer kind is one row here plus one task body per backend (the model
is Mirage MPK's ``persistent_kernel.py``, where each layer registers a task
with a partition map).

Descriptor columns are named (``IntCol`` / ``FloatCol``); a runtime indexes a
layer's descriptor row by these names, never by bare numbers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum, IntEnum

from yirage.errors import YirageError


class LayerError(YirageError, ValueError):
    """A layer wired to tensors it cannot take; raised when the layer is added."""


class IntCol(IntEnum):
    """Integer descriptor columns (one row per layer; -1 where a column does not apply)."""

    KIND = 0  # kind_code(kind)
    OUTPUT = 1  # tensor index of the output
    ARG0 = 2  # tensor index of the spec's roles[0] (then roles[1] in ARG1, ...)
    ARG1 = 3
    ARG2 = 4
    ARG3 = 5
    ARG4 = 6
    K = 7  # reduction width: input columns // the spec's divisor (pickers: vocab)
    N = 8  # output columns
    TASKS = 9  # tasks of the layer
    KV_HEADS = 10
    GROUP = 11  # query heads per kv head
    HEAD_DIM = 12
    CACHE_SEQ = 13  # positions the KV caches hold
    TOP_K = 14
    SEED = 15


class FloatCol(IntEnum):
    """Float descriptor columns (0.0 where a column does not apply)."""

    EPS = 0
    TEMPERATURE = 1
    TOP_P = 2


ARG_COLUMNS = (IntCol.ARG0, IntCol.ARG1, IntCol.ARG2, IntCol.ARG3, IntCol.ARG4)


class Partition(Enum):
    """How a layer's tasks split a tensor's columns into contiguous parts."""

    WHOLE = "whole"  # one part: every task reads (or the one task writes) all columns
    PER_TASK = "per_task"  # task t owns part t
    PER_KV_HEAD = "per_kv_head"  # task t owns the part of its kv group, t % kv_heads


@dataclass(frozen=True)
class Param:
    """A layer parameter: its name in ``Layer.params``, its type and its descriptor column."""

    name: str
    type: type
    column: IntCol | FloatCol


@dataclass(frozen=True)
class DimColumn:
    """A descriptor column filled from a tensor's shape: ``inputs[role].dims[axis] // divisor``."""

    column: IntCol
    role: str
    axis: int
    divisor: int = 1


@dataclass(frozen=True)
class LayerSpec:
    """What one layer kind reads, writes, takes and how its work splits (see the module docstring)."""

    kind: str
    method: str  # the PersistentKernel method that adds it (Mirage's API name)
    roles: tuple[str, ...]  # input roles, in descriptor order (ARG0, ARG1, ...)
    output: Partition = Partition.PER_TASK
    reads: tuple[tuple[str, Partition], ...] = ()  # roles not read WHOLE
    optional: frozenset[str] = frozenset()  # roles that may be absent (their column stays -1)
    params: tuple[Param, ...] = ()
    dims: tuple[DimColumn, ...] = ()
    meta: frozenset[str] = frozenset()  # meta tensors read: "tokens", "step"
    writes: tuple[str, ...] = ()  # input roles written in place (KV caches)
    picks_token: bool = False  # its output is the next token of every row
    token_table: str | None = None  # the role whose rows the current token ids index
    # a collective across the ranks of a tensor-parallel run ("all_reduce", "all_gather"): its one task hands
    # the input to the runtime's communication thread and waits for the result (yirage.distributed.collectives)
    collective: str | None = None

    def read_partition(self, role: str) -> Partition:
        return dict(self.reads).get(role, Partition.WHOLE)

    def column(self, role: str) -> IntCol:
        """The descriptor column holding the tensor index of input ``role``."""
        if role not in self.roles:
            raise KeyError(f"layer kind {self.kind!r} has no input role {role!r}; its roles are {self.roles}")
        return ARG_COLUMNS[self.roles.index(role)]


_K = DimColumn(IntCol.K, "input", 1)

LAYER_SPECS: dict[str, LayerSpec] = {spec.kind: spec for spec in (
    LayerSpec("embed", "embed_layer", ("input", "weight"), meta=frozenset({"tokens", "step"}), token_table="weight"),
    LayerSpec("rmsnorm_linear", "rmsnorm_linear_layer", ("input", "weight_linear", "weight_norm", "bias"),
              optional=frozenset({"bias"}), params=(Param("eps", float, FloatCol.EPS),), dims=(_K,)),
    LayerSpec("attention", "attention_layer", ("input", "k_cache", "v_cache", "cos", "sin"),
              output=Partition.PER_KV_HEAD, reads=(("input", Partition.PER_KV_HEAD),),
              params=(Param("kv_heads", int, IntCol.KV_HEADS), Param("group", int, IntCol.GROUP),
                      Param("head_dim", int, IntCol.HEAD_DIM)),
              dims=(DimColumn(IntCol.CACHE_SEQ, "k_cache", 2),), meta=frozenset({"step"}),
              writes=("k_cache", "v_cache")),
    LayerSpec("linear_with_residual", "linear_with_residual_layer", ("input", "weight", "residual"),
              reads=(("residual", Partition.PER_TASK),), dims=(_K,)),
    LayerSpec("silu_mul_linear_with_residual", "silu_mul_linear_with_residual_layer",
              ("input", "weight", "residual"), reads=(("residual", Partition.PER_TASK),),
              dims=(DimColumn(IntCol.K, "input", 1, 2),)),  # input = [gate | up]
    LayerSpec("argmax", "argmax_layer", ("input",), output=Partition.WHOLE, dims=(_K,), picks_token=True),
    LayerSpec("sample", "sampling_layer", ("input",), output=Partition.WHOLE, dims=(_K,), picks_token=True,
              params=(Param("temperature", float, FloatCol.TEMPERATURE), Param("top_k", int, IntCol.TOP_K),
                      Param("top_p", float, FloatCol.TOP_P), Param("seed", int, IntCol.SEED)),
              meta=frozenset({"step"})),
    # tensor parallelism: one task each; the runtime runs the collective (labelled by the layer's "label" param)
    LayerSpec("allreduce", "allreduce_layer", ("input",), output=Partition.WHOLE, collective="all_reduce"),
    LayerSpec("allgather", "allgather_layer", ("input",), output=Partition.WHOLE, collective="all_gather"),
    # a greedy LM head read in two passes (kernel.screened_logits_layer): the exact logits of the rows whose screen
    # score can hold the row's maximum, -inf elsewhere; runtimes that lack it decline it (PersistentKernel.runs)
    LayerSpec("screened_logits", "screened_logits_layer", ("input", "hidden", "weight_norm", "weight", "row_bound"),
              output=Partition.WHOLE, params=(Param("eps", float, FloatCol.EPS),), dims=(_K,)),
)}

#: screened_logits' bound on |screen - exact| is ``row_bound[i] * sum|x| + K * SCREEN_UNDERFLOW``: a product or a sum
#: that underflows is off by up to 2^-150 however small the row, which a relative bound does not cover
SCREEN_UNDERFLOW = 2.0**-148
#: and a row whose ``row_bound[i] * sum|x|`` reaches SCREEN_OVERFLOW is not trusted (every row computed exactly): its
#: float32 dot products can overflow (|partial sums| <= max|W_i| * sum|x| < 2^8 * that), where no relative bound holds
SCREEN_OVERFLOW = 2.0**118

KIND_CODES: dict[str, int] = {kind: code for code, kind in enumerate(LAYER_SPECS)}


def layer_spec(kind: str) -> LayerSpec:
    """The spec of ``kind``; an unknown kind is a clear error, not a KeyError deep in a runtime."""
    spec = LAYER_SPECS.get(kind)
    if spec is None:
        raise LayerError(f"unknown layer kind {kind!r}; known kinds: {', '.join(LAYER_SPECS)}. "
                         "Add a LayerSpec to yirage.persistent.specs.LAYER_SPECS for a new kind")
    return spec


def kind_code(kind: str) -> int:
    """The integer a descriptor stores in ``IntCol.KIND`` for ``kind``."""
    layer_spec(kind)
    return KIND_CODES[kind]


def layout_fingerprint() -> int:
    """A 62-bit hash of the descriptor layout: columns, kind codes and role columns.

    Compiled runtimes that bake column numbers into cached machine code
    compare it with the value they were compiled with, so a changed table
    recompiles them instead of reading the wrong columns.
    """
    parts = [f"{c.name}={c.value}" for c in (*IntCol, *FloatCol)]
    parts += [f"{kind}:{KIND_CODES[kind]}:{','.join(spec.roles)}" for kind, spec in LAYER_SPECS.items()]
    return int.from_bytes(hashlib.sha256(";".join(parts).encode()).digest()[:8], "little") >> 2
