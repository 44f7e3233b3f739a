"""GGUF loading (yirage/models/gguf.py), checked against transformers loading the same file.

Small random Llama and Qwen2 models are written here with ``gguf.GGUFWriter``
the way llama.cpp's convert_hf_to_gguf.py writes them (llama.cpp tensor names,
``<arch>.*`` metadata, q/k rows permuted for ``llama``), in F32/F16/BF16 and
every quantized type gguf-py can quantize that yirage reads. The oracle is
transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``): the
dequantized weights must be equal, and greedy decoding must give the same
tokens and per-step logits. Q4_K and Q6_K, which gguf-py can only dequantize,
are checked against a block decoder written here from ggml's C code
(dequantize_row_q4_K / _q6_K) and a block whose values are worked out by hand.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from yirage.engine import GenerationConfig, InferEngine
from yirage.errors import NotSupportedError
from yirage.models.config import ModelError
from yirage.models.gguf import GGUFError, dequantize_tensor, open_gguf, read_gguf
from yirage.models.llama import LlamaModel

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
SEED = 1234
NEW_TOKENS = 16
WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # gguf-py quantizes these; yirage reads them
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
# byte-level BPE tokens for the 256 bytes, spelled as GPT-2 spells them (what convert_hf_to_gguf stores)
_BYTES = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_TOKENS = [chr(b) if b in _BYTES else chr(256 + [x for x in range(256) if x not in _BYTES].index(b))
               for b in range(256)]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


# -- writing GGUF files as llama.cpp does ---------------------------------------------------------------
def random_hf_model(kind: str, seed: int = SEED, **overrides) -> torch.nn.Module:
    """A tiny model whose weights are scaled up (std 0.5) so that greedy output is diverse."""
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    conf = (transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config)(
        **{**TINY, "rope_theta": 10000.0, **overrides})
    model = cls(conf).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 if p.dim() == 2 else 0.2)
    return model


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (q with n_head, k with n_head_kv)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_tensors(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    c, out = model.config, {}
    for name, t in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        if name.startswith("model.layers."):
            layer, part = base.removeprefix("model.layers.").split(".", 1)
            key = f"blk.{layer}.{GGUF_NAMES[part]}.{suffix}"
        else:
            key = f"{GGUF_NAMES[base]}.{suffix}"
        a = t.detach().float().numpy()
        if arch == "llama" and (".attn_q." in key or ".attn_k." in key):
            a = llama_cpp_permute(a, c.num_attention_heads if ".attn_q." in key else c.num_key_value_heads)
        out[key] = a
    if c.tie_word_embeddings:
        out.pop("output.weight", None)
    return out


def add_tensor(writer, name: str, a: np.ndarray, qtype: str) -> None:
    """Matrices in ``qtype``; 1-D tensors (norms, biases) stay F32 as in llama.cpp."""
    if a.ndim == 1 or qtype == "F32":
        writer.add_tensor(name, a.astype(np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, a.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), Q[qtype]), raw_dtype=Q[qtype])


def write_gguf(path: Path, model: torch.nn.Module, arch: str = "llama", qtype: str = "F32", *,
               tokenizer: bool = False, chat_template: str | None = None, metadata=None, tensors=None) -> Path:
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(BYTE_TOKENS[:c.vocab_size])
        w.add_token_types([1] * c.vocab_size)
        w.add_token_merges([])
        w.add_token_scores([0.0] * c.vocab_size)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    if chat_template:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        w.add_key_value(key, value[0], value[1])
    for name, a in (gguf_tensors(model, arch) if tensors is None else tensors).items():
        add_tensor(w, name, a, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path: Path, dtype=torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=dtype).eval()


# -- the comparison every decode test uses ------------------------------------------------------------------
def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy tokens (B, n) and the float32 logits (B, n, vocab) each was picked from."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1).float()


def assert_decode_matches(result, tokens: torch.Tensor, logits: torch.Tensor, rel: float, what: str) -> None:
    """Identical tokens, and every step's logits within ``rel`` x that step's logit range (per row)."""
    assert torch.equal(result.tokens, tokens), (
        f"{what}: tokens differ from transformers\n yirage: {result.tokens.tolist()}\n    hf: {tokens.tolist()}")
    got = result.logits
    assert got.shape == logits.shape, f"{what}: logits shape {tuple(got.shape)} != {tuple(logits.shape)}"
    err = (got - logits).abs().amax(-1)  # (B, n)
    span = logits.amax(-1) - logits.amin(-1)
    worst = (err / span).max()
    assert bool((err <= rel * span).all()), (
        f"{what}: per-step logits differ from transformers by up to {float(worst):.3g} x the logit range "
        f"(allowed {rel}); step errors {err.tolist()}")


def distinct_fraction(tokens: torch.Tensor) -> float:
    return min(len(set(row.tolist())) / len(row) for row in tokens)


# -- weights: yirage's dequantized GGUF == transformers' --------------------------------------------------
@pytest.fixture(scope="module")
def llama_model() -> torch.nn.Module:
    return random_hf_model("llama")


@pytest.mark.parametrize("qtype", WRITABLE)
def test_weights_match_transformers_gguf_loader(tmp_path, llama_model, qtype) -> None:
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", llama_model, "llama", qtype)
    config, weights, info = read_gguf(path)
    assert info.tensor_types.get(qtype if qtype != "F32" else "F32", 0) >= 1
    expected = hf_from_gguf(path).state_dict()
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), f"{qtype}: {name} differs from transformers' dequantization"
    if qtype == "F32":  # lossless: the permutation is undone exactly, back to the HF checkpoint
        for name, tensor in llama_model.state_dict().items():
            assert torch.equal(weights[name], tensor), name
    assert (config.hidden, config.heads, config.kv_heads, config.layers, config.vocab) == (64, 4, 2, 2, 256)


def test_requested_dtype_rounds_the_dequantized_weights(tmp_path, llama_model) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", llama_model, "llama", "Q8_0")
    f32 = read_gguf(path)[1]
    bf16 = read_gguf(path, torch.bfloat16)[1]
    for name, t in bf16.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, f32[name].to(torch.bfloat16)), name


# -- decoding: tokens and per-step logits vs transformers on the same file ---------------------------------
@pytest.mark.parametrize("kind, qtype", [("llama", "Q4_1"), ("qwen2", "F16")])
def test_generation_matches_transformers_on_the_same_gguf(tmp_path, kind, qtype) -> None:
    model = random_hf_model(kind, tie_word_embeddings=kind == "qwen2")
    path = write_gguf(tmp_path / f"{kind}.gguf", model, kind, qtype)
    oracle = hf_from_gguf(path)
    ids = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(SEED))
    tokens, logits = hf_greedy(oracle, ids, NEW_TOKENS)
    assert distinct_fraction(tokens) >= 0.5, f"seed {SEED}: transformers' greedy output is not diverse: {tokens}"
    engine = InferEngine(str(path), backend="reference")
    assert engine.model.gguf.architecture == kind and engine.config.qkv_bias == (kind == "qwen2")
    result = engine.generate(ids, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=(), output_logits=True))
    assert_decode_matches(result, tokens, logits, 1e-3, f"{kind} {qtype} seed {SEED}")


def test_the_same_check_fails_without_undoing_the_permutation(tmp_path, llama_model, monkeypatch) -> None:
    """Ablation: loading the q/k rows as stored (RoPE pairs interleaved) must fail the comparison above."""
    path = write_gguf(tmp_path / "tiny.gguf", llama_model, "llama", "F32")
    ids = torch.randint(0, TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(SEED))
    tokens, logits = hf_greedy(hf_from_gguf(path), ids, NEW_TOKENS)
    monkeypatch.setattr("yirage.models.gguf.PERMUTED_QK", ())
    broken = InferEngine(path, backend="reference")
    result = broken.generate(ids, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=(), output_logits=True))
    with pytest.raises(AssertionError, match="differ from transformers"):
        assert_decode_matches(result, tokens, logits, 1e-3, "llama without unpermuting q/k")


def test_chat_messages_use_the_files_template_and_tokenizer(tmp_path, llama_model) -> None:
    path = write_gguf(tmp_path / "chat.gguf", llama_model, "llama", "F32", tokenizer=True,
                      chat_template=CHAT_TEMPLATE)
    engine = InferEngine(path, backend="reference")
    messages = [{"role": "user", "content": "Hi!"}]
    ids = engine.apply_chat_template(messages)
    assert ids.tolist() == [list(b"<user>Hi!\n<assistant>")]  # byte-level vocabulary: token id == byte
    config = GenerationConfig(max_new_tokens=4, eos_token_id=(), output_logits=True)
    result = engine.generate(messages=messages, config=config)
    tokens, logits = hf_greedy(hf_from_gguf(path), ids, 4)
    assert_decode_matches(result, tokens, logits, 1e-3, "chat prompt")
    assert result.text == [bytes(tokens[0].tolist()).decode("utf-8", "replace")]
    assert engine.config.eos_token_id == (2,) and engine.config.bos_token_id == 1
    with pytest.raises(ModelError, match="exactly one prompt"):
        engine.generate(ids, config, messages=messages)
    with pytest.raises(ModelError, match=r"messages must be a conversation"):
        engine.generate(messages=[{"role": "user"}], config=config)


def test_messages_need_a_template_and_a_tokenizer(tmp_path, llama_model) -> None:
    no_template = InferEngine(write_gguf(tmp_path / "a.gguf", llama_model, tokenizer=True), backend="reference")
    with pytest.raises(ModelError, match="needs a chat template, but this model's tokenizer has none"):
        no_template.generate(messages=[{"role": "user", "content": "Hi"}])
    no_tokenizer = InferEngine(write_gguf(tmp_path / "b.gguf", llama_model), backend="reference")
    assert no_tokenizer.tokenizer is None
    with pytest.raises(ModelError, match="needs the model's tokenizer, but the GGUF file .* has no tokenizer"):
        no_tokenizer.generate(messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(ModelError, match="a text prompt needs the model's tokenizer"):
        no_tokenizer.generate("Hi")


# -- Q4_K / Q6_K: gguf-py only dequantizes them; check it against ggml's C code, rewritten here ----------
def _f16(x: bytes) -> float:
    return struct.unpack("<e", x)[0]


def ggml_dequantize_q4_k(block: bytes) -> list[float]:
    """dequantize_row_q4_K for one 144-byte block (ggml-quants.c), loop for loop."""
    d, dmin, scales, q = _f16(block[0:2]), _f16(block[2:4]), block[4:16], block[16:144]

    def scale_min(j: int) -> tuple[int, int]:  # get_scale_min_k4
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    y, off = [], 0
    for j in range(0, 256, 64):
        sc, m = scale_min(j // 32)
        d1, m1 = d * sc, dmin * m
        sc, m = scale_min(j // 32 + 1)
        d2, m2 = d * sc, dmin * m
        y += [d1 * (q[off + v] & 0xF) - m1 for v in range(32)]
        y += [d2 * (q[off + v] >> 4) - m2 for v in range(32)]
        off += 32
    return y


def ggml_dequantize_q6_k(block: bytes) -> list[float]:
    """dequantize_row_q6_K for one 210-byte block (ggml-quants.c), loop for loop."""
    ql, qh = block[0:128], block[128:192]
    sc = struct.unpack("<16b", block[192:208])
    d = _f16(block[208:210])
    y = [0.0] * 256
    for n in range(2):
        yo, lo, ho, so = 128 * n, 64 * n, 32 * n, 8 * n
        for v in range(32):
            s = v // 16
            q1 = ((ql[lo + v] & 0xF) | (((qh[ho + v] >> 0) & 3) << 4)) - 32
            q2 = ((ql[lo + v + 32] & 0xF) | (((qh[ho + v] >> 2) & 3) << 4)) - 32
            q3 = ((ql[lo + v] >> 4) | (((qh[ho + v] >> 4) & 3) << 4)) - 32
            q4 = ((ql[lo + v + 32] >> 4) | (((qh[ho + v] >> 6) & 3) << 4)) - 32
            y[yo + v] = d * sc[so + s] * q1
            y[yo + v + 32] = d * sc[so + s + 2] * q2
            y[yo + v + 64] = d * sc[so + s + 4] * q3
            y[yo + v + 96] = d * sc[so + s + 6] * q4
    return y


def random_k_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random quantized bytes with finite, small fp16 scales, as (rows, bytes) uint8."""
    size = {"Q4_K": 144, "Q6_K": 210}[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.02, size=(rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q4_K":
        data[..., 0:4] = scale.reshape(rows, cols // 256, 4)  # d and dmin
    else:
        data[..., 208:210] = scale[..., :2]
    return data.reshape(rows, -1)


def test_hand_worked_k_quant_blocks() -> None:
    """Blocks whose values follow directly from the format, so the rewritten decoders are anchored too."""
    # Q4_K: d=1, dmin=0.5; sub-block scales 3 and mins 1 (j < 4 store them in the low 6 bits of bytes j, j+4),
    # and for j >= 4 scale 5 / min 2 in the nibbles of bytes 8..11; every quant is 0x21 (low 1, high 2)
    q4 = struct.pack("<ee", 1.0, 0.5) + bytes([3] * 4 + [1] * 4 + [0x25] * 4) + bytes([0x21] * 128)
    want = [3 * 1 - 0.5] * 32 + [3 * 2 - 0.5] * 32 + [3 - 0.5] * 32 + [6 - 0.5] * 32
    want += [5 * 1 - 1.0] * 32 + [5 * 2 - 1.0] * 32 + [5 - 1.0] * 32 + [10 - 1.0] * 32
    assert ggml_dequantize_q4_k(q4) == want
    # Q6_K: d=0.5, all scales 2; ql nibbles 1, qh 0 -> q = 1 - 32 = -31 -> 0.5 * 2 * -31 = -31
    q6 = bytes([0x11] * 128) + bytes(64) + bytes([2] * 16) + struct.pack("<e", 0.5)
    assert ggml_dequantize_q6_k(q6) == [-31.0] * 256
    for qtype, block, expect in (("Q4_K", q4, want), ("Q6_K", q6, [-31.0] * 256)):
        got = gguf.quants.dequantize(np.frombuffer(block, np.uint8).reshape(1, -1), Q[qtype])
        assert got.ravel().tolist() == expect, qtype


@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K"))
def test_k_quant_tensors_match_ggml_and_transformers(tmp_path, qtype) -> None:
    model = random_hf_model("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=1)
    tensors = gguf_tensors(model, "llama")
    path = tmp_path / f"k-{qtype}.gguf"
    raw = {}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 128), ("embedding_length", 256), ("block_count", 1),
                       ("feed_forward_length", 256), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("vocab_size", 256)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for i, (name, a) in enumerate(tensors.items()):
        if a.ndim == 2:
            raw[name] = random_k_blocks(qtype, a.shape[0], a.shape[1], SEED + i)
            w.add_tensor(name, raw[name], raw_dtype=Q[qtype])
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = open_gguf(path)
    decode = ggml_dequantize_q4_k if qtype == "Q4_K" else ggml_dequantize_q6_k
    size = 144 if qtype == "Q4_K" else 210
    for tensor in reader.tensors:
        if tensor.name in raw:
            rows = raw[tensor.name]
            want = np.array([[x for b in range(0, rows.shape[1], size) for x in decode(bytes(r[b:b + size]))]
                             for r in rows[:3]], dtype=np.float32)  # the first rows: the loops are slow
            got = dequantize_tensor(tensor)
            assert got.shape == (rows.shape[0], rows.shape[1] // size * 256)
            np.testing.assert_allclose(got[:3], want, rtol=1e-6, atol=1e-7, err_msg=f"{tensor.name} seed {SEED}")
    weights = read_gguf(path)[1]
    expected = hf_from_gguf(path).state_dict()
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), f"{qtype}: {name} differs from transformers"


# -- the header reader (yirage.models.gguf_file) against gguf.GGUFReader ------------------------------------------
VALUES = [("t.u8", 7, "UINT8"), ("t.i8", -7, "INT8"), ("t.u16", 65535, "UINT16"), ("t.i16", -300, "INT16"),
          ("t.u32", 4_000_000_000, "UINT32"), ("t.i32", -2**31, "INT32"), ("t.f32", 0.1, "FLOAT32"),
          ("t.bool", True, "BOOL"), ("t.u64", 2**64 - 1, "UINT64"), ("t.i64", -2**63, "INT64"),
          ("t.f64", 0.1, "FLOAT64"), ("t.str", "ünïcödé 中文", "STRING"), ("t.empty", "", "STRING")]


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_the_header_reader_reads_what_gguf_reader_reads(tmp_path, llama_model, endian) -> None:
    from yirage.models.gguf_file import read_file

    path = tmp_path / f"{endian}.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian[endian])
    for key, value, kind in VALUES:
        w.add_key_value(key, value, gguf.GGUFValueType[kind])
    w.add_key_value("t.ints", [1, -2, 3], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_key_value("t.floats", [0.5, -1e-3], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
    w.add_token_list(BYTE_TOKENS)
    w.add_token_merges(["a b", "ü 中"])
    rng = np.random.default_rng(SEED)
    values = {}  # each tensor's values, dequantized by gguf from the native-order data written
    for qtype in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"):
        a = rng.standard_normal((8, 64)).astype(np.float32)
        data = a.astype(np.float16) if qtype == "F16" else a if qtype == "F32" else gguf.quants.quantize(a, Q[qtype])
        values[f"w.{qtype}"] = gguf.quants.dequantize(data, Q[qtype])
        w.add_tensor(f"w.{qtype}", data.copy(), raw_dtype=None if qtype in ("F32", "F16") else Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = read_file(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        want = theirs.fields[key]
        assert field.types == want.types, key
        got, expected = field.contents(), want.contents()
        assert got == expected and type(got) is type(expected), key
        if isinstance(got, list):
            assert len(field.data) == len(want.data) and {type(x) for x in got} == {type(x) for x in expected}, key
    assert ours.fields["t.str"].contents() == "ünïcödé 中文" and ours.fields["t.u64"].contents() == 2**64 - 1
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for t, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert t.tensor_type == want.tensor_type and t.shape == tuple(int(n) for n in want.shape), t.name
        assert t.data.dtype == want.data.dtype and t.data.shape == want.data.shape, t.name
        assert np.array_equal(t.data, want.data), t.name
        assert np.array_equal(dequantize_tensor(t), values[t.name]), t.name  # big-endian floats too


# -- clear errors -------------------------------------------------------------------------------------------
def test_a_file_that_is_not_gguf_is_refused(tmp_path, llama_model) -> None:
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(GGUFError, match="is not a GGUF file .*does not start with the bytes 'GGUF'"):
        InferEngine(junk, backend="reference")
    with pytest.raises(GGUFError, match="does not exist: pass the path of a .gguf model file"):
        LlamaModel.from_gguf(tmp_path / "missing.gguf")
    good = write_gguf(tmp_path / "good.gguf", llama_model)
    torn = tmp_path / "torn.gguf"
    torn.write_bytes(good.read_bytes()[:2000])
    with pytest.raises(GGUFError, match="cannot be parsed .*truncated or corrupt"):
        LlamaModel.from_gguf(torn)


def test_unsupported_architecture_type_and_tensors_are_named(tmp_path, llama_model) -> None:
    tensors = gguf_tensors(llama_model, "llama")
    with pytest.raises(NotSupportedError, match="GGUF architecture 'gpt2' is not supported"):
        LlamaModel.from_gguf(write_gguf(tmp_path / "a.gguf", llama_model, "gpt2"))
    with pytest.raises(NotSupportedError, match="'token_embd.weight' has type Q5_0.*re-quantize"):
        LlamaModel.from_gguf(write_gguf(tmp_path / "b.gguf", llama_model, qtype="Q5_0"))
    extra = {**tensors, "blk.0.attn_q_norm.weight": np.ones(16, np.float32)}
    with pytest.raises(NotSupportedError, match="'blk.0.attn_q_norm.weight' has no counterpart"):
        LlamaModel.from_gguf(write_gguf(tmp_path / "c.gguf", llama_model, tensors=extra))
    biased = {**tensors, "blk.0.attn_output.bias": np.zeros(64, np.float32)}
    with pytest.raises(NotSupportedError, match="'blk.0.attn_output.bias': biases are not supported for llama"):
        LlamaModel.from_gguf(write_gguf(tmp_path / "d.gguf", llama_model, tensors=biased))
    scaled = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING)}
    with pytest.raises(NotSupportedError, match="rope.scaling.type='linear'"):
        LlamaModel.from_gguf(write_gguf(tmp_path / "e.gguf", llama_model, metadata=scaled))


def test_missing_and_misshapen_tensors_are_named(tmp_path, llama_model) -> None:
    tensors = gguf_tensors(llama_model, "llama")
    missing = {k: v for k, v in tensors.items() if k != "blk.1.ffn_down.weight"}
    with pytest.raises(GGUFError, match=r"lacks tensor 'blk.1.ffn_down.weight' \(HF layers.1.mlp.down_proj"):
        LlamaModel.from_gguf(write_gguf(tmp_path / "a.gguf", llama_model, tensors=missing))
    bad = {**tensors, "blk.0.attn_k.weight": tensors["blk.0.attn_k.weight"][:16]}
    with pytest.raises(GGUFError, match=r"'blk.0.attn_k.weight' has shape \(16, 64\).*implies \(32, 64\)"):
        LlamaModel.from_gguf(write_gguf(tmp_path / "b.gguf", llama_model, tensors=bad))
