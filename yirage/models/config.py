"""The configuration of a Llama-family model (Llama, Qwen2 with q/k/v biases, Mistral): parsed and checked.

``config.json`` (or a GGUF file's metadata, yirage/models/gguf.py) becomes a
frozen ``LlamaConfig``; every value a compiled decoder indexes memory with is
checked here, before any weight is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yirage.errors import NotSupportedError, YirageError
from yirage.quant import FORMATS as QUANT_FORMATS

SUPPORTED = ("llama", "qwen2", "mistral")
#: Upper bounds for the sizes a config declares, checked before anything is made from them. Why: per-layer and
#: per-head bookkeeping (weight_shapes(), the q/k/v regrouping) is built from these numbers before the checkpoint
#: can contradict them, so a damaged num_hidden_layers=10**9 or num_attention_heads=2**28 cost gigabytes first.
#: Each bound is many times the largest real Llama-family model (Llama 3.1 405B: 126 layers, 128 heads, hidden
#: 16384, intermediate 53248; Gemma 3: 262144-token vocabulary; head sizes up to 256).
SIZE_LIMITS = {"num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
               "head_dim": 4096, "hidden_size": 1 << 18, "intermediate_size": 1 << 20, "vocab_size": 1 << 23}


class ModelError(YirageError, ValueError):
    """A model directory yirage cannot load; the message says what is wrong."""


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float
    tie_embeddings: bool
    qkv_bias: bool
    eos_token_id: tuple[int, ...]
    sliding_window: int | None = None  # attention span limit; longer sequences are refused
    max_positions: int | None = None  # max_position_embeddings: what the model was trained for (a warning limit)
    bos_token_id: int | None = None  # informational: prompts are tokenized by the model's tokenizer

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        if not isinstance(cfg, dict):
            raise ModelError(f"config.json must hold a JSON object (a dict of settings), got a "
                             f"{type(cfg).__name__}; use the config.json that save_pretrained writes")
        kind = cfg.get("model_type")
        if kind not in SUPPORTED:
            raise ModelError(f"model_type {kind!r} is not supported; yirage loads {', '.join(SUPPORTED)}")
        rope = dict(_typed(cfg, "rope_parameters", dict, {}) or {})  # transformers >= 5 keeps RoPE settings here
        scaling = _typed(cfg, "rope_scaling", dict, None) or rope
        if scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ModelError(f"RoPE scaling {scaling} is not supported yet; only plain RoPE (rope_theta)")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise NotSupportedError(f"config.json: hidden_act={act!r} is not supported; yirage's Llama-family "
                                    "decoder computes silu (\"silu\" or \"swish\"), so any other activation "
                                    "would give wrong numbers. Use a model whose config.json says \"silu\"")
        theta = 10000.0
        for where, settings in (("rope_theta", cfg), ("rope_parameters.rope_theta", rope)):  # the latter wins
            if settings.get("rope_theta") is not None:
                theta = _positive_number(settings["rope_theta"], where)
        if cfg.get("mlp_bias"):
            raise ModelError("mlp_bias=True (biases on gate/up/down) is not supported yet")
        if cfg.get("attention_bias") and kind != "qwen2":
            raise ModelError("attention_bias=True (q/k/v and o_proj biases) is not supported yet for "
                             f"{kind}; Qwen2's q/k/v biases are")
        hidden, heads = _count(cfg, "hidden_size"), _count(cfg, "num_attention_heads")
        kv_heads = _count(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}: "
                             "each kv head must serve a whole group of query heads; fix config.json")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ModelError(f"hidden_size={hidden} does not split into num_attention_heads={heads} heads; fix "
                             "config.json (or give head_dim explicitly)")
        head_dim = _count(cfg, "head_dim", hidden // heads)
        if head_dim % 2:
            raise ModelError(f"head_dim={head_dim} is odd; RoPE rotates pairs of dims, so it must be even")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in eos_ids):
            raise ModelError(f"eos_token_id must be an int id >= 0 or a list of them, got {eos!r}; fix config.json")
        eps = _positive_number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", allow_zero=True)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", kind == "mistral") else None
        return cls(
            model_type=kind,
            hidden=hidden,
            intermediate=_count(cfg, "intermediate_size"),
            layers=_count(cfg, "num_hidden_layers"),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=_count(cfg, "vocab_size"),
            rope_theta=theta,
            eps=eps,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2",
            eos_token_id=tuple(eos_ids),
            sliding_window=None if window is None else _count(cfg, "sliding_window"),
            max_positions=_count(cfg, "max_position_embeddings", 0) or None,
        )

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape every checkpoint tensor must have (names without the ``model.`` prefix)."""
        h, ff = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (self.vocab, h), "norm.weight": (h,),
                                              "lm_head.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                p + "mlp.down_proj.weight": (h, ff),
            })
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
        return shapes


