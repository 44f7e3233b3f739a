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
from yirage.models.llama import ModelError

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
