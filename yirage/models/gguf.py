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
import mmap
import re
import struct
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

#: Limits a GGUF header is checked against before gguf.GGUFReader parses it. Why: the reader builds numpy objects
#: for every metadata element and every tensor (measured: about 0.7 KB and 11 us per number, 1.4 KB and 30 us per
#: string), so a small file declaring a 10**7-element array, or millions of keys or tensors, would cost gigabytes
#: and minutes before any value could be checked. Real Llama-family files stay far below them: the largest
#: vocabularies have 262144 tokens (Gemma 3), the longest merge lists 280147 (Llama 3), a 126-layer model about
#: 1.1k tensors and 50 keys.
MAX_ARRAY_LEN = 1 << 20
MAX_METADATA_ELEMENTS = 1 << 21  # all arrays together
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 16
GGML_MAX_DIMS = 4
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
#: the special token ids transformers' GGUF tokenizer indexes the token list with, and the end ids yirage stops on
SPECIAL_IDS = ("bos", "eos", "eot", "eom", "unknown", "padding")


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
    check_header(p)  # counts, lengths and tensor extents against the file, before the reader allocates for them
    try:
        return gguf.GGUFReader(str(p))
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as exc:  # a torn/corrupt file
        raise GGUFError(f"{str(p)!r} starts like a GGUF file but cannot be parsed ({type(exc).__name__}: {exc}); "
                        "the file is probably truncated or corrupt: download or convert it again") from exc


