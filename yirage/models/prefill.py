"""The prompt's prefill in torch: every position in one batched pass, filling the KV caches the decoder reads.

Written once for one rank and for tensor parallelism (``reduce`` adds up the
row-parallel partial sums of the ranks). Everything runs on the device of the
weights and caches it is given (the backend's device): the index tensors
(positions) are moved there, the RoPE tables and KV caches are made there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from yirage.models.config import LlamaConfig, ModelError
from yirage.models.weights import dense
from yirage.quant import QuantizedTensor

Reduce = Callable[[Any, str], Any]  # (partial sum, label) -> the sum over the ranks
#: (x (M, K) float32, weight) -> x @ weight.T (M, N) float32, or None for torch's: Backend.prompt_linear
Linear = Callable[[Any, Any], Any]


def torch_linear(x: Any, weight: Any) -> Any:
    """torch's ``x @ weight.T``, what runs where a backend's projection returns None: on the weight made float32
    (quantized blocks dequantized, 16-bit widened: a copy per call), or, for ``x`` already in the weight's 16-bit
    dtype (``rounded_linear``), in that dtype (float32 accumulation). A backend that chooses between its own
    kernels and this one times this one (the cpu backend's prompt_rows)."""
    if x.dtype == getattr(weight, "dtype", None) and x.dtype.itemsize == 2:
        return x @ weight.t()
    return x @ dense(weight).t()


def project(h: Any, weight: Any, linear: Linear | None = None) -> Any:
    """``h @ weight.T`` over h's last dimension: the backend's ``linear`` where it takes this weight and row
    count, else torch's on the weight made float32."""
    if linear is not None:
        out = linear(h.reshape(-1, h.shape[-1]), weight)
        if out is not None:
            return out.view(*h.shape[:-1], out.shape[-1])
    return torch_linear(h, weight)


PROMPT_DTYPES = ("bfloat16",)


def rounded_linear(dtype: Any, then: Linear | None) -> Linear:
    """Projections that round the prompt's activations to ``dtype`` for ``dtype`` weights, as transformers and
    llama.cpp run a 16-bit model's prompt: ``x`` rounded to ``dtype`` and handed to ``then`` (a backend's
    projection: the cpu backend's native bf16 dot products) or else multiplied by torch in ``dtype`` (float32
    accumulation); the product rounded to ``dtype`` as a transformers bf16 Linear's, then widened. Weights of
    another dtype go to ``then`` as they are. The LM head is not rounded (``prefill_logits`` calls
    ``linear.unrounded``): bf16 logits are 0.125 apart at 16-32 and tie, and a tie flipped SmolLM2's first
    answer token (25.36 / 25.26 both 25.25); llama.cpp keeps its logits float32 too. ``linear.rounds_to`` is
    ``dtype``: ``attend`` runs the attention in it too, as transformers does (q, k and v rounded after RoPE; torch's
    fused kernel accumulates in float32): in float32 it was 120 of a 512-token bf16 prompt's 300 ms on 2 cores,
    against transformers' 33 ms."""

    def linear(x: Any, weight: Any) -> Any:
        if getattr(weight, "dtype", None) != dtype or x.dim() != 2:
            return then(x, weight) if then is not None else None
        rounded = x.to(dtype)
        out = then(rounded, weight) if then is not None else None
        if out is None:
            out = torch_linear(rounded, weight)
        return out.to(dtype).float()

    linear.unrounded = then  # type: ignore[attr-defined]
    linear.rounds_to = dtype  # type: ignore[attr-defined]
    return linear


def resolve_prompt_dtype(dtype: Any) -> Any:
    """The torch dtype the prompt's projections round their input to: None (float32, the decode's own
    precision), or one of PROMPT_DTYPES (a torch.dtype or its name)."""
    import torch

    if dtype is None:
        return None
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if not isinstance(dtype, (str, torch.dtype)) or name not in PROMPT_DTYPES:
        raise ModelError(f"prompt_dtype={dtype!r} is not supported; pass None (float32 activations) or one of "
                         f"{', '.join(PROMPT_DTYPES)}")
    return getattr(torch, name)


def check_prompt_dtype(dtype: Any, weights: Any) -> None:
    """A rounded prompt (``dtype``) needs matrices of that dtype (``weights``: the model's)."""
    if dtype is not None and weights != dtype:
        name = str(dtype).removeprefix("torch.")
        raise ModelError(f"prompt_dtype={name!r} rounds the activations for {name} matrices, but this model's are "
                         f"{weights}; load it with dtype={name!r} or leave prompt_dtype=None")


def rope_tables(config: LlamaConfig, positions: int, device: Any = "cpu") -> tuple[Any, Any]:
    """HF-style cos/sin (positions, head_dim) in float32 (rotate_half convention), computed on the CPU (the same
    bits on every device) and placed on ``device``."""
    import torch

    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().contiguous().to(device), emb.sin().contiguous().to(device)


def kv_caches(config: LlamaConfig, batch: int, max_len: int, device: Any,
              dtype: Any = None) -> tuple[list[Any], list[Any]]:
    """Zeroed key and value caches, one (batch, kv_heads, max_len, head_dim) pair per layer, on ``device``, in
    ``dtype`` (default float32; bfloat16/float16 halve what a long context reads per step)."""
    import torch

    dtype = dtype or torch.float32
    shape = (batch, config.kv_heads, max_len, config.head_dim)
    return ([torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.layers)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.layers)])


