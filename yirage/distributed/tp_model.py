"""One rank's part of a tensor-parallel Llama model: prefill in torch (ReferenceTP), decode as a PersistentKernel.

``TPModel`` has the interface ``InferEngine`` uses of a ``LlamaModel``
(``config``, ``reset_cache``, ``check_cache_fits``, ``forward``,
``build_decoder``, ``gguf``), over this rank's ``RankShard``: the prefill is
``ReferenceTP.forward`` (it fills this rank's KV caches, the gathered logits
pick the first token on every rank alike), and ``build_decoder`` builds this
rank's decode step as a PersistentKernel:

    embed (replicated)
    per layer i:  rmsnorm + qkv (this rank's KV heads and their query heads)
                  attention over this rank's KV cache (kv/N heads)
                  o (row-parallel) + residual on rank 0, + zeros elsewhere  -> partial sum
                  allreduce "layer i o_proj all-reduce"                     -> x_mid
                  rmsnorm + gate/up (this rank's ff/N rows)
                  silu*mul + down (row-parallel) + residual on rank 0 only  -> partial sum
                  allreduce "layer i down_proj all-reduce"                  -> x
    rmsnorm + lm_head (this rank's vocabulary rows)  -> local logits (batch, P or fewer)
    allgather "lm_head logits all-gather"             -> logits (batch, vocab), -inf padding never kept
    argmax / sampling over the full logits (the same on every rank)

The residual is added exactly once, by rank 0, before the sum. The LM head
gathers the logits instead of exchanging (value, index) pairs: the picker then
sees the exact full row, so greedy ties and NaNs resolve as ``torch.argmax`` /
``argmax_shards`` do, sampling works unchanged and ``read("logits")`` returns
the full row; it costs one all-gather of ``4 * P`` bytes per row per rank.
"""

from __future__ import annotations

from typing import Any

from yirage.distributed.reference_tp import ReferenceTP
from yirage.distributed.sharding import RankShard
from yirage.models.config import LlamaConfig
from yirage.models.decoder import DecoderParts, Sharding, build_decoder
from yirage.models.placement import Placement
from yirage.models.prefill import kv_cache_bytes


class TPModel:
    """This rank's shard, KV caches and RoPE tables; see the module docstring."""

    def __init__(self, shard: RankShard, gguf: Any = None, placement: Placement | None = None) -> None:
        self.shard = shard
        self.reference = ReferenceTP(shard)  # checks that this process is the shard's rank
        self.plan = shard.plan
        self.rank, self.world_size = shard.rank, shard.plan.world_size
        self.gguf = gguf  # a GGUFInfo when loaded from a GGUF file (the engine's tokenizer reads it)
        self.placement = placement or Placement.host()  # where the shard was loaded (open_tp_model)

    @property
    def device(self) -> Any:
        return self.placement.device

    @property
    def config(self) -> LlamaConfig:
        """The whole model's config (the engine checks prompts and EOS against it)."""
        return self.plan.config

    @property
    def lm_head(self) -> Any:
        """This rank's rows of the LM head (their dtype is the model's matrices': InferEngine's prompt_dtype)."""
        return self.shard.lm_head

    @property
    def k_cache(self) -> list[Any]:
        return self.reference.k_cache

    @property
    def v_cache(self) -> list[Any]:
        return self.reference.v_cache

    @property
    def kv_dtype(self) -> Any:
        """The dtype of the KV caches reset_cache makes (InferEngine's kv_cache_dtype)."""
        return self.reference.kv_dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype: Any) -> None:
        self.reference.kv_dtype = dtype

    def check_cache_fits(self, batch_size: int, max_len: int) -> None:
        """Refuse a KV cache (this rank's KV heads) larger than the memory available now on this rank's device."""
        self.placement.check_fits(kv_cache_bytes(self.plan.local_config(), batch_size, max_len,
                                                 self.kv_dtype.itemsize),
                                  f"rank {self.rank}'s KV cache for batch {batch_size} x {max_len} positions",
                                  "lower max_new_tokens (or the prompt length or batch size), or use more ranks")

    def reset_cache(self, batch_size: int, max_len: int) -> None:
        self.check_cache_fits(batch_size, max_len)
        self.reference.reset_cache(batch_size, max_len)

    def forward(self, input_ids: Any, positions: Any, last_only: bool = False, linear: Any = None) -> Any:
        """The full logits (B, T, vocab), gathered from every rank's shard; writes this rank's KV caches.
        Every rank must call it with the same inputs (``linear``: Backend.prompt_linear, None for torch's)."""
        return self.reference.gather_logits(self.reference.forward(input_ids, positions, last_only, linear),
                                            "prefill logits all-gather")

    def build_decoder(self, step: Any, tokens: Any, backend: Any = None, num_workers: int | None = None,
                      num_local_schedulers: int | None = None, eos_token_id: Any = None,
                      sampling: dict[str, Any] | None = None, profiler_tensor: Any = None,
                      tasks: int | None = None, screen: bool = False) -> Any:
        """This rank's decode step as a compiled PersistentKernel over its shard and KV caches (reset_cache
        first); every rank builds and runs its own, with the same arguments. ``screen`` is accepted and unused: a
        rank's head is a vocabulary shard whose logits are gathered, so it is read in one pass."""
        return build_tp_decoder(self, step, tokens, backend=backend, num_workers=num_workers,
                                num_local_schedulers=num_local_schedulers, eos_token_id=eos_token_id,
                                sampling=sampling, profiler_tensor=profiler_tensor, tasks=tasks)


