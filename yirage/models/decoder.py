"""The decode step of a Llama-family model as a PersistentKernel: one builder for one rank and for each rank of a
tensor-parallel model.

    embed
    per layer i:  rmsnorm + fused qkv, attention over the layer's KV cache (RoPE),
                  o_proj + residual, rmsnorm + fused gate/up, silu * up + down_proj + residual
    rmsnorm + lm_head -> logits, then argmax or sampling (the next token)

Tensor parallel (``Sharding``): o_proj and down_proj are row-parallel partial sums added up by an all-reduce
layer (the residual added once, by rank 0), and each rank's LM head rows are all-gathered into the full logits
(yirage/distributed/tp_model.py explains why). Every tensor the kernel attaches is the caller's, on the
backend's device; the builder allocates nothing but the kernel's own intermediates (and, tensor parallel, one
zero residual on the tokens' device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from yirage.models.config import LlamaConfig

#: tasks per projection when the backend proposes none (its default_config has no "tasks_per_layer")
DEFAULT_TASKS = 16


def decoder_blocks(pk: Any, c: LlamaConfig, blocks: list[dict[str, Any]], k_cache: list[Any], v_cache: list[Any],
                   cos: Any, sin: Any, x: Any, tasks: int, reduce: Any = None, zeros: Any = None) -> Any:
    """Every decoder layer of a decode step on the PersistentKernel ``pk``, from the embedded tokens ``x`` to the
    last hidden state (returned); ``c`` holds the head counts of the weights in ``blocks``.

    Tensor parallel (yirage.distributed.tp_model): with ``reduce(partial, out, label)`` the o and down
    projections are row-parallel partial sums that ``reduce`` adds up over the ranks, and the residual is added
    before the sum by exactly one rank: the one whose ``zeros`` is None (the others add ``zeros``).
    """
    att = pk.attach_input
    batch = x.dims[0]
    qkv_cols = c.kv_heads * (c.group + 2) * c.head_dim
    for i, blk in enumerate(blocks):
        qkv = pk.new_tensor((batch, qkv_cols), name=f"qkv{i}")
        bias = att(blk["qkv_bias"], f"qkv_bias{i}") if "qkv_bias" in blk else None
        pk.rmsnorm_linear_layer(x, att(blk["ln1"], f"ln1_{i}"), att(blk["qkv"], f"wqkv{i}"), qkv,
                                grid_dim=divisor_near(qkv_cols, tasks), eps=c.eps, bias=bias)
        attn = pk.new_tensor((batch, c.heads * c.head_dim), name=f"attn{i}")
        pk.attention_layer(qkv, att(k_cache[i], f"k_cache{i}"), att(v_cache[i], f"v_cache{i}"),
                           cos_pos_embed=cos, sin_pos_embed=sin, output=attn)
        x_mid = _row_parallel(pk, pk.linear_with_residual_layer, attn, att(blk["o"], f"wo{i}"), x, tasks,
                              (f"x{i}_mid", f"o_partial{i}", f"layer {i} o_proj all-reduce"), reduce, zeros)
        gu = pk.new_tensor((batch, 2 * c.intermediate), name=f"gate_up{i}")
        pk.rmsnorm_linear_layer(x_mid, att(blk["ln2"], f"ln2_{i}"), att(blk["gate_up"], f"wgu{i}"), gu,
                                grid_dim=divisor_near(2 * c.intermediate, tasks), eps=c.eps)
        x = _row_parallel(pk, pk.silu_mul_linear_with_residual_layer, gu, att(blk["down"], f"wdown{i}"), x_mid,
                          tasks, (f"x{i + 1}", f"down_partial{i}", f"layer {i} down_proj all-reduce"), reduce, zeros)
    return x


def pick_and_compile(pk: Any, logits: Any, sampling: dict[str, Any] | None) -> Any:
    """The decode step's last layer (sampling with ``sampling``'s parameters, else greedy), then compile ``pk``."""
    import torch

    picked = pk.new_tensor((logits.dims[0], 1), dtype=torch.int64, name="next_token")
    if sampling:
        pk.sampling_layer(logits, picked, **sampling)
    else:
        pk.argmax_layer(logits, picked)
    return pk.compile()


def _row_parallel(pk: Any, layer: Any, inp: Any, weight: Any, residual: Any, tasks: int, names: tuple[str, str, str],
                  reduce: Any, zeros: Any) -> Any:
    """``layer(inp, weight, residual)`` into a new (batch, hidden) tensor; tensor parallel: into a partial sum,
    then ``reduce`` (see decoder_blocks). ``names``: the output's name, the partial's, the collective's label."""
    hidden = weight.dims[0]
    shape = (residual.dims[0], hidden)
    if reduce is None:
        out = pk.new_tensor(shape, name=names[0])
        layer(inp, weight, residual, out, grid_dim=divisor_near(hidden, tasks))
        return out
    part = pk.new_tensor(shape, name=names[1])
    layer(inp, weight, residual if zeros is None else zeros, part, grid_dim=divisor_near(hidden, tasks))
    out = pk.new_tensor(shape, name=names[0])
    reduce(part, out, names[2])
    return out