def _count(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive int setting of config.json (``default`` when absent or null)."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ModelError(f"config.json has no {key!r}; it is required for a Llama-family model")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " (a model needs at least one decoder layer)" if key == "num_hidden_layers" else ""
        raise ModelError(f"config.json: {key}={value!r} must be a positive int{hint}; fix config.json")
    if value > SIZE_LIMITS.get(key, value):
        raise ModelError(f"config.json: {key}={value} exceeds {SIZE_LIMITS[key]}, many times what any Llama-family "
                         "model has (Llama 3.1 405B: 126 layers, 128 heads, hidden 16384); the value is damaged: fix "
                         "config.json")
    return value


def _positive_number(value: Any, key: str, allow_zero: bool = False) -> float:
    """A finite number > 0 (>= 0 with ``allow_zero``) from config.json; NaN or a string would give wrong numbers."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ModelError(f"config.json: {key}={value!r} must be a finite number {bound}; fix config.json (the "
                         "value transformers saved for this model, e.g. 10000.0 for rope_theta, 1e-6 for rms_norm_eps)")
    return float(value)


def _typed(cfg: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = cfg.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise ModelError(f"config.json: {key} must be a {kind.__name__} or null, got {value!r}")
    return value


def check_model_dir(model_dir: str | Path) -> Path:
    """The model directory, or a ModelError that says what was passed instead and what to pass."""
    try:
        path = Path(model_dir)
    except TypeError:
        raise ModelError(f"model_path must be a directory path (str or Path), got {type(model_dir).__name__}") \
            from None
    if not path.exists():
        raise ModelError(f"model path {str(path)!r} does not exist: pass the directory of a Hugging Face model "
                         "(with config.json and *.safetensors), e.g. one written by save_pretrained()")
    if not path.is_dir():
        raise ModelError(f"model path {str(path)!r} is a file, not a directory: pass the directory that holds "
                         f"config.json and *.safetensors (perhaps {str(path.parent)!r}), or a GGUF model file "
                         "(one that starts with the bytes 'GGUF')")
    return path


def load_config(model_dir: str | Path) -> LlamaConfig:
    path = check_model_dir(model_dir) / "config.json"
    try:
        return LlamaConfig.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ModelError(f"{path} does not exist: point model_path at a Hugging Face model directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON ({type(exc).__name__}: {exc}); re-save the model's config") \
            from exc


WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: Any) -> Any:
    """None (keep the checkpoint's), a torch float dtype, or its name ("float16", "torch.bfloat16"); or a
    quantized block format ("q8_0", "q4_0": returned as that string)."""
    import torch

    if dtype is None:
        return None
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and name.lower() in QUANT_FORMATS:
        return name.lower()
    if not isinstance(dtype, (str, torch.dtype)) or name not in WEIGHT_DTYPES:
        raise ModelError(f"dtype={dtype!r} is not supported; pass None (the checkpoint's dtype), one of "
                         f"{', '.join(WEIGHT_DTYPES)} (a torch.dtype or its name), or a weight-only quantized "
                         f"format: {', '.join(QUANT_FORMATS)}")
    return getattr(torch, name)


KV_DTYPES = ("float32", "bfloat16", "float16")


def resolve_kv_dtype(dtype: Any) -> Any:
    """The torch dtype of a model's KV caches: None means float32; else one of KV_DTYPES (a torch.dtype or its
    name). 16-bit caches halve the bytes each decode step reads at long contexts; the keys and values are
    rounded to them as a 16-bit model's transformers cache rounds them."""
    import torch

    if dtype is None:
        return torch.float32
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if not isinstance(dtype, (str, torch.dtype)) or name not in KV_DTYPES:
        raise ModelError(f"kv_cache_dtype={dtype!r} is not supported; pass None (float32) or one of "
                         f"{', '.join(KV_DTYPES)} (a torch.dtype or its name)")
    return getattr(torch, name)
