"""A Llama-family checkpoint in decode layout, on the device that will read it.

One builder for one rank and for tensor parallelism: ``decode_weights`` takes
a reader of checkpoint tensors (whole, or one rank's rows/columns: see
yirage/distributed/sharding.py) and returns the weights the prefill and the
PersistentKernel decoder read: q/k/v fused and regrouped per KV head, gate
and up fused, narrow float dtypes kept, matrices optionally quantized into
GGUF blocks, and every tensor moved once onto ``device``, the backend's torch
device, so no decode step copies a weight.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yirage.models.config import LlamaConfig, ModelError, resolve_dtype
from yirage.quant import BLOCK, QuantizedTensor, quantize

#: reads rows (and columns) of one checkpoint tensor, named as in LlamaConfig.weight_shapes(), as a float tensor
Reader = Callable[[str, "slice | None", "slice | None"], Any]


def load_weights(model_dir: str | Path) -> dict[str, Any]:
    """Every tensor of a Hugging Face directory's ``*.safetensors`` files (sharded or not), on the CPU."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors files in {model_dir}; save the model with safe_serialization=True")
    weights: dict[str, Any] = {}
    for f in files:
        check_readable(f)
        try:
            weights.update(load_file(str(f)))
        except (OSError, SafetensorError) as exc:  # a torn header or data past the end of the file
            raise ModelError(f"cannot load {f} ({type(exc).__name__}: {exc}); the file is probably truncated or "
                             "corrupt: save or download the model again") from exc
    return weights


def check_readable(path: Path) -> None:
    """Open ``path`` as Python would, so an unreadable checkpoint is reported with its real OSError.

    Why: safetensors reports a failure to open the file with a message of its own that can mislead (a directory
    named model.safetensors gives "No such device"; issue 28 saw an unreadable file as "No such file or directory").
    """
    try:
        with open(path, "rb") as f:
            f.read(8)
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc} ({type(exc).__name__}, errno {exc.errno}); make "
                         "it a readable file (check its permissions and owner, or save the model again)") from exc


def dense(weight: Any) -> Any:
    """A weight as float32 for the torch prefill (quantized matrices dequantized), on its own device."""
    import torch

    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight.to(torch.float32)


def qkv_order(config: LlamaConfig) -> Any:
    """Rows of cat(q, k, v) regrouped per kv head: [q heads of g | k_g | v_g] for each g (``config``: the heads
    this rank holds)."""
    import torch

    c, d = config, config.head_dim
    k0 = c.heads * d
    v0 = k0 + c.kv_heads * d
    parts = []
    for g in range(c.kv_heads):
        parts.append(torch.arange(g * c.group * d, (g + 1) * c.group * d))
        parts.append(torch.arange(k0 + g * d, k0 + (g + 1) * d))
        parts.append(torch.arange(v0 + g * d, v0 + (g + 1) * d))
    return torch.cat(parts)


@dataclass(frozen=True)
class Slices:
    """The part of each matrix one rank holds (Megatron's split); all None: the whole model (one rank)."""

    q_rows: slice | None = None  # q_proj rows (this rank's query heads), and o_proj's input columns
    kv_rows: slice | None = None  # k/v_proj rows (this rank's KV heads)
    ff: slice | None = None  # gate/up rows and down's input columns (this rank's intermediate rows)
    vocab: slice | None = None  # lm_head rows (this rank's vocabulary)


WHOLE = Slices()


@dataclass
class DecodeWeights:
    """Weights in decode layout: ``embed``, ``norm``, ``lm_head`` (``embed`` itself when tied on one rank) and one
    dict per layer (``ln1``, ``qkv``, ``o``, ``ln2``, ``gate_up``, ``down``, optional ``qkv_bias``)."""

    embed: Any
    norm: Any
    lm_head: Any
    blocks: list[dict[str, Any]] = field(default_factory=list)

    def tensors(self) -> list[Any]:
        out = [self.embed, self.norm, self.lm_head]
        for blk in self.blocks:
            out.extend(blk.values())
        return out


def quantizable(config: LlamaConfig, fmt: str) -> None:
    """Refuse a model whose matrices do not split into whole ``fmt`` blocks along their rows."""
    bad = [(n, shape) for n, shape in config.weight_shapes().items() if len(shape) == 2 and shape[1] % BLOCK]
    if bad:
        raise ModelError(f"dtype={fmt!r} quantizes every matrix in blocks of {BLOCK} values along its rows, but "
                         f"{bad[0][0]} is {bad[0][1]}; use a float dtype for this model")