def divisor_near(n: int, target: int) -> int:
    """The divisor of ``n`` closest to ``target`` (task counts must split columns evenly)."""
    divisors = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    divisors += [n // d for d in divisors]
    return min(divisors, key=lambda d: (abs(d - target), d))


@dataclass(frozen=True)
class Sharding:
    """How one rank's decoder is part of a tensor-parallel one."""

    world_size: int
    rank: int
    vocab: int  # the whole vocabulary: the gathered logits' width
    vocab_per_rank: int  # every rank's LM head shard padded to this width (all-gather needs one shape)


@dataclass(frozen=True)
class DecoderParts:
    """What a decode step reads: ``c`` the config of the heads held (one rank's share, tensor parallel), the weights
    in decode layout (yirage.models.weights), the KV caches and the RoPE tables; all on the backend's device."""

    c: LlamaConfig
    embed: Any
    norm: Any
    lm_head: Any  # ``embed`` itself when tied (attached once)
    blocks: list[dict[str, Any]]
    k_cache: list[Any]
    v_cache: list[Any]
    cos: Any
    sin: Any
    sharding: Sharding | None = None
    # () -> (the LM head's bf16 copy, per-row bounds) or None: a greedy step's screen (yirage.models.head_screen)
    head_screen: Any = None


def build_decoder(parts: DecoderParts, step: Any, tokens: Any, backend: Any = None, num_workers: int | None = None,
                  num_local_schedulers: int | None = None, eos_token_id: Any = None,
                  sampling: dict[str, Any] | None = None, profiler_tensor: Any = None,
                  tasks: int | None = None, screen: bool = False) -> Any:
    """The compiled PersistentKernel of one decode step over ``parts`` (see the module docstring).

    ``tasks``: tasks per projection (the LM head gets twice as many); None: the ``tasks_per_layer`` of the kernel's
    configuration (the backend's ``default_config`` or a saved one), else DEFAULT_TASKS.

    ``screen``: a greedy step reads the LM head in two passes where the backend runs ``screened_logits`` and
    ``parts.head_screen`` gives a screen (a float32 head, one rank): the bf16 copy for every row, then the float32
    rows that can hold the maximum (yirage.models.head_screen). The picked tokens are the same; the kernel's
    "logits" are then -inf outside those rows, so a caller reading every logit leaves it False.
    """
    import torch

    from yirage.persistent.kernel import PersistentKernel

    c, batch, tp = parts.c, tokens.shape[0], parts.sharding
    max_len = parts.k_cache[0].shape[2]
    pk = PersistentKernel(world_size=tp.world_size if tp else 1, mpi_rank=tp.rank if tp else 0,
                          num_workers=num_workers, num_local_schedulers=num_local_schedulers, max_seq_length=max_len,
                          eos_token_id=eos_token_id, meta_tensors=[step, tokens], profiler_tensor=profiler_tensor,
                          backend=backend)
    if tasks is None:
        tasks = int(pk.config.values().get("tasks_per_layer") or DEFAULT_TASKS)
    att = pk.attach_input
    cos, sin = att(parts.cos, "rope_cos"), att(parts.sin, "rope_sin")
    reduce = zeros = None
    if tp:  # rank 0 adds the residual before the sum, the others add zeros: the all-reduce adds it exactly once
        reduce = lambda part, out, label: pk.allreduce_layer(part, out, label=label)  # noqa: E731
        zeros = None if tp.rank == 0 else att(torch.zeros(batch, c.hidden, device=tokens.device), "zero_residual")
    x = pk.new_tensor((batch, c.hidden), name="x0")
    pk.embed_layer(pk.tokens_tensor, att(parts.embed, "embed"), x, grid_dim=divisor_near(c.hidden, tasks))
    x = decoder_blocks(pk, c, parts.blocks, parts.k_cache, parts.v_cache, cos, sin, x, tasks, reduce, zeros)
    rows = int(parts.lm_head.shape[0])
    lm_head = pk.tensors["embed"] if parts.lm_head is parts.embed else att(parts.lm_head, "lm_head")
    norm = att(parts.norm, "final_norm")
    screened = (screen and not sampling and not tp and parts.head_screen is not None and pk.runs("screened_logits")
                and parts.head_screen())
    if screened:
        scores = pk.new_tensor((batch, rows), name="screen_scores")
        pk.rmsnorm_linear_layer(x, norm, att(screened[0], "lm_head_screen"), scores,
                                grid_dim=divisor_near(rows, 2 * tasks), eps=c.eps)
        logits = pk.new_tensor((batch, rows), name="logits")
        pk.screened_logits_layer(scores, x, norm, lm_head, att(screened[1], "lm_head_row_bound"), logits, eps=c.eps)
        pk.before_each_run(parts.head_screen)  # a head changed since: its screen remade, or its bounds NaN
        return pick_and_compile(pk, logits, sampling)
    head = pk.new_tensor((batch, rows), name="local_logits" if tp else "logits")
    pk.rmsnorm_linear_layer(x, norm, lm_head, head, grid_dim=divisor_near(rows, 2 * tasks), eps=c.eps)
    logits = head
    if tp:
        logits = pk.new_tensor((batch, tp.vocab), name="logits")
        pk.allgather_layer(head, logits, label="lm_head logits all-gather", shard_width=tp.vocab_per_rank)
    return pick_and_compile(pk, logits, sampling)
