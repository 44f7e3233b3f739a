"""Llama-family models from a GGUF file (the format llama.cpp users already have on disk).

Reads the file with ``gguf.GGUFReader`` (the library llama.cpp publishes),
turns the ``<arch>.*`` metadata into a LlamaConfig, renames llama.cpp's tensors
to the Hugging Face names LlamaModel expects, dequantizes them into the
requested dtype, and undoes the q/k row permutation llama.cpp's converter
applies to ``llama`` models (it stores RoPE pairs interleaved; transformers'
GGUF loader reverses the same permutation, for ``llama`` only: Qwen2 is stored
unpermuted). Mistral models are written by llama.cpp as architecture ``llama``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yirage.errors import NotSupportedError
from yirage.models.config import LlamaConfig, ModelError, resolve_dtype

GGUF_MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "qwen2")  # llama.cpp's names; "llama" also covers Mistral
PERMUTED_QK = ("llama",)  # convert_hf_to_gguf permutes q/k rows for these (LlamaModel.permute)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(ModelError):
    """A GGUF file yirage cannot read; the message names the cause and the fix."""


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file says besides its weights (for the tokenizer and for reports)."""

    path: Path
    architecture: str
    name: str | None
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]
    chat_template: str | None
    has_tokenizer: bool
    tensor_types: dict[str, int]  # type name -> how many tensors have it


