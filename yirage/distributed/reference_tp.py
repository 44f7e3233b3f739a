"""A tensor-parallel decode in plain torch over one rank's shards: the oracle for the fused multi-rank runtime.

It computes what ``LlamaModel.forward`` computes, op by op, on this rank's
heads, KV cache (sharded by KV head) and intermediate rows, with the two
all-reduces per layer a row-parallel split needs (after ``o`` and after
``down``: each rank's product is a partial sum over its input columns) and a
distributed argmax over the vocabulary shards. Greedy tokens equal to the
single-rank LlamaModel and to transformers prove the sharding; the fused
PersistentKernel runtime is then checked against this, step by step.
"""

from __future__ import annotations

from typing import Any

from yirage.distributed.collectives import all_gather_rows, all_reduce_, argmax_shards
from yirage.distributed.sharding import RankShard
from yirage.distributed.world import DistributedError, current_group
from yirage.models.config import ModelError, resolve_kv_dtype
from yirage.models.prefill import kv_caches, prefill_logits, rope_tables


class ReferenceTP:
    """One rank's part of a Llama decode: ``forward`` gives this rank's logit columns, ``generate`` greedy tokens.

    With more than one rank, every rank must call the same methods with the same inputs (after ``init_world``).
    """

    def __init__(self, shard: RankShard) -> None:
        self.shard, self.plan = shard, shard.plan
        self.config = shard.plan.local_config()  # this rank's heads, KV heads and intermediate rows
        if self.plan.world_size > 1:
            world = current_group().world
            if (world.rank, world.world_size) != (shard.rank, self.plan.world_size):
                raise DistributedError(f"this process is {world}, but the shard is rank {shard.rank} of "
                                       f"{self.plan.world_size}: load the shard for this process's rank")
        self.k_cache: list[Any] = []
        self.v_cache: list[Any] = []
        self.kv_dtype = resolve_kv_dtype(None)  # of the caches reset_cache makes
        self.cos = self.sin = None

    def reset_cache(self, batch_size: int, max_len: int) -> None:
        """Zeroed KV caches (``kv_dtype``) for this rank's KV heads, and RoPE tables for ``max_len`` positions,
        on the shard's device."""
        device = self.shard.norm.device
        self.k_cache = self.v_cache = []  # the old caches go before the new ones are made
        self.k_cache, self.v_cache = kv_caches(self.config, batch_size, max_len, device, self.kv_dtype)
        self.cos, self.sin = rope_tables(self.config, max_len, device)

    def _reduce(self, partial: Any, label: str) -> Any:
        return all_reduce_(partial.contiguous(), label) if self.plan.world_size > 1 else partial

    def forward(self, input_ids: Any, positions: Any, last_only: bool = False, linear: Any = None) -> Any:
        """This rank's logits (B, T, its vocabulary rows) for ``input_ids`` at ``positions``, writing the caches;
        ``linear``: the backend's prefill projection (Backend.prompt_linear), None for torch's."""
        full = self.plan.config
        if not self.k_cache:
            raise ModelError("call reset_cache(batch_size, max_len) before forward")
        b, t = input_ids.shape
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= full.vocab:
            raise ModelError(f"input_ids must lie in [0, vocab_size={full.vocab})")
        if positions.shape != (b, t) or int(positions.min()) < 0 or int(positions.max()) >= self.k_cache[0].shape[2]:
            raise ModelError(f"positions must be a (B, T) = {(b, t)} tensor within the cache length; call "
                             "reset_cache with a longer max_len")
        sh = self.shard
        return prefill_logits(self.config, sh.embed, sh.blocks, sh.norm, sh.lm_head, self.k_cache, self.v_cache,
                              self.cos, self.sin, input_ids, positions, last_only, self._reduce, linear)

    def argmax(self, local_logits: Any, label: str = "lm_head argmax") -> tuple[Any, Any]:
        """(value, global token id) of the largest logit over every rank's shard (ties: the lowest id)."""
        import torch

        start, stop = self.shard.vocab_range
        if self.plan.world_size == 1:
            idx = torch.argmax(local_logits, dim=-1)
            return torch.gather(local_logits, -1, idx[..., None])[..., 0].double(), idx
        width = self.plan.vocab_per_rank
        padded = torch.nn.functional.pad(local_logits, (0, width - (stop - start)), value=float("-inf"))
        return argmax_shards(padded.contiguous(), start, label, valid=stop - start)

    def gather_logits(self, local_logits: Any, label: str = "lm_head logits all-gather") -> Any:
        """Every rank's logit columns joined: (..., vocab), for sampling and for comparison with a reference."""
        import torch

        if self.plan.world_size == 1:
            return local_logits
        start, stop = self.shard.vocab_range
        width = self.plan.vocab_per_rank  # the padded shard width: all_gather needs one shape on every rank
        padded = torch.nn.functional.pad(local_logits, (0, width - (stop - start)), value=float("-inf"))
        return all_gather_rows(padded.contiguous(), label, dim=-1)[..., :self.plan.config.vocab]

    def generate(self, input_ids: Any, new_tokens: int) -> tuple[Any, Any]:
        """Greedy tokens (B, new_tokens) after the prompt, and the full logits (B, new_tokens, vocab) they came from."""
        import torch

        b, t = input_ids.shape
        self.reset_cache(b, t + new_tokens)
        positions = torch.arange(t).expand(b, t)
        local = self.forward(input_ids, positions, last_only=True)
        tokens, logits = [], []
        for step in range(new_tokens):
            logits.append(self.gather_logits(local[:, -1]))
            _, nxt = self.argmax(local[:, -1])
            tokens.append(nxt)
            if step + 1 < new_tokens:
                local = self.forward(nxt[:, None], torch.full((b, 1), t + step), last_only=True)
        return torch.stack(tokens, 1), torch.stack(logits, 1)
