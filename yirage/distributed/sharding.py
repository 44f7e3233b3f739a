"""The tensor-parallel split of a Llama-family model over N ranks, and loaders that read only a rank's slices.

Megatron's split, in LlamaModel's decode layout (yirage/models/weights.py):

- ``qkv`` column-parallel by KV head groups: rank r holds KV heads
  ``r*kv/N .. (r+1)*kv/N`` and the query heads that attend with them, in the
  fused order ``[q heads of g | k_g | v_g]`` per local KV head g. That order is
  grouped per KV head, so rank r's rows are one contiguous block of the
  single-rank fused matrix. The KV cache is sharded the same way.
- ``gate_up`` column-parallel: rank r holds gate rows and up rows
  ``r*ff/N .. (r+1)*ff/N``, fused as ``[gate_r | up_r]``.
- ``o`` and ``down`` row-parallel: rank r holds the input columns matching its
  heads / its intermediate rows; their outputs are partial sums, all-reduced.
- ``lm_head`` vocab-parallel: rank r holds vocabulary rows ``r*P .. min((r+1)*P, V)``
  with ``P = ceil(V/N)``; the last shard is short, and logits exchanged between
  ranks are padded to P columns (the padding never wins the argmax). A tied
  lm_head is a view of the replicated embedding rows.
- ``embed`` and the norms replicated. The embedding could be vocab-parallel, but a
  lookup reads one row per token (negligible bandwidth) and a vocab-parallel one
  costs an extra all-reduce per token: decode on N ranks is latency-bound, so the
  memory (V x hidden per rank) is the better price.

Quantized (Q8_0 / Q4_0) matrices keep whole blocks: row slices always do, and the
column slices of ``o`` and ``down`` must fall on 32-column block boundaries
(``heads/N * head_dim`` and ``ff/N`` multiples of 32) or the plan refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yirage.distributed.world import DistributedError
from yirage.models.config import LlamaConfig, ModelError, check_model_dir, load_config, resolve_dtype
from yirage.models.weights import Reader, Slices, decode_weights
from yirage.quant import BLOCK, QuantizedTensor


class ShardError(DistributedError, ModelError):
    """A model that cannot be split over the requested ranks; the message names the numbers and the valid N."""


def valid_world_sizes(config: LlamaConfig, fmt: str | None = None) -> list[int]:
    """Every world size this model splits over (with quantized blocks in ``fmt``: whole blocks per rank)."""
    c = config
    sizes = []
    for n in range(1, c.kv_heads + 1):
        if c.kv_heads % n or c.intermediate % n or c.vocab <= (n - 1) * -(-c.vocab // n):
            continue
        if fmt and ((c.heads // n * c.head_dim) % BLOCK or (c.intermediate // n) % BLOCK):
            continue
        sizes.append(n)
    return sizes


@dataclass(frozen=True)
class ShardPlan:
    """How one model splits over ``world_size`` ranks: per-rank head, intermediate and vocabulary counts."""

    config: LlamaConfig
    world_size: int
    heads: int  # query heads per rank
    kv_heads: int  # KV heads per rank
    intermediate: int  # gate (and up) rows per rank
    vocab_per_rank: int  # P = ceil(vocab / world_size): the padded shard width
    fmt: str | None = None  # quantized block format of the matrices, None for float

    def kv_range(self, rank: int) -> tuple[int, int]:
        return rank * self.kv_heads, (rank + 1) * self.kv_heads

    def ff_range(self, rank: int) -> tuple[int, int]:
        return rank * self.intermediate, (rank + 1) * self.intermediate

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """The vocabulary rows rank ``rank`` holds (the last shard may be shorter than vocab_per_rank)."""
        return rank * self.vocab_per_rank, min((rank + 1) * self.vocab_per_rank, self.config.vocab)

    def local_config(self) -> LlamaConfig:
        """The config of one rank's slice (its heads, KV heads and intermediate rows; hidden and vocab whole)."""
        return dataclasses.replace(self.config, heads=self.heads, kv_heads=self.kv_heads,
                                   intermediate=self.intermediate)

    def describe(self) -> str:
        c = self.config
        return (f"{self.world_size} ranks: each {self.kv_heads}/{c.kv_heads} KV heads ({self.heads}/{c.heads} query "
                f"heads), {self.intermediate}/{c.intermediate} intermediate rows, {self.vocab_per_rank} of "
                f"{c.vocab} vocabulary rows (last shard {c.vocab - (self.world_size - 1) * self.vocab_per_rank}); "
                "embedding and norms replicated")