def is_gguf_file(path: str | Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` for ``path``, or a GGUFError saying why the file is not one."""
    try:
        p = Path(path)
    except TypeError:
        raise GGUFError(f"a GGUF path must be a str or Path, got {type(path).__name__}") from None
    if not p.is_file():
        what = "does not exist" if not p.exists() else "is not a file"
        raise GGUFError(f"GGUF path {str(p)!r} {what}: pass the path of a .gguf model file")
    if not is_gguf_file(p):
        raise GGUFError(f"{str(p)!r} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a model "
                        "file written by llama.cpp's convert_hf_to_gguf.py, or a Hugging Face model directory")
    try:
        import gguf
    except ImportError as exc:
        raise GGUFError("reading GGUF files needs the 'gguf' package (llama.cpp's reader): pip install gguf, or "
                        "install yirage with its [gguf] extra") from exc
    try:
        return gguf.GGUFReader(str(p))
    except (ValueError, IndexError, OSError, UnicodeDecodeError) as exc:  # gguf's parser on a torn/corrupt file
        raise GGUFError(f"{str(p)!r} starts like a GGUF file but cannot be parsed ({type(exc).__name__}: {exc}); "
                        "the file is probably truncated or corrupt: download or convert it again") from exc


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value (str, number, bool or list) of a GGUF file, ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _meta_count(reader: Any, key: str, default: int | None = None) -> int:
    value = metadata(reader, key)
    if value is None:
        if default is None:
            raise GGUFError(f"the GGUF metadata has no {key!r}; it is required for a Llama-family model: "
                            "re-convert the model with a current llama.cpp convert_hf_to_gguf.py")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GGUFError(f"GGUF metadata {key}={value!r} must be a positive int; the file is damaged or was "
                        "written by a broken converter: re-convert it")
    return value


def _meta_number(reader: Any, key: str, default: float) -> float:
    value = metadata(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise GGUFError(f"GGUF metadata {key}={value!r} must be a finite number >= 0; re-convert the model")
    return float(value)


def _token_id(reader: Any, key: str) -> int | None:
    value = metadata(reader, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFError(f"GGUF metadata {key}={value!r} must be a token id (an int >= 0); re-convert the model")
    return value


def read_config(reader: Any, path: str | Path) -> tuple[LlamaConfig, GGUFInfo]:
    """The LlamaConfig and tokenizer facts of an open GGUF file (no tensor data is read)."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise NotSupportedError(f"GGUF architecture {arch!r} is not supported; yirage loads the Llama family: "
                                f"{', '.join(ARCHITECTURES)} (Mistral files say 'llama'). Use a model of one of "
                                "those architectures")
    scaling = metadata(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise NotSupportedError(f"GGUF metadata {arch}.rope.scaling.type={scaling!r}: RoPE scaling is not "
                                "supported yet, only plain RoPE (rope.freq_base); use a model without it")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise NotSupportedError("the GGUF file has a rope_freqs.weight tensor (Llama 3.1-style RoPE frequency "
                                "scaling), which is not supported yet; use a model with plain RoPE")
    hidden = _meta_count(reader, f"{arch}.embedding_length")
    heads = _meta_count(reader, f"{arch}.attention.head_count")
    kv_heads = _meta_count(reader, f"{arch}.attention.head_count_kv", heads)
    head_dim = _meta_count(reader, f"{arch}.attention.key_length", hidden // heads if hidden % heads == 0 else 0)
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        if metadata(reader, key) not in (None, head_dim):
            raise NotSupportedError(f"GGUF metadata {key}={metadata(reader, key)!r} differs from the head size "
                                    f"{head_dim}: partial rotary embeddings and value heads of another size are "
                                    "not supported; use a standard Llama-family model")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFError("the GGUF file has no token_embd.weight tensor (the token embeddings); it is not a complete "
                        "Llama-family model: re-convert it")
    vocab = int(embd.shape[-1])  # ggml order: (hidden, vocab)
    if metadata(reader, f"{arch}.vocab_size") not in (None, vocab):
        raise GGUFError(f"GGUF metadata {arch}.vocab_size={metadata(reader, f'{arch}.vocab_size')} disagrees with "
                        f"token_embd.weight's {vocab} rows; the file is inconsistent: re-convert it")
    eos = [_token_id(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(e for e in eos if e is not None))  # every end-of-generation id, in order
    allowed = (".attn_q.bias", ".attn_k.bias", ".attn_v.bias") if arch == "qwen2" else ()
    bias = sorted(n for n in names if n.endswith(".bias") and not n.endswith(allowed))
    if bias:
        raise NotSupportedError(f"GGUF tensor {bias[0]!r}: biases are not supported for {arch} here (yirage's "
                                "decoder adds only Qwen2's q/k/v biases); use a model without them")
    cfg = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _meta_count(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _meta_count(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rope_theta": _meta_number(reader, f"{arch}.rope.freq_base", 10000.0),
        "rms_norm_eps": _meta_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": list(eos_ids),
        "max_position_embeddings": metadata(reader, f"{arch}.context_length"),
    }
    try:
        config = LlamaConfig.from_dict(cfg)
    except ModelError as exc:  # its messages speak of config.json: say where the values came from
        raise GGUFError(f"the GGUF metadata describes a model yirage cannot build: {exc}".replace(
            "config.json", "the GGUF metadata")) from exc
    bos = _token_id(reader, "tokenizer.ggml.bos_token_id")
    config = dataclasses.replace(config, bos_token_id=bos)
    info = GGUFInfo(
        path=Path(path), architecture=arch, name=metadata(reader, "general.name"),
        bos_token_id=bos, eos_token_id=eos_ids,
        chat_template=metadata(reader, "tokenizer.chat_template"),
        has_tokenizer="tokenizer.ggml.tokens" in reader.fields,
        tensor_types=_count_types(reader),
    )
    return config, info


def _count_types(reader: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def hf_name(name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name, or NotSupportedError for one yirage does not use."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise NotSupportedError(f"GGUF tensor {name!r} has no counterpart in yirage's Llama-family decoder "
                            "(token_embd, output_norm, output and blk.N.attn_norm/attn_q/attn_k/attn_v/attn_output/"
                            "ffn_norm/ffn_gate/ffn_up/ffn_down); the model needs a part yirage does not implement: "
                            "use a plain Llama, Mistral or Qwen2 model")


def gguf_name(hf: str) -> str:
    """The llama.cpp name of a Hugging Face tensor name (without ``model.``), for error messages."""
    glob = {v.removeprefix("model."): k for k, v in _GLOBAL_NAMES.items()}
    base, _, suffix = hf.rpartition(".")
    if base in glob:
        return f"{glob[base]}.{suffix}"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", base)
    block = {v: k for k, v in _BLOCK_NAMES.items()}
    return f"blk.{m.group(1)}.{block[m.group(2)]}.{suffix}" if m and m.group(2) in block else hf


def unpermute_qk(weight: Any, heads: int) -> Any:
    """Undo convert_hf_to_gguf's ``permute``: rows (head, d/2, 2) back to HF's (head, 2, d/2)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: Any) -> Any:
    """A float32 numpy array in row-major (PyTorch) order for one GGUF tensor of a supported type."""
    import numpy as np
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in TENSOR_TYPES:
        raise NotSupportedError(f"GGUF tensor {tensor.name!r} has type {kind}, which yirage does not dequantize "
                                f"(it reads {', '.join(TENSOR_TYPES)}); re-quantize the model to one of them, e.g. "
                                "llama-quantize model-f16.gguf out.gguf Q4_K_M (or Q8_0)")
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims fastest-first
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if values.size != math.prod(shape):
        raise GGUFError(f"GGUF tensor {tensor.name!r} ({kind}) holds {values.size} values, but its shape {shape} "
                        f"needs {math.prod(shape)}; the file is truncated or corrupt: re-convert it")
    return values.reshape(shape)


def read_gguf(path: str | Path, dtype: Any = None) -> tuple[LlamaConfig, dict[str, Any], GGUFInfo]:
    """Config, HF-named weights (in ``dtype``, default float32) and file facts of a GGUF model."""
    import numpy as np
    import torch

    dtype = resolve_dtype(dtype) or torch.float32  # before reading hundreds of megabytes
    reader = open_gguf(path)
    config, info = read_config(reader, path)
    shapes = config.weight_shapes()
    weights: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        values = dequantize_tensor(tensor)
        key = name.removeprefix("model.")
        if key in shapes and values.shape != shapes[key]:
            raise GGUFError(f"GGUF tensor {tensor.name!r} has shape {values.shape} (rows, cols), but the metadata "
                            f"implies {shapes[key]} for {name}; the tensors and the metadata disagree: re-convert "
                            "the model")
        if config.model_type in PERMUTED_QK and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            values = unpermute_qk(values, config.heads if ".attn_q." in tensor.name else config.kv_heads)
        # a copy: an F32 tensor is a read-only view of the file's memory map
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True)).to(dtype)
    missing = [k for k in shapes if f"model.{k}" not in weights and k != "lm_head.weight"]
    if missing:
        raise GGUFError(f"the GGUF file lacks tensor {gguf_name(missing[0])!r} (HF {missing[0]}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); the metadata says the "
                        f"model has {config.layers} layers: the file is incomplete, re-convert it")
    return config, weights, info
