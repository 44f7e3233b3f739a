"""Llama-family models (Llama, Qwen2 with qkv bias, Mistral GQA) from a Hugging Face directory or a GGUF file.

Reads ``config.json`` and ``*.safetensors`` (sharded or not), keeps weights
in their stored dtype (bf16/fp16 are widened to float32 in the kernels), and
builds the decode step as a PersistentKernel (GGUF files: yirage/models/gguf.py). The prompt is prefilled in one
batched pass with torch matmuls, filling the same KV caches the kernel uses.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yirage.errors import NotSupportedError, YirageError
from yirage.quant import FORMATS as QUANT_FORMATS
from yirage.quant import QuantizedTensor, quantize

SUPPORTED = ("llama", "qwen2", "mistral")


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


def load_weights(model_dir: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors files in {model_dir}; save the model with safe_serialization=True")
    weights: dict[str, Any] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def rope_tables(config: LlamaConfig, positions: int) -> tuple[Any, Any]:
    """HF-style cos/sin (positions, head_dim) in float32 (rotate_half convention)."""
    import torch

    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def attend(x: Any, blk: dict[str, Any], cos: Any, sin: Any, positions: Any, k_cache: Any, v_cache: Any,
           c: LlamaConfig) -> Any:
    """One layer's attention up to o_proj, (B, T, heads * head_dim), writing that layer's KV caches: RMSNorm,
    the fused QKV projection (grouped per KV head), RoPE, causal attention over the cached positions. ``c``
    may be one rank's share of the model (yirage.distributed): its heads and KV heads."""
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
    out = torch.empty(b, t, c.kv_heads, c.group, d)
    for row in range(b):
        k_cache[row, :, positions[row]] = k[row].transpose(0, 1)
        v_cache[row, :, positions[row]] = v[row].transpose(0, 1)
        end = int(positions[row].max()) + 1
        keys, vals = k_cache[row, :, :end], v_cache[row, :, :end]  # (Hkv, S, D)
        scores = torch.einsum("tgjd,gsd->tgjs", q[row], keys) / math.sqrt(d)
        mask = torch.arange(end)[None, :] > positions[row][:, None]  # causal over cache positions
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


def dense(weight: Any) -> Any:
    """A weight as float32 for the torch prefill (quantized matrices dequantized)."""
    import torch

    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight.to(torch.float32)


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


def _warn_unused_layers(weights: dict[str, Any], layers: int) -> None:
    """Checkpoint layers past num_hidden_layers are ignored (as transformers does); say so, naming them."""
    found = {int(m.group(1)) for m in map(re.compile(r"layers\.(\d+)\.").match, weights) if m}
    extra = sorted(found - set(range(layers)))
    if extra:
        names = ", ".join(f"layers.{i}.*" for i in extra[:8]) + (f", ... ({len(extra)} in all)" if len(extra) > 8
                                                                 else "")
        warnings.warn(f"the checkpoint has decoder layers that config.json's num_hidden_layers={layers} does not "
                      f"use: {names}. They are ignored (as transformers does); if the model needs them, set "
                      f"num_hidden_layers={max(extra) + 1} in config.json", UserWarning, stacklevel=4)


