"""GGUF export (yirage/models/gguf_export.py): files transformers and yirage's loader read back exactly.

The oracle is transformers: a tiny random Llama is exported, then loaded by
transformers' own GGUF reader (which undoes llama.cpp's q/k permutation
independently of yirage) and by ``read_gguf``; both must give the source
model's logits. Quantized files are checked against the block formats'
error bounds, computed from the source weights.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from yirage.errors import NotSupportedError  # noqa: E402
from yirage.models.downloads import DownloadError, smollm2_gguf  # noqa: E402
from yirage.models.gguf import metadata, open_gguf, read_gguf  # noqa: E402
from yirage.models.gguf_export import GGUFExportError, export_gguf  # noqa: E402

SYNTHETIC_VOCAB = 320


def _smollm2() -> object:
    try:
        return smollm2_gguf(download=False)
    except DownloadError:
        return None


SMOLLM2 = _smollm2()


def tiny_llama(vocab: int, tied: bool, hidden: int = 64, seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   tie_word_embeddings=tied, rope_theta=5000.0, rms_norm_eps=1e-5,
                                   max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a norm lost or mixed up shows in the logits
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model


def logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits[0]


CASES = [  # GGUFReader parses a 49152-token vocabulary in seconds: the real-vocab file is opened only once
    pytest.param(None, True, id="synthetic-vocab-tied"),
    pytest.param(None, False, id="synthetic-vocab-untied"),
    pytest.param(SMOLLM2, False, id="smollm2-vocab-untied",
                 marks=pytest.mark.skipif(SMOLLM2 is None, reason="SmolLM2 GGUF not downloaded")),
]


@pytest.mark.parametrize(("tokenizer", "tied"), CASES)
def test_f32_round_trip_matches_source_logits(tmp_path, tokenizer, tied):
    src = None if tokenizer is None else open_gguf(tokenizer)
    vocab = SYNTHETIC_VOCAB if src is None else len(metadata(src, "tokenizer.ggml.tokens"))
    source = tiny_llama(vocab, tied)
    want = logits(source, vocab)
    path = export_gguf(tmp_path / "m.gguf", source.config, source.state_dict(), "F32", tokenizer_from=tokenizer)

    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) is not tied
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    expected_meta = {"general.architecture": "llama", "llama.context_length": 512, "llama.embedding_length": 64,
                     "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.rope.dimension_count": 16,
                     "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.vocab_size": vocab,
                     "general.file_type": 0}
    assert {k: metadata(reader, k) for k in expected_meta} == expected_meta
    assert metadata(reader, "llama.rope.freq_base") == pytest.approx(5000.0)
    assert metadata(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert len(metadata(reader, "tokenizer.ggml.tokens")) == vocab
    if src is not None:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                    "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
            assert metadata(reader, key) == metadata(src, key), key

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    torch.testing.assert_close(logits(hf, vocab), want, rtol=0, atol=1e-5)
    if src is not None:
        return  # yirage's loader on the same tensors is covered by the synthetic-vocab cases (each open costs ~2 s)

    config, weights, info = read_gguf(path)
    assert (info.bos_token_id, info.eos_token_id) == (source.config.bos_token_id, (source.config.eos_token_id,))
    assert (config.hidden, config.intermediate, config.layers, config.heads, config.kv_heads, config.head_dim,
            config.vocab, config.tie_embeddings) == (64, 128, 2, 4, 2, 16, vocab, tied)
    again = transformers.LlamaForCausalLM(source.config).eval()
    missing, unexpected = again.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    again.tie_weights()
    torch.testing.assert_close(logits(again, vocab), want, rtol=0, atol=1e-5)


def test_head_dim_other_than_hidden_over_heads(tmp_path):
    """llama.cpp assumes head_dim = hidden / heads unless attention.key_length says otherwise."""
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, vocab_size=SYNTHETIC_VOCAB)
    source = transformers.LlamaForCausalLM(cfg).eval()
    path = export_gguf(tmp_path / "m.gguf", cfg, source.state_dict(), "F32")
    reader = open_gguf(path)
    assert [metadata(reader, f"llama.{k}") for k in ("attention.key_length", "attention.value_length",
                                                      "rope.dimension_count")] == [32, 32, 32]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    torch.testing.assert_close(logits(hf, SYNTHETIC_VOCAB), logits(source, SYNTHETIC_VOCAB), rtol=0, atol=1e-5)
    config, weights, _ = read_gguf(path)
    assert config.head_dim == 32
    assert all(torch.equal(weights[k], v) for k, v in source.state_dict().items())


def _block_error_bound(w: torch.Tensor, levels: float, steps: float) -> torch.Tensor:
    """Per-value bound for a 32-value block format: ``steps`` steps of block absmax / levels, plus f16 scale rounding.

    Q8_0 rounds to the nearest of +-127 steps (half a step); Q4_0 maps the signed absmax to -8 and clips the other
    side at +7, so a value near -absmax is off by up to one whole step.
    """
    blocks = w.reshape(*w.shape[:-1], -1, 32).abs().amax(-1, keepdim=True)
    step = blocks / levels
    return (step * (steps + levels * 2.0**-10) + 1e-7).expand(*blocks.shape[:-1], 32).reshape(w.shape)


@pytest.mark.parametrize(("dtype", "levels", "steps"), [("Q8_0", 127.0, 0.5), ("Q4_0", 8.0, 1.0)])
def test_quantized_round_trip_within_block_error(tmp_path, dtype, levels, steps):
    source = tiny_llama(SYNTHETIC_VOCAB, tied=False, seed=3)
    path = export_gguf(tmp_path / "m.gguf", source.config, source.state_dict(), dtype)
    reader = open_gguf(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {k for k, v in kinds.items() if v == "F32"} == {n for n in kinds if n.endswith("norm.weight")}
    assert {v for k, v in kinds.items() if not k.endswith("norm.weight")} == {dtype}
    _, weights, _ = read_gguf(path)
    state = source.state_dict()
    assert set(weights) == set(state)
    for name, w in state.items():
        got = weights[name]
        if w.ndim == 1:
            assert torch.equal(got, w), name
        else:
            err = (got - w).abs()
            assert bool((err <= _block_error_bound(w, levels, steps)).all()), f"{name}: max error {err.max():.3g}"
            assert err.max() > 0, name  # really quantized


@pytest.mark.parametrize(("dtype", "rel"), [("BF16", 2.0**-8), ("F16", 2.0**-11)])
def test_half_round_trip_within_rounding(tmp_path, dtype, rel):
    source = tiny_llama(SYNTHETIC_VOCAB, tied=True, seed=4)
    path = export_gguf(tmp_path / "m.gguf", source.config, source.state_dict(), dtype)
    assert metadata(open_gguf(path), "general.file_type") == {"BF16": 32, "F16": 1}[dtype]
    _, weights, _ = read_gguf(path)
    for name, w in source.state_dict().items():
        if name == "lm_head.weight":
            continue
        torch.testing.assert_close(weights[name], w, rtol=rel, atol=1e-7, msg=name)  # atol: f16 subnormals


def test_accepts_a_read_gguf_state_dict(tmp_path):
    """What the benchmark does: re-type a model read by the loader (yirage config, HF names)."""
    source = tiny_llama(SYNTHETIC_VOCAB, tied=True, seed=5)
    first = export_gguf(tmp_path / "a.gguf", source.config, source.state_dict(), "F32")
    config, weights, _ = read_gguf(first)
    second = export_gguf(tmp_path / "b.gguf", config, weights, "F32", tokenizer_from=first)
    _, again, _ = read_gguf(second)
    assert set(again) == set(weights) and all(torch.equal(again[k], weights[k]) for k in weights)
    assert metadata(open_gguf(second), "tokenizer.ggml.tokens") == metadata(open_gguf(first), "tokenizer.ggml.tokens")


def test_errors_name_cause_and_fix(tmp_path):
    source = tiny_llama(SYNTHETIC_VOCAB, tied=False, seed=6)
    state = source.state_dict()
    out = tmp_path / "m.gguf"
    with pytest.raises(GGUFExportError, match=r"Q4_1.*one of F32, BF16, F16, Q8_0, Q4_0"):
        export_gguf(out, source.config, state, "Q4_1")
    odd = tiny_llama(SYNTHETIC_VOCAB, tied=False, hidden=48, seed=6)  # rows of 48: not whole blocks of 32
    with pytest.raises(GGUFExportError, match=r"token_embd\.weight.*48.*block of 32.*F32, F16 or BF16"):
        export_gguf(out, odd.config, odd.state_dict(), "Q8_0")
    assert export_gguf(out, odd.config, odd.state_dict(), "F16").is_file()  # the fix the message gives works

    other = export_gguf(tmp_path / "other.gguf", tiny_llama(SYNTHETIC_VOCAB + 1, True).config,
                        tiny_llama(SYNTHETIC_VOCAB + 1, True).state_dict(), "F32")
    with pytest.raises(GGUFExportError, match=rf"{SYNTHETIC_VOCAB + 1} tokens.*vocab_size is {SYNTHETIC_VOCAB}"):
        export_gguf(out, source.config, state, "F32", tokenizer_from=other)

    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.down_proj.weight"}
    with pytest.raises(GGUFExportError, match=r"lacks 'layers\.1\.mlp\.down_proj\.weight'"):
        export_gguf(out, source.config, missing, "F32")
    with pytest.raises(GGUFExportError, match=r"lacks .lm_head\.weight.*pass the full state dict"):
        export_gguf(out, source.config, {k: v for k, v in state.items() if k != "lm_head.weight"}, "F32")
    bad_shape = dict(state, **{"model.norm.weight": torch.ones(63)})
    with pytest.raises(GGUFExportError, match=r"model\.norm\.weight.*\(63,\).*\(64,\)"):
        export_gguf(out, source.config, bad_shape, "F32")
    tied_cfg = transformers.LlamaConfig(**dict(source.config.to_dict(), tie_word_embeddings=True))
    with pytest.raises(GGUFExportError, match=r"tie_word_embeddings=True but lm_head\.weight differs"):
        export_gguf(out, tied_cfg, state, "F32")
    qwen = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=SYNTHETIC_VOCAB)
    with pytest.raises(NotSupportedError, match=r"'qwen2'.*Llama or Mistral"):
        export_gguf(out, qwen, state, "F32")
    with pytest.raises(GGUFExportError, match=r"directory does not exist"):
        export_gguf(tmp_path / "no" / "m.gguf", source.config, state, "F32")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".part")) == []  # no partial files left