def decode_weights(config: LlamaConfig, read: Reader, dtype: Any = None, *, has_lm_head: bool, device: Any = "cpu",
                   slices: Slices = WHOLE, local: LlamaConfig | None = None) -> DecodeWeights:
    """The decode layout of what ``read`` returns, cast to ``dtype`` and placed on ``device``.

    ``dtype``: None (the checkpoint's), a float dtype, or "q8_0"/"q4_0" (matrices quantized, on the CPU, then
    moved). ``has_lm_head``: the checkpoint has its own LM head (else it is tied to the embedding). ``slices`` and
    ``local`` (the config of the heads in ``slices``) select one rank's part; the default is the whole model.
    """
    import torch

    dtype = resolve_dtype(dtype)
    fmt = dtype if isinstance(dtype, str) else None  # weight-only quantization: matrices as blocks
    if fmt:
        dtype = torch.float32
    target = torch.device(device)

    def cast(t: Any) -> Any:
        return (t if dtype is None else t.to(dtype)).contiguous().to(target)

    def matrix(t: Any) -> Any:
        if not fmt:
            return cast(t)
        qt = quantize(t, fmt)
        return QuantizedTensor(qt.blocks.to(target), qt.format, qt.shape)

    s = slices
    order = qkv_order(local or config)
    embed = matrix(read("embed_tokens.weight", None, None))
    if has_lm_head:
        lm_head = matrix(read("lm_head.weight", s.vocab, None))
    elif s.vocab is None:
        lm_head = embed  # tied on one rank: the decoder attaches it once
    elif isinstance(embed, QuantizedTensor):
        lm_head = QuantizedTensor(embed.blocks[s.vocab], embed.format, (s.vocab.stop - s.vocab.start, embed.shape[1]))
    else:
        lm_head = embed[s.vocab]  # tied: a view of the replicated embedding
    weights = DecodeWeights(embed, cast(read("norm.weight", None, None)), lm_head)
    rows = {"q": s.q_rows, "k": s.kv_rows, "v": s.kv_rows}
    for i in range(config.layers):
        p = f"layers.{i}."
        qkv = torch.cat([read(p + f"self_attn.{x}_proj.weight", rows[x], None) for x in "qkv"])[order]
        block = {
            "ln1": cast(read(p + "input_layernorm.weight", None, None)),
            "qkv": matrix(qkv),
            "o": matrix(read(p + "self_attn.o_proj.weight", None, s.q_rows)),
            "ln2": cast(read(p + "post_attention_layernorm.weight", None, None)),
            "gate_up": matrix(torch.cat([read(p + "mlp.gate_proj.weight", s.ff, None),
                                         read(p + "mlp.up_proj.weight", s.ff, None)])),
            "down": matrix(read(p + "mlp.down_proj.weight", None, s.ff)),
        }
        if config.qkv_bias:
            block["qkv_bias"] = cast(torch.cat([read(p + f"self_attn.{x}_proj.bias", rows[x], None)
                                                for x in "qkv"])[order])
        weights.blocks.append(block)
    return weights


def checkpoint_reader(config: LlamaConfig, weights: dict[str, Any]) -> tuple[Reader, bool]:
    """A Reader over a whole checkpoint dict (names with or without ``model.``), each tensor's shape checked
    against ``config``; and whether the checkpoint has its own LM head."""
    w = {k.removeprefix("model."): v for k, v in weights.items()}
    check_layer_count(w, config.layers)  # before weight_shapes(), which is built per layer
    shapes = config.weight_shapes()
    warn_unused_layers(w, config.layers)
    for name, shape in shapes.items():  # every shape before anything is made from the config's sizes
        if name in w and tuple(w[name].shape) != shape:
            raise _shape_error(name, w[name], shape)

    def read(name: str, rows: slice | None, cols: slice | None) -> Any:
        try:
            t = w[name]
        except KeyError:
            raise ModelError(f"weight {name!r} is missing from the checkpoint") from None
        if tuple(t.shape) != shapes[name]:  # a mismatch would index past a table in the compiled decoder
            raise _shape_error(name, t, shapes[name])
        if rows is not None:
            t = t[rows]
        return t if cols is None else t[:, cols]

    return read, "lm_head.weight" in w or not config.tie_embeddings


def _shape_error(name: str, tensor: Any, shape: tuple[int, ...]) -> ModelError:
    return ModelError(f"weight {name!r} has shape {tuple(tensor.shape)}, but config.json implies {shape}; the "
                      "checkpoint and config.json disagree: fix or re-export them")


def check_layer_count(weights: dict[str, Any], layers: int) -> None:
    """Refuse a num_hidden_layers the checkpoint's ``layers.N.*`` tensors do not back, before anything is made per
    layer (a config.json saying 10**9 layers would otherwise cost gigabytes of per-layer bookkeeping first)."""
    present = {int(m.group(1)) for m in map(re.compile(r"layers\.(\d+)\.").match, weights) if m}
    backed = sum(1 for i in present if i < layers)
    if backed < layers:
        first = min(set(range(min(layers, len(present) + 1))) - present)
        raise ModelError(f"config.json: num_hidden_layers={layers}, but the checkpoint holds weights for only "
                         f"{backed} of those layers (layers.{first}.* is the first missing); the checkpoint and "
                         "config.json disagree: fix num_hidden_layers or re-export the model")


def warn_unused_layers(weights: dict[str, Any], layers: int) -> None:
    """Checkpoint layers past num_hidden_layers are ignored (as transformers does); say so, naming them."""
    found = {int(m.group(1)) for m in map(re.compile(r"layers\.(\d+)\.").match, weights) if m}
    extra = sorted(found - set(range(layers)))
    if extra:
        names = ", ".join(f"layers.{i}.*" for i in extra[:8]) + (f", ... ({len(extra)} in all)" if len(extra) > 8
                                                                 else "")
        warnings.warn(f"the checkpoint has decoder layers that config.json's num_hidden_layers={layers} does not "
                      f"use: {names}. They are ignored (as transformers does); if the model needs them, set "
                      f"num_hidden_layers={max(extra) + 1} in config.json", UserWarning, stacklevel=5)
