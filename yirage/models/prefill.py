"""The prompt's prefill in torch: every position in one batched pass, filling the KV caches the decoder reads.

Written once for one rank and for tensor parallelism (``reduce`` adds up the
row-parallel partial sums of the ranks). Everything runs on the device of the
weights and caches it is given (the backend's device): the index tensors
(positions) are moved there, the RoPE tables and KV caches are made there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from yirage.models.config import LlamaConfig
from yirage.models.weights import dense
from yirage.quant import QuantizedTensor

Reduce = Callable[[Any, str], Any]  # (partial sum, label) -> the sum over the ranks


def rope_tables(config: LlamaConfig, positions: int, device: Any = "cpu") -> tuple[Any, Any]:
    """HF-style cos/sin (positions, head_dim) in float32 (rotate_half convention), computed on the CPU (the same
    bits on every device) and placed on ``device``."""
    import torch

    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().contiguous().to(device), emb.sin().contiguous().to(device)


def kv_caches(config: LlamaConfig, batch: int, max_len: int, device: Any) -> tuple[list[Any], list[Any]]:
    """Zeroed float32 key and value caches, one (batch, kv_heads, max_len, head_dim) pair per layer, on ``device``."""
    import torch

    shape = (batch, config.kv_heads, max_len, config.head_dim)
    return ([torch.zeros(shape, device=device) for _ in range(config.layers)],
            [torch.zeros(shape, device=device) for _ in range(config.layers)])


def kv_cache_bytes(config: LlamaConfig, batch: int, max_len: int) -> int:
    """Bytes of ``kv_caches(config, batch, max_len)``."""
    return 2 * config.layers * batch * config.kv_heads * max_len * config.head_dim * 4


def attend(x: Any, blk: dict[str, Any], cos: Any, sin: Any, positions: Any, k_cache: Any, v_cache: Any,
           c: LlamaConfig, ends: list[int] | None = None) -> Any:
    """One layer's attention up to o_proj, (B, T, heads * head_dim), writing that layer's KV caches: RMSNorm,
    the fused QKV projection (grouped per KV head), RoPE, causal attention over the cached positions. ``c``
    may be one rank's share of the model (yirage.distributed): its heads and KV heads. ``positions`` is on the
    caches' device; ``ends[row]`` (1 + the row's last position) is known on the host (else read back)."""
    import torch
    import torch.nn.functional as F

    b, t, d, f32 = x.shape[0], x.shape[1], c.head_dim, torch.float32
    h = F.rms_norm(x, (c.hidden,), blk["ln1"].to(f32), c.eps)
    qkv = h @ dense(blk["qkv"]).t()
    if "qkv_bias" in blk:
        qkv = qkv + blk["qkv_bias"].to(f32)
    qkv = qkv.view(b, t, c.kv_heads, c.group + 2, d)
    q, k, v = qkv[..., :c.group, :], qkv[..., c.group, :], qkv[..., c.group + 1, :]
    rot = lambda z: torch.cat((-z[..., d // 2:], z[..., :d // 2]), dim=-1)  # noqa: E731
    q = q * cos[..., None, :] + rot(q) * sin[..., None, :]
    k = k * cos + rot(k) * sin
    out = torch.empty(b, t, c.kv_heads, c.group, d, device=x.device)
    for row in range(b):
        k_cache[row, :, positions[row]] = k[row].transpose(0, 1)
        v_cache[row, :, positions[row]] = v[row].transpose(0, 1)
        end = ends[row] if ends is not None else int(positions[row].max()) + 1
        keys, vals = k_cache[row, :, :end], v_cache[row, :, :end]  # (Hkv, S, D)
        scores = torch.einsum("tgjd,gsd->tgjs", q[row], keys) / math.sqrt(d)
        mask = torch.arange(end, device=x.device)[None, :] > positions[row][:, None]  # causal over cache positions
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
        out[row] = torch.einsum("tgjs,gsd->tgjd", torch.softmax(scores, -1), vals)
    return out.reshape(b, t, c.heads * d)


def gated_mlp(x: Any, blk: dict[str, Any], c: LlamaConfig) -> Any:
    """One layer's MLP without the residual: RMSNorm, the fused gate/up projection, silu(gate) * up, down."""
    import torch
    import torch.nn.functional as F

    h = F.rms_norm(x, (c.hidden,), blk["ln2"].to(torch.float32), c.eps)
    gu = h @ dense(blk["gate_up"]).t()
    return (F.silu(gu[..., :c.intermediate]) * gu[..., c.intermediate:]) @ dense(blk["down"]).t()


def prefill_logits(c: LlamaConfig, embed: Any, blocks: list[dict[str, Any]], norm: Any, lm_head: Any,
                   k_cache: list[Any], v_cache: list[Any], cos_table: Any, sin_table: Any, input_ids: Any,
                   positions: Any, last_only: bool = False, reduce: Reduce | None = None) -> Any:
    """Logits (B, T, lm_head rows) for ``input_ids`` at ``positions`` (both (B, T), already checked), writing the
    KV caches; with ``last_only``, (B, 1, rows) for the last position only (a prompt's prefill: the LM head over
    every position is most of a short prompt's time, and generation reads only the last). ``reduce``: tensor
    parallel, the sum over the ranks of each row-parallel partial (o_proj, down_proj)."""
    import torch
    import torch.nn.functional as F

    device = k_cache[0].device
    ends = [int(e) + 1 for e in positions.amax(dim=1).tolist()]  # host-side loop bounds: read once, not per layer
    input_ids, positions = input_ids.to(device), positions.to(device)
    f32 = torch.float32
    x = embed.dequantize(input_ids) if isinstance(embed, QuantizedTensor) else embed[input_ids].to(f32)
    cos, sin = cos_table[positions][:, :, None], sin_table[positions][:, :, None]  # (B, T, 1, D)
    add = reduce or (lambda partial, label: partial)
    for i, blk in enumerate(blocks):
        attn = attend(x, blk, cos, sin, positions, k_cache[i], v_cache[i], c, ends) @ dense(blk["o"]).t()
        x = x + add(attn, f"layer {i} o_proj all-reduce")  # partial sums over this rank's heads
        x = x + add(gated_mlp(x, blk, c), f"layer {i} down_proj all-reduce")
    if last_only:
        x = x[:, -1:]
    x = F.rms_norm(x, (c.hidden,), norm.to(f32), c.eps)
    return x @ dense(lm_head).t()