def kv_cache_bytes(config: LlamaConfig, batch: int, max_len: int, itemsize: int = 4) -> int:
    """Bytes of ``kv_caches(config, batch, max_len)`` with ``itemsize`` bytes per element."""
    return 2 * config.layers * batch * config.kv_heads * max_len * config.head_dim * itemsize


def attend(x: Any, blk: dict[str, Any], cos: Any, sin: Any, positions: Any, k_cache: Any, v_cache: Any,
           c: LlamaConfig, ends: list[int] | None = None, causal: list[bool] | None = None,
           linear: Linear | None = None) -> Any:
    """One layer's attention up to o_proj, (B, T, heads * head_dim), writing that layer's KV caches: RMSNorm,
    the fused QKV projection (grouped per KV head), RoPE, causal attention over the cached positions. ``c``
    may be one rank's share of the model (yirage.distributed): its heads and KV heads. ``positions`` is on the
    caches' device; ``ends[row]`` (1 + the row's last position) is known on the host (else read back), and
    ``causal[row]`` whether the row's positions are 0 .. T-1. The attention is torch's fused
    scaled_dot_product_attention (a 2048-token prompt: 3.8 s against 12.6 s for scores, mask and softmax
    materialized per layer), in float32, or in the dtype a rounded prompt's ``linear`` rounds to
    (``rounded_linear``)."""
    import torch
    import torch.nn.functional as F

    b, t, d, f32 = x.shape[0], x.shape[1], c.head_dim, torch.float32
    work = getattr(linear, "rounds_to", None) or f32  # the attention's dtype
    h = F.rms_norm(x, (c.hidden,), blk["ln1"].to(f32), c.eps)
    qkv = project(h, blk["qkv"], linear)
    if "qkv_bias" in blk:
        qkv = qkv + blk["qkv_bias"].to(f32)
    qkv = qkv.view(b, t, c.kv_heads, c.group + 2, d)
    q, k, v = qkv[..., :c.group, :], qkv[..., c.group, :], qkv[..., c.group + 1, :]
    rot = lambda z: torch.cat((-z[..., d // 2:], z[..., :d // 2]), dim=-1)  # noqa: E731
    q = q * cos[..., None, :] + rot(q) * sin[..., None, :]
    k = k * cos + rot(k) * sin
    out = torch.empty(b, t, c.heads, d, device=x.device)
    for row in range(b):
        first = causal is not None and causal[row]  # positions 0 .. T-1: a copy, not an indexed write
        at = slice(0, t) if first else positions[row]
        k_cache[row, :, at] = k[row].transpose(0, 1)
        v_cache[row, :, at] = v[row].transpose(0, 1)
        end = ends[row] if ends is not None else int(positions[row].max()) + 1
        keys, vals = k_cache[row, None, :, :end], v_cache[row, None, :, :end]  # (1, Hkv, S, D)
        if keys.dtype != work:  # a 16-bit cache: the rounded keys and values, as the decode reads them
            keys, vals = keys.to(work), vals.to(work)
        query = q[row].reshape(t, c.heads, d).transpose(0, 1)[None].to(work)  # (1, H, T, D); KV head h // group
        if first:  # the fused causal kernel skips the masked blocks
            att = F.scaled_dot_product_attention(query, keys, vals, is_causal=True, enable_gqa=True)
        else:  # a query sees the cached positions up to its own
            allowed = torch.arange(end, device=x.device)[None, :] <= positions[row][:, None]
            att = F.scaled_dot_product_attention(query, keys, vals, attn_mask=allowed, enable_gqa=True)
        out[row] = att[0].transpose(0, 1)
    return out.reshape(b, t, c.heads * d)


def gated_mlp(x: Any, blk: dict[str, Any], c: LlamaConfig, linear: Linear | None = None) -> Any:
    """One layer's MLP without the residual: RMSNorm, the fused gate/up projection, silu(gate) * up, down."""
    import torch
    import torch.nn.functional as F

    h = F.rms_norm(x, (c.hidden,), blk["ln2"].to(torch.float32), c.eps)
    gu = project(h, blk["gate_up"], linear)
    return project(F.silu(gu[..., :c.intermediate]) * gu[..., c.intermediate:], blk["down"], linear)


def prefill_logits(c: LlamaConfig, embed: Any, blocks: list[dict[str, Any]], norm: Any, lm_head: Any,
                   k_cache: list[Any], v_cache: list[Any], cos_table: Any, sin_table: Any, input_ids: Any,
                   positions: Any, last_only: bool = False, reduce: Reduce | None = None,
                   linear: Linear | None = None) -> Any:
    """Logits (B, T, lm_head rows) for ``input_ids`` at ``positions`` (both (B, T), already checked), writing the
    KV caches; with ``last_only``, (B, 1, rows) for the last position only (a prompt's prefill: the LM head over
    every position is most of a short prompt's time, and generation reads only the last). ``reduce``: tensor
    parallel, the sum over the ranks of each row-parallel partial (o_proj, down_proj). ``linear``: the backend's
    projection (Backend.prompt_linear), None for torch's."""
    import torch
    import torch.nn.functional as F

    device = k_cache[0].device
    t = positions.shape[1]
    host = torch.stack([positions.amax(dim=1), (positions == torch.arange(t, device=positions.device)).all(dim=1)
                        .to(positions.dtype)], dim=1).tolist()  # host-side loop bounds: read once, not per layer
    ends, causal = [int(e) + 1 for e, _ in host], [bool(z) for _, z in host]
    input_ids, positions = input_ids.to(device), positions.to(device)
    f32 = torch.float32
    x = embed.dequantize(input_ids) if isinstance(embed, QuantizedTensor) else embed[input_ids].to(f32)
    cos, sin = cos_table[positions][:, :, None], sin_table[positions][:, :, None]  # (B, T, 1, D)
    add = reduce or (lambda partial, label: partial)
    for i, blk in enumerate(blocks):
        attn = project(attend(x, blk, cos, sin, positions, k_cache[i], v_cache[i], c, ends, causal, linear), blk["o"],
                       linear)
        x = x + add(attn, f"layer {i} o_proj all-reduce")  # partial sums over this rank's heads
        x = x + add(gated_mlp(x, blk, c, linear), f"layer {i} down_proj all-reduce")
    if last_only:
        x = x[:, -1:]
    x = F.rms_norm(x, (c.hidden,), norm.to(f32), c.eps)
    return project(x, lm_head, getattr(linear, "unrounded", linear))  # float32 logits (rounded_linear)