class _Cursor:
    """Reads a GGUF header through a read-only memory map and never past the file's end (so nothing it is told
    to read can make it allocate more than the file holds)."""

    def __init__(self, buf: Any, size: int, name: str) -> None:
        self.buf, self.size, self.name, self.pos, self.order = buf, size, name, 0, "<"

    def fail(self, what: str, why: str) -> GGUFError:
        return GGUFError(f"{self.name!r} starts like a GGUF file but cannot be parsed ({what} {why}); the file is "
                         "truncated or corrupt: download or convert it again")

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n > self.size - start:
            raise self.fail(what, f"needs {n} bytes at offset {start}, past the end of the file ({self.size} bytes)")
        self.pos = start + n
        return start

    def uint(self, width: int, what: str) -> int:
        return struct.unpack_from(self.order + ("I" if width == 4 else "Q"), self.buf, self.take(width, what))[0]

    def text(self, what: str) -> str:
        n = self.uint(8, f"the length of {what}")
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(what, f"is not UTF-8 text ({exc})") from exc

    def skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` strings (a string array: each is a u64 length and its bytes)."""
        unpack, buf, size, pos = struct.Struct(self.order + "Q").unpack_from, self.buf, self.size, self.pos
        for _ in range(count):
            if pos + 8 > size:
                break
            pos += 8 + unpack(buf, pos)[0]
        else:
            if pos <= size:
                self.pos = pos
                return
        raise self.fail(what, f"(an array of {count} strings) runs past the end of the file ({size} bytes)")


def check_header(path: Path) -> None:
    """Refuse, before gguf.GGUFReader parses ``path``, a header whose counts, lengths or tensor extents do not fit
    the file or exceed the limits above (MAX_ARRAY_LEN and the rest): the reader would allocate for whatever the
    header declares. Only the header is read, through a memory map."""
    from gguf import GGML_QUANT_SIZES

    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        h = _Cursor(buf, size, str(path))
        h.take(4, "the magic bytes")
        version = h.uint(4, "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine (gguf.GGUFReader's own test)
            h.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in (2, 3):
            raise GGUFError(f"GGUF file {str(path)!r} has version {version}; yirage (through the gguf package) reads "
                            "versions 2 and 3: re-convert the model with a current llama.cpp")
        tensors, keys = h.uint(8, "the tensor count"), h.uint(8, "the metadata key count")
        _check_limit(path, "tensor count", tensors, MAX_TENSORS, "a 126-layer Llama has about 1.1k tensors")
        _check_limit(path, "metadata key count", keys, MAX_KEYS, "real files have about 50 keys")
        alignment = _scan_metadata(h, keys)
        extents = [_scan_tensor_info(h, i, GGML_QUANT_SIZES) for i in range(tensors)]
        names = [e[0] for e in extents]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise h.fail(f"tensor {twice!r}", "appears twice")
        start = -(-h.pos // alignment) * alignment
        for name, offset, n_bytes, described in extents:
            if start + offset + n_bytes > size:
                raise h.fail(f"tensor {name!r} ({described})", f"declares {n_bytes} bytes at offset "
                             f"{start + offset}, past the end of the file ({size} bytes)")


def _check_limit(path: Path, what: str, value: int, limit: int, real: str) -> None:
    if value > limit:
        raise GGUFError(f"GGUF file {str(path)!r} declares a {what} of {value}, more than the {limit} yirage accepts "
                        f"({real}); reading it would take gigabytes of memory before anything could be checked. The "
                        "file is damaged or not a Llama-family model: re-convert it")


def _scan_metadata(h: _Cursor, count: int) -> int:
    """Step over ``count`` metadata entries, checking each against the file and the limits; the alignment."""
    seen: set[str] = set()
    elements, alignment = 0, 32
    for i in range(count):
        key = h.text(f"the name of metadata entry {i}")
        if key in seen:
            raise h.fail(f"metadata key {key!r}", "appears twice")
        seen.add(key)
        kind = h.uint(4, f"the type of metadata {key!r}")
        if kind == _ARRAY:
            sub, n = h.uint(4, f"the element type of metadata {key!r}"), h.uint(8, f"the length of metadata {key!r}")
            if n > MAX_ARRAY_LEN:
                raise GGUFError(f"GGUF metadata {key!r} is an array of {n} values, more than the {MAX_ARRAY_LEN} "
                                "yirage accepts (the largest real vocabularies have 262144 tokens): reading it "
                                "would take gigabytes of memory. The file is damaged or not a Llama-family model: "
                                "re-convert it")
            elements += n
            _check_limit(Path(h.name), "total of metadata array values", elements, MAX_METADATA_ELEMENTS,
                         "a real vocabulary's tokens, scores, types and merges stay under a million")
            if sub == _STRING:
                h.skip_strings(n, f"metadata {key!r}")
            elif sub in _VALUE_SIZES:
                h.take(n * _VALUE_SIZES[sub], f"metadata {key!r} (an array of {n} values)")
            else:
                raise h.fail(f"metadata {key!r}", f"is an array of type {sub} (arrays of arrays are not GGUF, and "
                             "other types are unknown)")
        elif kind == _STRING:
            h.take(h.uint(8, f"the length of metadata {key!r}"), f"metadata {key!r}")
        elif kind in _VALUE_SIZES:
            at = h.take(_VALUE_SIZES[kind], f"metadata {key!r}")
            if key == "general.alignment" and kind == _UINT32:
                alignment = struct.unpack_from(h.order + "I", h.buf, at)[0]
                if alignment < 1 or alignment & (alignment - 1):
                    raise h.fail(f"metadata general.alignment={alignment}", "is not a power of two")
        else:
            raise h.fail(f"metadata {key!r}", f"has the unknown value type {kind}")
    return alignment


def _scan_tensor_info(h: _Cursor, i: int, sizes: dict[Any, tuple[int, int]]) -> tuple[str, int, int, str]:
    """One tensor's entry: (name, data offset, bytes, a description), checked to describe a whole ggml tensor."""
    from gguf import GGMLQuantizationType

    name = h.text(f"the name of tensor {i}")
    n_dims = h.uint(4, f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise h.fail(f"tensor {name!r}", f"has {n_dims} dimensions (ggml tensors have 1 to {GGML_MAX_DIMS})")
    dims = [h.uint(8, f"the shape of tensor {name!r}") for _ in range(n_dims)]
    raw = h.uint(4, f"the type of tensor {name!r}")
    offset = h.uint(8, f"the data offset of tensor {name!r}")
    try:
        kind = GGMLQuantizationType(raw)
    except ValueError:
        raise h.fail(f"tensor {name!r}", f"has the unknown ggml type {raw}") from None
    block, type_size = sizes[kind]
    if dims[0] % block:
        raise h.fail(f"tensor {name!r} ({kind.name}, shape {dims})", f"has rows of {dims[0]} values, not whole "
                     f"{kind.name} blocks of {block}")
    return name, offset, math.prod(dims) // block * type_size, f"{kind.name}, shape {dims}"


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
        key = name.removeprefix("model.")
        stored = tuple(int(n) for n in reversed(tensor.shape))  # checked before dequantizing: nothing is made yet
        if key in shapes and stored != shapes[key]:
            raise GGUFError(f"GGUF tensor {tensor.name!r} has shape {stored} (rows, cols), but the metadata "
                            f"implies {shapes[key]} for {name}; the tensors and the metadata disagree: re-convert "
                            "the model")
        values = dequantize_tensor(tensor)
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
