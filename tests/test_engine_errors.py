"""InferEngine / model-loader input errors (issue 7, item 11): each names the cause and the fix.

Where an input is accepted instead of refused (token-id lists, dtype names,
prompts past max_position_embeddings), the result is checked against
Hugging Face transformers on the same weights.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings

import pytest
import torch

from yirage.engine import GenerationConfig, InferEngine
from yirage.errors import NotSupportedError
from yirage.models.config import ModelError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama (vocab 256, trained length 16) and its transformers twin."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(4)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=16, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def engine(tiny):
    return InferEngine(tiny[0], backend="reference")


def variant(tiny, tmp_path, edit):
    shutil.copytree(tiny[0], tmp_path / "m")
    cfg = tmp_path / "m" / "config.json"
    cfg.write_text(json.dumps(edit(json.loads(cfg.read_text()))))
    return tmp_path / "m"


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("edit, message", [
    (lambda c: [c], "must hold a JSON object"),
    (lambda c: {**{k: v for k, v in c.items() if k != "head_dim"}, "num_attention_heads": 3,
                "num_key_value_heads": 1}, "hidden_size=64 does not split into num_attention_heads=3"),
    (lambda c: {**c, "num_attention_heads": 2, "num_key_value_heads": 1},  # head_dim given: shapes disagree
     r"'layers.0.self_attn.q_proj.weight' has shape \(64, 64\), but config.json implies \(32, 64\)"),
    (lambda c: {**c, "num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (lambda c: {**c, "num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive int.*at least one decoder"),
    (lambda c: {**c, "vocab_size": "256"}, "vocab_size='256' must be a positive int"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "no 'hidden_size'"),
])
def test_bad_config_json_is_refused_clearly(tiny, tmp_path, edit, message) -> None:
    with pytest.raises(ModelError, match=message):
        InferEngine(variant(tiny, tmp_path, edit), backend="reference")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
    ({"max_new_tokens": True}, "max_new_tokens must be an int"),
    ({"seed": 2**70}, r"seed must be an int in \[0, 2\*\*32\)"),
    ({"seed": -1}, "seed must be an int"),
    ({"seed": 1.0}, "seed must be an int"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"temperature": "0.7"}, "temperature must be a finite number"),
    ({"top_k": 1.5}, "top_k must be an int"),
    ({"top_p": math.nan}, "top_p must be a number in"),
    ({"eos_token_id": "2"}, "eos_token_id must be None"),
    ({"eos_token_id": (2, 2.5)}, "eos_token_id must be None"),
])
def test_generation_config_validates_types_and_ranges(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)


def test_generation_config_normalizes_eos_lists() -> None:
    assert GenerationConfig(eos_token_id=[2, 3]).eos_token_id == (2, 3)
    assert GenerationConfig(seed=2**32 - 1, max_new_tokens=1).seed == 2**32 - 1


def test_empty_and_malformed_prompts_are_refused(engine) -> None:
    with pytest.raises(ModelError, match="prompt is empty"):
        engine.generate(torch.zeros(1, 0, dtype=torch.int64), GenerationConfig(max_new_tokens=2))
    with pytest.raises(ModelError, match="prompt is empty"):
        engine.generate(torch.zeros(0, 3, dtype=torch.int64), GenerationConfig(max_new_tokens=2))
    with pytest.raises(ModelError, match="equal-length rows"):
        engine.generate([[1, 2], [3]], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ModelError, match="equal-length rows"):
        engine.generate([[1, 2.5]], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ModelError, match=r"unsqueeze\(0\)"):
        engine.generate(torch.tensor([1, 2, 3]), GenerationConfig(max_new_tokens=2))
    with pytest.raises(ModelError, match=r"\[0, vocab_size=256\)"):
        engine.generate([[1, 256]], GenerationConfig(max_new_tokens=2))


def test_token_id_lists_are_accepted_as_prompts(tiny, engine) -> None:
    _, model = tiny
    ids = torch.tensor([[5, 17, 99], [200, 3, 41]])
    expected = hf_greedy(model, ids, 5)
    config = GenerationConfig(max_new_tokens=5, eos_token_id=())
    assert engine.generate(ids.tolist(), config).tokens.tolist() == expected.tolist()
    assert engine.generate([5, 17, 99], config).tokens.tolist() == expected[:1].tolist()


def test_dtype_names_are_accepted_and_bad_ones_refused(tiny) -> None:
    path, _ = tiny
    for name, dtype in (("float16", torch.float16), ("torch.bfloat16", torch.bfloat16), ("float32", torch.float32)):
        assert InferEngine(path, backend="reference", dtype=name).model.blocks[0]["qkv"].dtype == dtype
    for bad in ("int8", "fp17", torch.int64, 16):
        with pytest.raises(ModelError, match="dtype=.*not supported.*float32, bfloat16, float16"):
            InferEngine(path, backend="reference", dtype=bad)


def test_a_prompt_past_max_position_embeddings_warns_and_stays_correct(tiny, engine) -> None:
    _, model = tiny
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(7))
    config = GenerationConfig(max_new_tokens=4, eos_token_id=())
    with pytest.warns(UserWarning, match=r"exceeds the model's max_position_embeddings \(16\)"):
        got = engine.generate(ids, config).tokens
    assert got.tolist() == hf_greedy(model, ids, 4).tolist()  # RoPE tables cover every cache position
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(ids[:, :8], config)  # within the trained length: no warning


# -- follow-ups from a hostile-user review: silent wrong numbers and unclear errors in the loader ------------


@pytest.mark.parametrize("edit, error, message", [
    (lambda c: {**c, "hidden_act": "gelu"}, NotSupportedError, r"config.json: hidden_act='gelu' is not supported"),
    (lambda c: {**c, "rope_theta": -1.0}, ModelError, r"config.json: rope_theta=-1.0 must be a finite number > 0"),
    (lambda c: {**c, "rope_theta": math.nan}, ModelError, r"config.json: rope_theta=nan must be a finite number"),
    (lambda c: {**c, "rope_theta": "10000"}, ModelError, r"config.json: rope_theta='10000' must be a finite number"),
    (lambda c: {**c, "rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}}, ModelError,
     r"config.json: rope_parameters.rope_theta=-1.0 must be a finite number > 0"),
    (lambda c: {**c, "rope_parameters": {"rope_theta": 0, "rope_type": "default"}}, ModelError,
     r"rope_parameters.rope_theta=0 must be a finite number > 0"),
    (lambda c: {**c, "rms_norm_eps": math.nan}, ModelError, r"config.json: rms_norm_eps=nan must be a finite number"),
    (lambda c: {**c, "rms_norm_eps": -1e-6}, ModelError, r"config.json: rms_norm_eps=-1e-06 must be a finite number"),
])
def test_settings_that_would_give_wrong_numbers_are_refused(tiny, tmp_path, edit, error, message) -> None:
    with pytest.raises(error, match=message):
        InferEngine(variant(tiny, tmp_path, edit), backend="reference")


def test_swish_is_silu_and_accepted(tiny, tmp_path) -> None:
    _, model = tiny
    ids = torch.tensor([[5, 17, 99]])
    engine = InferEngine(variant(tiny, tmp_path, lambda c: {**c, "hidden_act": "swish"}), backend="reference")
    got = engine.generate(ids, GenerationConfig(max_new_tokens=4, eos_token_id=())).tokens
    assert got.tolist() == hf_greedy(model, ids, 4).tolist()


def test_checkpoint_layers_past_num_hidden_layers_are_named_in_a_warning(tiny, tmp_path) -> None:
    path = variant(tiny, tmp_path, lambda c: {**c, "num_hidden_layers": 1})
    with pytest.warns(UserWarning, match=r"num_hidden_layers=1 does not use: layers\.1\.\*\. They are ignored"):
        engine = InferEngine(path, backend="reference")
    ids = torch.tensor([[5, 17, 99]])
    oracle = transformers.LlamaForCausalLM.from_pretrained(path).eval()  # transformers ignores them too
    got = engine.generate(ids, GenerationConfig(max_new_tokens=4, eos_token_id=())).tokens
    assert got.tolist() == hf_greedy(oracle, ids, 4).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        InferEngine(tiny[0], backend="reference")  # every layer used: no warning


def test_a_model_path_that_is_missing_or_a_file_is_refused_with_the_fix(tiny, tmp_path) -> None:
    with pytest.raises(ModelError, match=r"model path '.*nope' does not exist: pass the directory"):
        InferEngine(tmp_path / "nope", backend="reference")
    with pytest.raises(ModelError, match=r"is a file, not a directory: pass the directory .*perhaps"):
        InferEngine(tiny[0] / "config.json", backend="reference")


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(engine) -> None:
    import psutil

    available = psutil.virtual_memory().available / 2**30
    need = 2 * 2 * 1 * 2 * (2 + 10**9 + 1) * 16 * 4 / 2**30  # k and v, layers, batch, kv heads, positions, head_dim
    assert need > available
    with pytest.raises(ModelError, match=rf"KV cache .* would need {need:.3g} GB .* only .* GB of memory is available"
                                         r"; lower max_new_tokens"):
        engine.generate([1, 2], GenerationConfig(max_new_tokens=10**9, eos_token_id=()))
    got = engine.generate([1, 2], GenerationConfig(max_new_tokens=3, eos_token_id=()))  # still usable
    assert got.tokens.shape == (1, 3)


def test_forward_with_a_batch_larger_than_the_cache_says_to_reset_it(tiny) -> None:
    _, model = tiny
    engine = InferEngine(tiny[0], backend="reference")
    engine.reset_cache(1, 8)
    ids = torch.tensor([[5, 17, 99], [1, 2, 3]])
    with pytest.raises(ModelError, match=r"batch 2, but the KV cache holds 1 rows: call reset_cache\(2, max_len\)"):
        engine.forward(ids, torch.arange(3).expand(2, 3))
    engine.reset_cache(2, 8)
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(engine.forward(ids), expected, rtol=1e-4, atol=1e-4)  # positions default to 0..T-1