def build_tp_decoder(model: TPModel, step: Any, tokens: Any, backend: Any = None, num_workers: int | None = None,
                     num_local_schedulers: int | None = None, eos_token_id: Any = None,
                     sampling: dict[str, Any] | None = None, profiler_tensor: Any = None,
                     tasks: int | None = None) -> Any:
    """The per-rank task graph of the module docstring (yirage.models.decoder with a Sharding), compiled for
    ``backend``."""
    from yirage.models.config import ModelError

    ref, shard, plan = model.reference, model.shard, model.plan
    if not ref.k_cache or ref.k_cache[0].shape[0] != tokens.shape[0]:
        raise ModelError("call reset_cache(batch_size, max_len) with the tokens' batch size first")
    parts = DecoderParts(plan.local_config(), shard.embed, shard.norm, shard.lm_head, shard.blocks, ref.k_cache,
                         ref.v_cache, ref.cos, ref.sin,
                         Sharding(model.world_size, model.rank, plan.config.vocab, plan.vocab_per_rank))
    return build_decoder(parts, step, tokens, backend=backend, num_workers=num_workers,
                         num_local_schedulers=num_local_schedulers, eos_token_id=eos_token_id, sampling=sampling,
                         profiler_tensor=profiler_tensor, tasks=tasks)


def open_tp_model(model_path: Any, tp: int, backend: Any, dtype: Any = None) -> tuple[TPModel, Any]:
    """(this rank's TPModel, its World) for ``InferEngine(tp=N)``: the world from torchrun's / mpirun's
    environment, the shard loaded (a model that cannot be split fails here, before any rendezvous), then the
    process group joined with the backend's collective."""
    from yirage.distributed.world import DistributedError, init_world, resolve_world

    world = resolve_world()
    if world.world_size != tp:
        raise DistributedError(f"tp={tp}, but this process is {world} ({world.source}): start {tp} ranks with "
                               f"torchrun --nproc-per-node {tp} (or mpirun -n {tp}) and pass the same tp, or pass "
                               f"tp={world.world_size}")
    placement = Placement.of_backend(backend, local_index=world.local_rank)  # one device per rank of a machine
    shard, gguf = _load_shard(model_path, tp, world.rank, dtype, placement.device)
    init_world(backend, world=world)
    return TPModel(shard, gguf, placement), world


def _load_shard(model_path: Any, world_size: int, rank: int, dtype: Any, device: Any) -> tuple[RankShard, Any]:
    from pathlib import Path

    from yirage.distributed.sharding import load_gguf_shard, load_shard
    from yirage.models.gguf import is_gguf_file, open_gguf, read_config

    path = Path(model_path)
    if is_gguf_file(path) or (path.suffix.lower() == ".gguf" and not path.is_dir()):
        return load_gguf_shard(path, world_size, rank, dtype, device), read_config(open_gguf(path), path)[1]
    return load_shard(path, world_size, rank, dtype, device), None
