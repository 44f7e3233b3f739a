"""Write a Llama-family model as a GGUF file llama.cpp loads (the peer in decode benchmarks).

The inverse of yirage/models/gguf.py: Hugging Face tensor names become
llama.cpp's (``gguf_name``), q/k rows are permuted the way llama.cpp's
convert_hf_to_gguf.py does for ``llama`` (RoPE pairs interleaved; the loader's
``unpermute_qk`` undoes it), the ``llama.*`` metadata llama.cpp needs is
written, a tied lm_head is left out (llama.cpp then reuses token_embd), and
2-D weights are stored in the requested type while norms stay F32, as the
converter does. The tokenizer is copied from another GGUF file, or a
synthetic SentencePiece-style vocabulary is written (enough for llama-bench,
which feeds random token ids).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from yirage.errors import NotSupportedError
from yirage.models.config import LlamaConfig, ModelError
from yirage.models.gguf import GGUFError, gguf_name, metadata, open_gguf

DTYPES = ("F32", "BF16", "F16", "Q8_0", "Q4_0")
QUANT_BLOCK = 32  # values per Q8_0 / Q4_0 block: a row must hold whole blocks
EXPORT_ARCHS = ("llama", "mistral")  # both written as llama.cpp's "llama" (as convert_hf_to_gguf does)
DEFAULT_CONTEXT = 2048  # llama.context_length when the config has no max_position_embeddings (HF's default)


class GGUFExportError(GGUFError):
    """A model that cannot be written as GGUF; the message names the cause and the fix."""


def permute_qk(weight: Any, heads: int) -> Any:
    """convert_hf_to_gguf's ``LlamaModel.permute``: rows (head, 2, d/2) to llama.cpp's (head, d/2, 2)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dtype(dtype: Any) -> str:
    name = getattr(dtype, "name", dtype)
    if isinstance(name, str) and name.upper() in DTYPES:
        return name.upper()
    raise GGUFExportError(f"GGUF export dtype {dtype!r} is not supported; pass one of {', '.join(DTYPES)} "
                          "(a string or a gguf.GGMLQuantizationType)")


def _config(config: Any) -> LlamaConfig:
    if isinstance(config, LlamaConfig):
        cfg = config
    else:
        as_dict = config.to_dict() if hasattr(config, "to_dict") else config
        if not isinstance(as_dict, dict):
            raise GGUFExportError(f"export_gguf needs a yirage LlamaConfig, a transformers LlamaConfig or its dict, "
                                  f"got {type(config).__name__}; pass model.config")
        cfg = LlamaConfig.from_dict(as_dict)
    if cfg.model_type not in EXPORT_ARCHS:
        raise NotSupportedError(f"GGUF export of model_type {cfg.model_type!r} is not supported; it writes "
                                f"{', '.join(EXPORT_ARCHS)} models (as llama.cpp's 'llama'). Export a Llama or "
                                "Mistral model")
    return cfg


