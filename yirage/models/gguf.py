"""Llama-family models from a GGUF file (the format llama.cpp users already have on disk).

Reads the file's header with ``gguf_file`` (checked as it goes, and 40x faster
than ``gguf.GGUFReader``, whose type tables and dequantizers it uses), turns the
``<arch>.*`` metadata into a LlamaConfig, renames llama.cpp's tensors to the
Hugging Face names LlamaModel expects, dequantizes them into the requested
dtype, and undoes the q/k row permutation llama.cpp's converter applies to
``llama`` models (it stores RoPE pairs interleaved; transformers' GGUF loader
reverses the same permutation, for ``llama`` only: Qwen2 is stored unpermuted).
Mistral models are written by llama.cpp as architecture ``llama``.
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
from yirage.models.gguf_file import MAX_ARRAY_LEN as MAX_ARRAY_LEN  # re-exported: the limit errors name it
from yirage.models.gguf_file import GGUFError, GGUFFile, read_file

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

#: the special token ids transformers' GGUF tokenizer indexes the token list with, and the end ids yirage stops on
SPECIAL_IDS = ("bos", "eos", "eot", "eom", "unknown", "padding")


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


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed header of ``path`` (``gguf_file.GGUFFile``: metadata, tensor views), or a GGUFError saying why
    the file is not one."""
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
        import gguf  # noqa: F401 - its type tables and dequantizers
    except ImportError as exc:
        raise GGUFError("reading GGUF files needs the 'gguf' package (llama.cpp's reader): pip install gguf, or "
                        "install yirage with its [gguf] extra") from exc
    try:
        return read_file(p)
    except OSError as exc:
        raise GGUFError(f"{str(p)!r} could not be read ({type(exc).__name__}: {exc}); check the file's "
                        "permissions and that it is complete") from exc


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
    if metadata(reader, f"{arch}.attention.key_length") is None and hidden % heads:
        raise GGUFError(f"GGUF metadata {arch}.embedding_length={hidden} is not divisible by "
                        f"{arch}.attention.head_count={heads} ({hidden} / {heads} = {hidden / heads:g}), and the file "
                        f"gives no {arch}.attention.key_length, so the head size is not a whole number; the metadata "
                        "is inconsistent: re-convert the model")
    head_dim = _meta_count(reader, f"{arch}.attention.key_length", hidden // heads)
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
    layers = _meta_count(reader, f"{arch}.block_count")
    _check_block_count(reader, f"{arch}.block_count", layers)
    _check_tokenizer(reader, vocab)
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
        "num_hidden_layers": layers,
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


def _check_block_count(reader: Any, key: str, layers: int) -> None:
    """Refuse a layer count the file's ``blk.N.*`` tensors do not back, before anything is made per layer (a
    small file declaring 2**31 layers would otherwise cost gigabytes of per-layer bookkeeping)."""
    present = {int(m.group(1)) for m in (_BLOCK.fullmatch(t.name) for t in reader.tensors) if m}
    backed = sum(1 for i in present if i < layers)
    if backed < layers:
        held = f"blk.0 to blk.{max(present)}" if present and len(present) == max(present) + 1 else \
            f"{len(present)} distinct blk.N indices" if present else "none"
        raise GGUFError(f"GGUF metadata {key}={layers}, but the file holds tensors for only {backed} of those "
                        f"layers (its blk.N tensors: {held}); the metadata and the tensors disagree: the file is "
                        "damaged or incomplete, re-convert it")


def _check_tokenizer(reader: Any, vocab: int) -> None:
    """Refuse, at load, tokenizer metadata that would fail later: a token list that is not strings or has fewer
    tokens than token_embd.weight has rows, or a special token id outside both.

    Refused rather than repaired (for instance by dropping a bad special id with a warning) because transformers
    builds the tokenizer from the same metadata and indexes the token list with these ids: every generate() would
    then decode its tokens and fail at the end with a raw IndexError or TypeError, losing the result; and an end
    id the model can never emit would silently never stop a generation. Such a file comes from a broken converter
    or an edit, and its ids cannot be trusted.
    """
    import gguf

    field = reader.fields.get("tokenizer.ggml.tokens")
    tokens = vocab
    if field is not None:
        if field.types[:1] != [gguf.GGUFValueType.ARRAY] or field.types[-1] != gguf.GGUFValueType.STRING:
            kinds = "/".join(t.name for t in field.types) or "empty"
            raise GGUFError(f"GGUF metadata tokenizer.ggml.tokens must be an array of strings (the vocabulary), got "
                            f"{kinds}; the file is damaged: re-convert the model")
        tokens = len(field.data)
        if tokens < vocab:
            raise GGUFError(f"GGUF metadata tokenizer.ggml.tokens has {tokens} tokens, fewer than the {vocab} rows "
                            f"of token_embd.weight: ids {tokens}..{vocab - 1} could be generated but not decoded "
                            "(llama.cpp requires one token per row); the file is damaged: re-convert the model")
    for kind in SPECIAL_IDS:
        key = f"tokenizer.ggml.{kind}_token_id"
        value = _token_id(reader, key)
        if value is not None and value >= min(tokens, vocab):
            raise GGUFError(f"GGUF metadata {key}={value} is not a token id of this model (the vocabulary has "
                            f"{min(tokens, vocab)} tokens: ids 0..{min(tokens, vocab) - 1}); the tokenizer would fail "
                            "on it: the file is damaged, re-convert the model (or fix the id with the gguf package's "
                            "gguf-set-metadata)")


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
    if kind in ("F32", "F16"):  # in the file's byte order (gguf's dequantize reads them as this machine's)
        values = np.asarray(tensor.data, dtype=np.float32)
    elif kind in _BLOCKS:
        values = _dequantize_blocks(tensor.data, kind)
    else:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if values.size != math.prod(shape):
        raise GGUFError(f"GGUF tensor {tensor.name!r} ({kind}) holds {values.size} values, but its shape {shape} "
                        f"needs {math.prod(shape)}; the file is truncated or corrupt: re-convert it")
    return values.reshape(shape)


_BLOCKS = {"BF16": 2, "Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # bytes per block (of 1 value for BF16, else 32)


def _dequantize_blocks(data: Any, kind: str) -> Any:
    """gguf.quants' dequantization of ``kind`` with its exact float32 operations, in torch over the whole tensor at
    once: gguf-py loops over groups of rows in numpy, 1.6 s of a 1.9 s SmolLM2 load (Q4_1) on 2 cores."""
    import numpy as np
    import torch

    raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(-1, _BLOCKS[kind]))
    if kind == "BF16":
        return (raw.view(torch.int16).to(torch.int32) << 16).view(torch.float32).numpy().reshape(-1)
    d = raw[:, :2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        return (raw[:, 2:].contiguous().view(torch.int8).float() * d).numpy().reshape(-1)
    qs = raw[:, 2 if kind == "Q4_0" else 4:]
    nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # a block's low nibbles are its first 16 values
    if kind == "Q4_0":
        return (d * (nibbles.to(torch.int8) - 8).float()).numpy().reshape(-1)
    m = raw[:, 2:4].contiguous().view(torch.float16).float()
    return ((d * nibbles.float()) + m).numpy().reshape(-1)


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
        key = name.removeprefix("model.")
        stored = tuple(int(n) for n in reversed(tensor.shape))  # checked before dequantizing: nothing is made yet
        if key in shapes and stored != shapes[key]:
            raise GGUFError(f"GGUF tensor {tensor.name!r} has shape {stored} (rows, cols), but the metadata "
                            f"implies {shapes[key]} for {name}; the tensors and the metadata disagree: re-convert "
                            "the model")
        values = dequantize_tensor(tensor)
        if config.model_type in PERMUTED_QK and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            values = unpermute_qk(values, config.heads if ".attn_q." in tensor.name else config.kv_heads)
        # an F32 tensor is a read-only view of the file's memory map: copied; dequantized values are new already
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C",
                                                  copy=True if np.shares_memory(values, tensor.data) else None)
                                         ).to(dtype)
    missing = [k for k in shapes if f"model.{k}" not in weights and k != "lm_head.weight"]
    if missing:
        raise GGUFError(f"the GGUF file lacks tensor {gguf_name(missing[0])!r} (HF {missing[0]}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); the metadata says the "
                        f"model has {config.layers} layers: the file is incomplete, re-convert it")
    return config, weights, info