def plan_shards(config: LlamaConfig, world_size: int, fmt: str | None = None) -> ShardPlan:
    """The ShardPlan of ``config`` over ``world_size`` ranks, or a ShardError naming the numbers and the valid N."""
    c, n = config, world_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ShardError(f"world_size={n!r} must be a positive int")
    valid = ", ".join(map(str, valid_world_sizes(c, fmt)))
    problems = []
    if c.kv_heads % n:
        problems.append(f"num_key_value_heads={c.kv_heads} is not a multiple of {n} (each rank needs whole KV heads "
                        "and the query heads that share them)")
    if c.intermediate % n:
        problems.append(f"intermediate_size={c.intermediate} is not a multiple of {n}")
    if not problems and c.vocab <= (n - 1) * -(-c.vocab // n):
        problems.append(f"vocab_size={c.vocab} leaves rank {n - 1} no vocabulary rows")
    if not problems and fmt:
        q_cols, ff_cols = c.heads // n * c.head_dim, c.intermediate // n
        for what, cols in (("o_proj's input columns per rank (heads/N * head_dim)", q_cols),
                           ("down_proj's input columns per rank (intermediate/N)", ff_cols)):
            if cols % BLOCK:
                problems.append(f"{what} = {cols} do not fall on {fmt} block boundaries (multiples of {BLOCK}); a "
                                "rank would hold part of a block")
    if problems:
        raise ShardError(f"this model cannot be split over world_size={n}: {'; '.join(problems)}. Valid world sizes "
                         f"for it{f' in {fmt}' if fmt else ''}: {valid or 'none'}")
    return ShardPlan(c, n, c.heads // n, c.kv_heads // n, c.intermediate // n, -(-c.vocab // n), fmt)


@dataclass
class RankShard:
    """One rank's weights in LlamaModel's layout (``embed``, ``norm``, ``lm_head``, ``blocks``) and its plan."""

    plan: ShardPlan
    rank: int
    embed: Any
    norm: Any
    lm_head: Any
    blocks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def vocab_range(self) -> tuple[int, int]:
        return self.plan.vocab_range(self.rank)

    def tensors(self) -> list[Any]:
        out = [self.embed, self.norm, self.lm_head]
        for blk in self.blocks:
            out.extend(blk.values())
        return out

    def nbytes_held(self) -> int:
        """Bytes of memory the shard's tensors keep alive (shared storages counted once)."""
        seen: dict[int, int] = {}
        for t in self.tensors():
            storage = (t.blocks if isinstance(t, QuantizedTensor) else t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


def build_shard(plan: ShardPlan, rank: int, read: Reader, dtype: Any = None, has_lm_head: bool = True,
                device: Any = "cpu") -> RankShard:
    """Rank ``rank``'s weights from ``read`` (which returns only the requested slice), in the one decode layout
    (yirage.models.weights.decode_weights), placed on ``device``.

    ``dtype``: None (the checkpoint's), a float dtype, or "q8_0"/"q4_0" (matrices quantized; must match the plan).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise ShardError(f"rank={rank!r} must be an int in [0, {plan.world_size}) for a {plan.world_size}-rank plan")
    d, g = plan.config.head_dim, plan.config.group
    fmt = resolve_dtype(dtype)
    fmt = fmt if isinstance(fmt, str) else None
    if fmt != plan.fmt:
        raise ShardError(f"dtype={fmt or dtype!r} but the plan was made for {plan.fmt or 'float'} matrices; pass "
                         f"fmt={fmt!r} to plan_shards")
    (k0, k1), (f0, f1), (v0, v1) = plan.kv_range(rank), plan.ff_range(rank), plan.vocab_range(rank)
    slices = Slices(q_rows=slice(k0 * g * d, k1 * g * d), kv_rows=slice(k0 * d, k1 * d), ff=slice(f0, f1),
                    vocab=slice(v0, v1))
    w = decode_weights(plan.config, read, dtype, has_lm_head=has_lm_head, device=device, slices=slices,
                       local=plan.local_config())
    return RankShard(plan, rank, w.embed, w.norm, w.lm_head, w.blocks)


def _checked_reader(config: LlamaConfig, raw: Callable[[str], Any], slicer: Callable[[Any, Any, Any], Any],
                    where: str) -> Reader:
    """A Reader over a source whose tensors ``raw(name)`` returns (lazily) and ``slicer`` slices; shapes checked."""
    shapes = config.weight_shapes()

    def read(name: str, rows: slice | None, cols: slice | None) -> Any:
        handle, shape = raw(name)
        if tuple(shape) != shapes[name]:
            raise ModelError(f"weight {name!r} in {where} has shape {tuple(shape)}, but the config implies "
                             f"{shapes[name]}; the checkpoint and its config disagree: fix or re-export them")
        return slicer(handle, rows, cols)

    return read


def shard_state_dict(config: LlamaConfig, weights: dict[str, Any], world_size: int, rank: int,
                     dtype: Any = None, device: Any = "cpu") -> RankShard:
    """Rank ``rank``'s shard of an in-memory Hugging Face state dict (names with or without ``model.``)."""
    w = {k.removeprefix("model."): v for k, v in weights.items()}

    def raw(name: str) -> tuple[Any, Any]:
        if name not in w:
            raise ModelError(f"weight {name!r} is missing from the state dict")
        return w[name], w[name].shape

    def slicer(t: Any, rows: Any, cols: Any) -> Any:
        t = t if rows is None else t[rows]
        return (t if cols is None else t[:, cols]).clone()  # only the slice stays alive

    fmt = resolve_dtype(dtype)
    plan = plan_shards(config, world_size, fmt if isinstance(fmt, str) else None)
    tied = "lm_head.weight" not in w and config.tie_embeddings
    return build_shard(plan, rank, _checked_reader(config, raw, slicer, "the state dict"), dtype, not tied, device)


def load_shard(model_dir: str | Path, world_size: int, rank: int, dtype: Any = None,
               device: Any = "cpu") -> RankShard:
    """Rank ``rank``'s shard of a Hugging Face model directory, reading only its slices of the safetensors files."""
    from safetensors import safe_open

    path = check_model_dir(model_dir)
    config = load_config(path)
    fmt = resolve_dtype(dtype)
    plan = plan_shards(config, world_size, fmt if isinstance(fmt, str) else None)  # before reading any tensor
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors files in {path}; save the model with safe_serialization=True")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k.removeprefix("model."): (h, k) for h in handles for k in h.keys()}

    def raw(name: str) -> tuple[Any, Any]:
        if name not in where:
            raise ModelError(f"weight {name!r} is missing from the checkpoint in {path}")
        handle, key = where[name]
        sl = handle.get_slice(key)
        return sl, sl.get_shape()

    def slicer(sl: Any, rows: Any, cols: Any) -> Any:
        import torch

        if cols is not None:
            view = sl[slice(None) if rows is None else rows, cols]
        else:
            view = sl[rows] if rows is not None else sl[:]
        # safetensors returns a view of the whole tensor's memory map (only touched pages are read): copy the
        # slice out, so the shard owns exactly its bytes and does not pin the file's mapping
        return view.clone(memory_format=torch.contiguous_format)

    tied = "lm_head.weight" not in where and config.tie_embeddings
    return build_shard(plan, rank, _checked_reader(config, raw, slicer, str(path)), dtype, not tied, device)


def load_gguf_shard(path: str | Path, world_size: int, rank: int, dtype: Any = None,
                    device: Any = "cpu") -> RankShard:
    """Rank ``rank``'s shard of a GGUF file: rows and columns are sliced in the file's memory map, then only the
    slice is dequantized (quantized column slices must start and end on block boundaries)."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from yirage.models.gguf import (
        PERMUTED_QK,
        TENSOR_TYPES,
        GGUFError,
        gguf_name,
        hf_name,
        open_gguf,
        read_config,
        unpermute_qk,
    )

    fmt = resolve_dtype(dtype)
    reader = open_gguf(path)
    config, _ = read_config(reader, path)
    plan = plan_shards(config, world_size, fmt if isinstance(fmt, str) else None)
    tensors = {hf_name(t.name).removeprefix("model."): t for t in reader.tensors}

    def raw(name: str) -> tuple[Any, Any]:
        if name not in tensors:
            raise GGUFError(f"the GGUF file lacks tensor {gguf_name(name)!r} (HF {name}); it is incomplete: "
                            "re-convert it")
        t = tensors[name]
        if t.tensor_type.name not in TENSOR_TYPES:
            raise GGUFError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which yirage does not read "
                            f"({', '.join(TENSOR_TYPES)}); re-quantize the model")
        return t, tuple(int(n) for n in reversed(t.shape))

    def slicer(t: Any, rows: Any, cols: Any) -> Any:
        data = t.data if rows is None else t.data[rows]  # a view of the memory map: nothing read yet
        if cols is not None:
            block, size = GGML_QUANT_SIZES[t.tensor_type]
            if data.dtype == np.uint8:  # quantized / bf16: the last axis holds bytes, block after block
                if cols.start % block or cols.stop % block:
                    raise ShardError(f"GGUF tensor {t.name!r} is {t.tensor_type.name} in blocks of {block} "
                                     f"columns; rank {rank}'s columns {cols.start}..{cols.stop} do not fall on "
                                     f"block boundaries. Valid world sizes: "
                                     f"{', '.join(map(str, valid_world_sizes(config, 'q8_0')))}")
                data = data[:, cols.start // block * size: cols.stop // block * size]
            else:
                data = data[:, cols]
        values = np.asarray(dequantize(np.ascontiguousarray(data), t.tensor_type), dtype=np.float32)
        if config.model_type in PERMUTED_QK and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = values.shape[0] // config.head_dim  # the slice holds whole heads
            values = unpermute_qk(values, heads)
        return torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True))

    float_dtype = torch.float32 if fmt is None else dtype  # as read_gguf: float32 unless asked otherwise
    tied = "lm_head.weight" not in tensors
    return build_shard(plan, rank, _checked_reader(config, raw, slicer, str(path)), float_dtype, not tied, device)

