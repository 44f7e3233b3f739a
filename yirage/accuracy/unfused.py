"""The unfused decode step of a Llama-family model: every original op on its own, in torch float64.

This is the golden side of a fused-vs-unfused comparison. It computes what
``LlamaModel.forward`` computes for one token per row, op by op (Hugging Face
module names, yirage.accuracy.mapping.llama_unfused_ops), widening every
weight to float64, and hands each op's inputs and outputs to ``record``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from yirage.models.llama import LlamaModel
from yirage.models.prefill import rope_tables
from yirage.models.weights import dense
from yirage.quant import QuantizedTensor

Record = Callable[[str, list[Any], list[Any]], None]


class UnfusedLlama:
    """Decodes one token per row per ``step`` call, with its own float64 KV cache of ``max_len`` positions."""

    def __init__(self, model: LlamaModel, batch: int, max_len: int) -> None:
        import torch

        c = model.config
        self.model, self.config, self.batch = model, c, batch
        f64 = torch.float64
        self.k_cache = [torch.zeros(batch, c.kv_heads, max_len, c.head_dim, dtype=f64) for _ in range(c.layers)]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        cos, sin = rope_tables(c, max_len)
        self.cos, self.sin = cos.to(f64), sin.to(f64)
        wide = lambda t: dense(t).to("cpu", f64)  # noqa: E731 - dequantized, widened, on the oracle's CPU
        self.blocks = [{k: wide(v) for k, v in blk.items()} for blk in model.blocks]
        self.norm, self.lm_head = wide(model.norm), wide(model.lm_head)

    def _embed(self, ids: Any) -> Any:
        import torch

        table = self.model.embed
        ids = ids.to(self.model.device)
        rows = table.dequantize(ids) if isinstance(table, QuantizedTensor) else table[ids]
        return rows.to("cpu", torch.float64)

    def step(self, ids: Any, pos: int, record: Record) -> Any:
        """Run one decode step for token ids (B, 1) at position ``pos``; returns the greedy next ids (B, 1)."""
        import torch
        import torch.nn.functional as F

        c, d, b = self.config, self.config.head_dim, self.batch
        x = self._embed(ids[:, 0])
        record("embed_tokens", [ids], [x])
        cos, sin = self.cos[pos], self.sin[pos]
        rot = lambda z: torch.cat((-z[..., d // 2:], z[..., :d // 2]), dim=-1)  # noqa: E731
        for i, blk in enumerate(self.blocks):
            p = f"layers.{i}."
            h = F.rms_norm(x, (c.hidden,), blk["ln1"], c.eps)
            record(p + "input_layernorm", [x], [h])
            qkv_w = blk["qkv"].view(c.kv_heads, c.group + 2, d, c.hidden)  # rows regrouped per kv head
            qkv_b = blk["qkv_bias"].view(c.kv_heads, c.group + 2, d) if "qkv_bias" in blk else None
            projections = {}
            for name, rows in (("q", slice(0, c.group)), ("k", slice(c.group, c.group + 1)),
                               ("v", slice(c.group + 1, c.group + 2))):
                w = qkv_w[:, rows].reshape(-1, c.hidden)
                out = h @ w.t()
                if qkv_b is not None:
                    out = out + qkv_b[:, rows].reshape(-1)
                record(p + f"self_attn.{name}_proj", [h], [out])
                projections[name] = out
            q = projections["q"].view(b, c.heads, d)
            k = projections["k"].view(b, c.kv_heads, d)
            q_rot, k_rot = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            record(p + "self_attn.rotary_emb", [projections["q"], projections["k"]],
                   [q_rot.reshape(b, -1), k_rot.reshape(b, -1)])
            self.k_cache[i][:, :, pos] = k_rot
            self.v_cache[i][:, :, pos] = projections["v"].view(b, c.kv_heads, d)
            keys, vals = self.k_cache[i][:, :, :pos + 1], self.v_cache[i][:, :, :pos + 1]  # (B, Hkv, S, D)
            qg = q_rot.view(b, c.kv_heads, c.group, d)
            scores = torch.einsum("bgjd,bgsd->bgjs", qg, keys) / math.sqrt(d)
            attn = torch.einsum("bgjs,bgsd->bgjd", torch.softmax(scores, -1), vals).reshape(b, c.heads * d)
            record(p + "self_attn.attention", [q_rot.reshape(b, -1), k_rot.reshape(b, -1), projections["v"]],
                   [attn])
            o = attn @ blk["o"].t()
            record(p + "self_attn.o_proj", [attn], [o])
            x_mid = x + o
            record(p + "attn_residual_add", [x, o], [x_mid])
            h2 = F.rms_norm(x_mid, (c.hidden,), blk["ln2"], c.eps)
            record(p + "post_attention_layernorm", [x_mid], [h2])
            gate = h2 @ blk["gate_up"][:c.intermediate].t()
            record(p + "mlp.gate_proj", [h2], [gate])
            up = h2 @ blk["gate_up"][c.intermediate:].t()
            record(p + "mlp.up_proj", [h2], [up])
            act = F.silu(gate) * up
            record(p + "mlp.act_mul", [gate, up], [act])
            down = act @ blk["down"].t()
            record(p + "mlp.down_proj", [act], [down])
            x = x_mid + down
            record(p + "mlp_residual_add", [x_mid, down], [x])
        hf = F.rms_norm(x, (c.hidden,), self.norm, c.eps)
        record("norm", [x], [hf])
        logits = hf @ self.lm_head.t()
        record("lm_head", [hf], [logits])
        picked = torch.argmax(logits, dim=-1, keepdim=True)
        record("sampler", [logits], [picked])
        return picked