class LlamaModel:
    """Weights in decode layout, KV caches, prefill in torch, decode as a PersistentKernel."""

    def __init__(self, config: LlamaConfig, weights: dict[str, Any], dtype: Any = None) -> None:
        import torch

        self.config = config
        c = config
        dtype = resolve_dtype(dtype)
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        fmt = dtype if isinstance(dtype, str) else None  # weight-only quantization: matrices as blocks
        if fmt:
            bad = [(n, shape) for n, shape in c.weight_shapes().items() if len(shape) == 2 and shape[1] % 32]
            if bad:
                raise ModelError(f"dtype={fmt!r} quantizes every matrix in blocks of 32 values along its rows, but "
                                 f"{bad[0][0]} is {bad[0][1]}; use a float dtype for this model")
            dtype = torch.float32
        cast = (lambda t: t.to(dtype).contiguous()) if dtype is not None else (lambda t: t.contiguous())
        matrix = (lambda t: quantize(t, fmt)) if fmt else cast
        shapes = c.weight_shapes()

        def get(name: str) -> Any:
            try:
                t = w[name]
            except KeyError:
                raise ModelError(f"weight {name!r} is missing from the checkpoint") from None
            if tuple(t.shape) != shapes[name]:  # a mismatch would index past a table in the compiled decoder
                raise ModelError(f"weight {name!r} has shape {tuple(t.shape)}, but config.json implies "
                                 f"{shapes[name]}; the checkpoint and config.json disagree: fix or re-export them")
            return t

        _warn_unused_layers(w, c.layers)
        self.embed = matrix(get("embed_tokens.weight"))
        self.norm = cast(get("norm.weight"))
        tied = "lm_head.weight" not in w and c.tie_embeddings
        self.lm_head = self.embed if tied else matrix(get("lm_head.weight"))
        order = self._qkv_order()
        self.blocks = []
        for i in range(c.layers):
            p = f"layers.{i}."
            qkv = torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])[order]
            block = {
                "ln1": cast(get(p + "input_layernorm.weight")),
                "qkv": matrix(qkv),
                "o": matrix(get(p + "self_attn.o_proj.weight")),
                "ln2": cast(get(p + "post_attention_layernorm.weight")),
                "gate_up": matrix(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])),
                "down": matrix(get(p + "mlp.down_proj.weight")),
            }
            if c.qkv_bias:
                block["qkv_bias"] = cast(torch.cat([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])[order])
            self.blocks.append(block)
        self.k_cache: list[Any] = []
        self.v_cache: list[Any] = []
        self.cos = self.sin = None
        self.gguf: Any = None  # a GGUFInfo when loaded with from_gguf

    def _qkv_order(self) -> Any:
        """Rows of cat(q, k, v) regrouped per kv head: [q heads of g | k_g | v_g] for each g."""
        import torch

        c, d = self.config, self.config.head_dim
        q_rows, k0 = c.heads * d, c.heads * d
        v0 = k0 + c.kv_heads * d
        parts = []
        for g in range(c.kv_heads):
            parts.append(torch.arange(g * c.group * d, (g + 1) * c.group * d))
            parts.append(torch.arange(k0 + g * d, k0 + (g + 1) * d))
            parts.append(torch.arange(v0 + g * d, v0 + (g + 1) * d))
        del q_rows
        return torch.cat(parts)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: Any = None) -> LlamaModel:
        dtype = resolve_dtype(dtype)  # before reading gigabytes of weights
        return cls(load_config(model_dir), load_weights(model_dir), dtype)

    @classmethod
    def from_gguf(cls, path: str | Path, dtype: Any = None) -> LlamaModel:
        """A model from a llama.cpp GGUF file, dequantized into ``dtype`` (default float32).

        ``model.gguf`` keeps the file's facts (tokenizer ids, chat template, tensor types).
        """
        from yirage.models.gguf import read_gguf

        fmt = resolve_dtype(dtype)
        quantized = isinstance(fmt, str)  # read as float32, then quantize (Q8_0/Q4_0 files round-trip exactly)
        config, weights, info = read_gguf(path, None if quantized else fmt)
        model = cls(config, weights, fmt if quantized else None)
        model.gguf = info
        return model

    def check_cache_fits(self, batch_size: int, max_len: int) -> None:
        """Refuse, before allocating anything, a KV cache larger than the memory available now."""
        import psutil

        c = self.config
        kv = 2 * c.layers * batch_size * c.kv_heads * max_len * c.head_dim * 4  # float32 keys and values
        rest = 2 * max_len * c.head_dim * 4 + batch_size * max_len * 8  # RoPE tables, token buffer
        available = psutil.virtual_memory().available
        if kv + rest > available:
            raise ModelError(
                f"the KV cache for batch {batch_size} x {max_len} positions would need {kv / 2**30:.3g} GB "
                f"({c.layers} layers x {c.kv_heads} kv heads x head_dim {c.head_dim}, float32 keys and values), but "
                f"only {available / 2**30:.3g} GB of memory is available; lower max_new_tokens (or the prompt "
                "length or batch size)")

    def reset_cache(self, batch_size: int, max_len: int) -> None:
        import torch

        c = self.config
        self.check_cache_fits(batch_size, max_len)
        shape = (batch_size, c.kv_heads, max_len, c.head_dim)
        self.k_cache = [torch.zeros(shape, device="cpu") for _ in range(c.layers)]
        self.v_cache = [torch.zeros(shape, device="cpu") for _ in range(c.layers)]
        self.cos, self.sin = rope_tables(c, max_len)

    # -- prefill (and any multi-token forward) in torch ----------------------------------
    def forward(self, input_ids: Any, positions: Any, last_only: bool = False) -> Any:
        """Logits (B, T, vocab) for ``input_ids`` at ``positions`` (B, T), writing the KV caches; with
        ``last_only``, (B, 1, vocab) for the last position only (a prompt's prefill: the lm_head over every
        position is most of a short prompt's time, and generation reads only the last)."""
        import torch
        import torch.nn.functional as F

        c = self.config
        if not self.k_cache:
            raise ModelError("call reset_cache(batch_size, max_len) before forward")
        if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2
                and input_ids.dtype in (torch.int32, torch.int64)):
            raise ModelError(f"input_ids must be a (batch, len) int tensor, got {getattr(input_ids, 'shape', None)} "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        b, t = input_ids.shape
        cache_batch, cache_len = self.k_cache[0].shape[0], self.k_cache[0].shape[2]
        if b > cache_batch:
            raise ModelError(f"input_ids has batch {b}, but the KV cache holds {cache_batch} rows: call "
                             f"reset_cache({b}, max_len) first")
        if not isinstance(positions, torch.Tensor) or positions.shape != (b, t) or t == 0 \
                or int(positions.min()) < 0 or int(positions.max()) >= cache_len:
            raise ModelError(f"positions must be a (B, T) = {(b, t)} tensor of positions in [0, {cache_len}) (the "
                             f"cache length; call reset_cache(batch, max_len) for a longer one)")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= c.vocab:
            raise ModelError(f"input_ids must lie in [0, vocab_size={c.vocab})")
        f32 = torch.float32
        x = self.embed.dequantize(input_ids) if isinstance(self.embed, QuantizedTensor) else \
            self.embed[input_ids].to(f32)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # (B, T, 1, D)
        for i, blk in enumerate(self.blocks):
            x = x + attend(x, blk, cos, sin, positions, self.k_cache[i], self.v_cache[i], c) @ dense(blk["o"]).t()
            x = x + gated_mlp(x, blk, c)
        if last_only:
            x = x[:, -1:]
        x = F.rms_norm(x, (c.hidden,), self.norm.to(f32), c.eps)
        return x @ dense(self.lm_head).t()

    # -- decode as a PersistentKernel ---------------------------------------------------------
    def build_decoder(self, step: Any, tokens: Any, backend: Any = None, num_workers: int | None = None,
                      num_local_schedulers: int | None = None, eos_token_id: Any = None,
                      sampling: dict[str, Any] | None = None, profiler_tensor: Any = None,
                      tasks: int | None = None) -> Any:
        """A PersistentKernel that decodes with these weights and caches (call reset_cache first).

        ``tasks``: tasks per projection (the LM head gets twice as many); None: the ``tasks_per_layer`` of the
        kernel's configuration (the backend's ``default_config`` or a saved one), else 16.
        """

        from yirage.persistent.kernel import PersistentKernel

        c, batch = self.config, tokens.shape[0]
        if not self.k_cache or self.k_cache[0].shape[0] != batch:
            raise ModelError("call reset_cache(batch_size, max_len) with the tokens' batch size first")
        max_len = self.k_cache[0].shape[2]
        pk = PersistentKernel(num_workers=num_workers, num_local_schedulers=num_local_schedulers,
                              max_seq_length=max_len, eos_token_id=eos_token_id, meta_tensors=[step, tokens],
                              profiler_tensor=profiler_tensor, backend=backend)
        if tasks is None:
            tasks = int(pk.config.values().get("tasks_per_layer") or DEFAULT_TASKS)
        att = pk.attach_input
        cos, sin = att(self.cos, "rope_cos"), att(self.sin, "rope_sin")
        x = pk.new_tensor((batch, c.hidden), name="x0")
        pk.embed_layer(pk.tokens_tensor, att(self.embed, "embed"), x, grid_dim=divisor_near(c.hidden, tasks))
        x = decoder_blocks(pk, c, self.blocks, self.k_cache, self.v_cache, cos, sin, x, tasks)
        logits = pk.new_tensor((batch, c.vocab), name="logits")
        lm_head = att(self.lm_head, "lm_head") if self.lm_head is not self.embed else pk.tensors["embed"]
        pk.rmsnorm_linear_layer(x, att(self.norm, "final_norm"), lm_head, logits,
                                grid_dim=divisor_near(c.vocab, 2 * tasks), eps=c.eps)
        return pick_and_compile(pk, logits, sampling)