def _to_numpy(name: str, value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor, any dtype or device
        import torch

        value = value.detach().to("cpu", torch.float32).numpy()
    try:
        return np.ascontiguousarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise GGUFExportError(f"state_dict[{name!r}] is a {type(value).__name__} that is not a float array "
                              f"({exc}); pass torch tensors or numpy arrays") from exc


def _weights(cfg: LlamaConfig, state_dict: dict[str, Any]) -> dict[str, Any]:
    """HF-named tensors (``model.`` prefix optional) as float32 arrays, checked against the config's shapes."""
    import numpy as np

    if not hasattr(state_dict, "items"):
        raise GGUFExportError(f"state_dict must be a mapping of HF tensor names to tensors, got "
                              f"{type(state_dict).__name__}; pass model.state_dict()")
    shapes = cfg.weight_shapes()
    found: dict[str, Any] = {}
    for name, value in state_dict.items():
        key = name.removeprefix("model.")
        if key.endswith("rotary_emb.inv_freq"):  # a buffer some checkpoints keep; llama.cpp computes RoPE itself
            continue
        if key not in shapes:
            raise GGUFExportError(f"state_dict tensor {name!r} is not part of a {cfg.model_type} model with "
                                  f"{cfg.layers} layers (expected names like model.layers.0.self_attn.q_proj.weight);"
                                  " pass the state dict of the model the config describes")
        array = _to_numpy(name, value)
        if array.shape != shapes[key]:
            raise GGUFExportError(f"state_dict tensor {name!r} has shape {array.shape}, but the config implies "
                                  f"{shapes[key]}; the config and the weights disagree: pass the matching config")
        found[key] = array
    needed = [k for k in shapes if k != "lm_head.weight" or not cfg.tie_embeddings]
    missing = [k for k in needed if k not in found]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise GGUFExportError(f"state_dict lacks {missing[0]!r}{more}; a {cfg.layers}-layer model needs all of "
                              "them (an untied lm_head too): pass the full state dict")
    if cfg.tie_embeddings and "lm_head.weight" in found:
        if not np.array_equal(found["lm_head.weight"], found["embed_tokens.weight"]):
            raise GGUFExportError("the config says tie_word_embeddings=True but lm_head.weight differs from "
                                  "model.embed_tokens.weight; set tie_word_embeddings=False to keep both")
        del found["lm_head.weight"]
    return found


def _encode(key: str, array: Any, dtype: str, cfg: LlamaConfig) -> tuple[Any, Any]:
    """The data and ggml type of one tensor: 1-D tensors stay F32, 2-D ones get ``dtype``."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[dtype if array.ndim == 2 else "F32"]
    if qtype.name in ("Q8_0", "Q4_0") and array.shape[-1] % QUANT_BLOCK:
        raise GGUFExportError(f"tensor {gguf_name(key)!r} (HF {key}) has rows of {array.shape[-1]} values, not a "
                              f"multiple of the {qtype.name} block of {QUANT_BLOCK}; export this model as F32, F16 "
                              "or BF16 instead")
    if key.endswith(("q_proj.weight", "k_proj.weight")):
        array = permute_qk(array, cfg.heads if key.endswith("q_proj.weight") else cfg.kv_heads)
    return quantize(array, qtype), qtype


def _copy_tokenizer(writer: Any, source: str | Path, vocab: int) -> None:
    import gguf

    reader = open_gguf(source)
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFExportError(f"tokenizer_from={str(source)!r} has no tokenizer (no tokenizer.ggml.tokens); pass a "
                              "GGUF model file that carries one, or tokenizer_from=None for a synthetic vocabulary")
    if len(tokens) != vocab:
        raise GGUFExportError(f"the tokenizer of {str(source)!r} has {len(tokens)} tokens but the model's vocab_size "
                              f"is {vocab}; pass a tokenizer of the same vocabulary, or tokenizer_from=None")
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)


def _synthetic_tokenizer(writer: Any, cfg: LlamaConfig) -> None:
    """A SentencePiece-style ("llama") vocabulary of ``cfg.vocab`` tokens: unk, bos, eos, bytes, then fillers."""
    import gguf

    kinds = gguf.TokenType
    bos = cfg.bos_token_id if cfg.bos_token_id is not None and cfg.bos_token_id < cfg.vocab else 1
    eos = next((e for e in cfg.eos_token_id if e < cfg.vocab), 2)
    special = {0: ("<unk>", kinds.UNKNOWN), bos: ("<s>", kinds.CONTROL), eos: ("</s>", kinds.CONTROL)}
    tokens, types = [], []
    byte = 0
    for i in range(cfg.vocab):
        if i in special:
            tok, kind = special[i]
        elif byte < 256:
            tok, kind, byte = f"<0x{byte:02X}>", kinds.BYTE, byte + 1
        else:
            tok, kind = f"\u2581t{i}", kinds.NORMAL
        tokens.append(tok)
        types.append(kind)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0 if t != kinds.NORMAL else -float(i) for i, t in enumerate(types)])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    if bos < cfg.vocab:
        writer.add_bos_token_id(bos)
    if eos < cfg.vocab:
        writer.add_eos_token_id(eos)


def _metadata(writer: Any, cfg: LlamaConfig, dtype: str) -> None:
    import gguf

    writer.add_type("model")
    writer.add_context_length(cfg.max_positions or DEFAULT_CONTEXT)
    writer.add_embedding_length(cfg.hidden)
    writer.add_block_count(cfg.layers)
    writer.add_feed_forward_length(cfg.intermediate)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_head_count(cfg.heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_layer_norm_rms_eps(cfg.eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.head_dim * cfg.heads != cfg.hidden:  # llama.cpp assumes hidden / heads otherwise
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab)
    file_type = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
                 "Q4_0": "MOSTLY_Q4_0"}[dtype]
    writer.add_file_type(gguf.LlamaFileType[file_type])
    if dtype in ("Q8_0", "Q4_0"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_gguf(path: str | Path, config: Any, state_dict: dict[str, Any], dtype: Any, *,
                tokenizer_from: str | Path | None = None) -> Path:
    """Write ``state_dict`` (HF names) of the Llama/Mistral model ``config`` to ``path`` as GGUF; returns the path.

    ``dtype``: one of F32, BF16, F16, Q8_0, Q4_0 for the 2-D weights (norms stay F32).
    ``tokenizer_from``: a GGUF file whose ``tokenizer.*`` metadata is copied (same vocab
    size required); without it a synthetic vocabulary is written. The file appears
    atomically: it is written under a temporary name and renamed.
    """
    try:
        import gguf
    except ImportError as exc:
        raise GGUFExportError("writing GGUF files needs the 'gguf' package (llama.cpp's writer): pip install gguf, "
                              "or install yirage with its [gguf] extra") from exc
    dtype = _dtype(dtype)
    try:
        cfg = _config(config)
    except ModelError as exc:
        raise GGUFExportError(f"the config cannot be exported: {exc}") from exc
    out = Path(path)
    if not out.parent.is_dir():
        raise GGUFExportError(f"cannot write {str(out)!r}: its directory does not exist; create it first")
    weights = _weights(cfg, state_dict)
    tensors = {gguf_name(k): _encode(k, v, dtype, cfg) for k, v in weights.items()}  # every check before writing
    part = out.with_name(f".{out.name}.{os.getpid()}.part")
    writer = gguf.GGUFWriter(str(part), "llama")
    try:
        _metadata(writer, cfg, dtype)
        if tokenizer_from is not None:
            _copy_tokenizer(writer, tokenizer_from, cfg.vocab)
        else:
            _synthetic_tokenizer(writer, cfg)
        for name, (data, qtype) in tensors.items():
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(part, out)
    finally:
        writer.close()  # closes the file when a step above failed (a second close does nothing)
        part.unlink(missing_ok=True)
    return out
