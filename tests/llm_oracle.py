"""Shared LLM oracle for the tests: tiny random models whose greedy output is diverse, and one comparison.

transformers' default init (std 0.02, zero biases, unit norms) makes a tiny
random model emit the same token over and over, so equal greedy tokens prove
nothing (a Qwen2 test passed with o_proj zeroed). ``diverse_init`` scales the
init instead: unit-variance projections, random norm weights and biases, a
sharp LM head. ``assert_decode_matches`` is the one comparison every LLM test
uses — per step and per row, decode logits within ``rel_tol`` of the logit
range and identical tokens — so the ablation tests can show that it fails on a
broken model.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

INIT_SEED = 1  # diverse_init's generator
PROMPT_SEED = 2  # the shared prompt's generator
PROMPT_SHAPE = (2, 7)  # two rows, seven tokens
NEW_TOKENS = 32
REL_TOL = 1e-3  # max |ours - transformers| per step and row, as a fraction of that row's reference logit range


def _configs() -> dict[str, Any]:
    import transformers

    return {
        "llama-gqa": transformers.LlamaConfig(
            hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=320, tie_word_embeddings=False, rope_theta=10000.0,
            rms_norm_eps=1e-6),
        "qwen2-bias-tied": transformers.Qwen2Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=288, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-5),
        "mistral-gqa": transformers.MistralConfig(
            hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False, sliding_window=None,
            rms_norm_eps=1e-5),
    }


KINDS = ("llama-gqa", "mistral-gqa", "qwen2-bias-tied")


def hf_config(kind: str) -> Any:
    """A fresh transformers config for one of ``KINDS``."""
    return _configs()[kind]


def diverse_init(model: Any, seed: int = INIT_SEED) -> Any:
    """Re-initialise ``model`` in place so its greedy output does not collapse into one repeated token.

    Projections get std gain/sqrt(fan_in) (q/k scores of order 1, so RoPE and
    the key heads matter), embeddings std 0.3 (small beside the attention and
    MLP updates, so a tied head does not just repeat the current token), the
    LM head std 4/sqrt(hidden) (logit ranges of ~20: a clear argmax),
    norm weights 1 ± 0.25 and biases std 0.5 (zero biases would hide a
    dropped bias). Seeded: the same seed gives the same weights.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "embed_tokens" in name:
                p.copy_(0.3 * noise)
            elif "lm_head" in name:
                p.copy_(4.0 * noise / math.sqrt(p.shape[1]))
            elif "norm" in name:
                p.copy_(1 + 0.25 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(1.5 * noise / math.sqrt(p.shape[1]))
    return model


@dataclass
class Reference:
    """transformers' greedy continuation of ``ids``: tokens (B, n) and the logits (B, n, vocab) they came from."""

    ids: Any
    tokens: Any
    logits: Any


def reference_generate(oracle: Any, ids: Any, new_tokens: int = NEW_TOKENS, kv_dtype: Any = None) -> Reference:
    """Greedy decode with transformers (float32), keeping every step's raw logits. ``kv_dtype``: a 16-bit
    dtype every key and value is rounded to as it enters transformers' cache (what a 16-bit KV cache holds)."""
    import transformers

    class RoundingCache(transformers.DynamicCache):
        def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kw: Any) -> Any:
            def rounded(t: Any) -> Any:
                return t.to(kv_dtype).to(t.dtype)

            return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kw)

    # transformers 5 renamed generate's ``past_key_values`` to ``cache`` (the GPU image's older version refuses it)
    named = "cache" if "cache" in inspect.signature(oracle.forward).parameters else "past_key_values"
    cache = {} if kv_dtype is None else {named: RoundingCache(config=oracle.config)}
    with torch.no_grad():
        out = oracle.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True, **cache)
    return Reference(ids, out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float())


@dataclass
class ZooModel:
    """One saved test model: its directory, the float32 oracle and its reference on the shared prompt."""

    kind: str
    dtype: Any
    path: Path
    oracle: Any
    reference: Reference
    label: str  # names the model, dtype and seeds for failure messages


_ZOO: dict[tuple[str, Any], ZooModel] = {}


def shared_prompt(vocab: int) -> Any:
    return torch.randint(0, vocab, PROMPT_SHAPE, generator=torch.Generator().manual_seed(PROMPT_SEED))


def zoo_model(kind: str, dtype: Any, root: Path) -> ZooModel:
    """The ``kind`` model in ``dtype`` saved under ``root`` (built once per process, then reused).

    Half-precision models are saved rounded; their oracle is transformers in
    float32 on the same rounded weights, which is what yirage computes (it
    widens bf16/fp16 weights to float32 in its kernels).
    """
    import transformers

    key = (kind, dtype)
    if key not in _ZOO:
        torch.manual_seed(0)  # from_config's own init is overwritten, but keep it deterministic anyway
        oracle = diverse_init(transformers.AutoModelForCausalLM.from_config(hf_config(kind)).eval())
        path = root / f"{kind}-{str(dtype).removeprefix('torch.')}"
        if dtype == torch.float32:
            oracle.save_pretrained(path, safe_serialization=True)
        else:
            # round the weights but not the model's float buffers: model.to(bfloat16).float() would also round
            # RoPE's inv_freq buffer, an error that grows with the position and is no part of the checkpoint
            copy.deepcopy(oracle).to(dtype).save_pretrained(path, safe_serialization=True)
            with torch.no_grad():
                for p in oracle.parameters():
                    p.copy_(p.to(dtype).float())
        oracle.generation_config.eos_token_id = None
        label = (f"{kind} {str(dtype).removeprefix('torch.')} (diverse_init seed {INIT_SEED}, prompt seed "
                 f"{PROMPT_SEED})")
        ref = reference_generate(oracle, shared_prompt(oracle.config.vocab_size))
        _ZOO[key] = ZooModel(kind, dtype, path, oracle, ref, label)
    return _ZOO[key]


def distinct_per_row(tokens: Any) -> list[int]:
    return [len(set(row)) for row in tokens.tolist()]


def assert_decode_matches(reference: Reference, tokens: Any, logits: Any, rel_tol: float = REL_TOL,
                          steps: Any = None, label: str = "") -> None:
    """Raise AssertionError unless ours match transformers at every step in ``steps`` (default: all).

    Per step and row: max |logits - reference| <= rel_tol * (max - min of the
    reference logits of that step and row), and the tokens are identical.
    Step 0 is the prefill's last position; steps 1.. are the decode kernel's.
    """
    n = reference.tokens.shape[1]
    steps = range(n) if steps is None else steps
    where = f" [{label}]" if label else ""
    if logits is None or tuple(logits.shape) != tuple(reference.logits.shape):
        raise AssertionError(f"logits shape {None if logits is None else tuple(logits.shape)} != reference "
                             f"{tuple(reference.logits.shape)}{where}")
    bad = []
    for step in steps:
        for row in range(reference.logits.shape[0]):
            ref = reference.logits[row, step].double()
            err = float((logits[row, step].double() - ref).abs().max())
            bound = rel_tol * float(ref.max() - ref.min())
            if not err <= bound:  # also catches NaN
                bad.append(f"step {step} row {row}: max |err| {err:.4g} > {bound:.4g}")
    if bad:
        raise AssertionError(f"decode logits differ from transformers by more than {rel_tol:g} x the logit range "
                             f"at {len(bad)} (step, row) pairs{where}: "
                             + "; ".join(bad[:6]) + (" ..." if len(bad) > 6 else ""))
    cols = list(steps)
    ours, theirs = tokens[:, cols].tolist(), reference.tokens[:, cols].tolist()
    if ours != theirs:
        raise AssertionError(f"tokens differ from transformers at steps {cols[0]}..{cols[-1]}{where}:\n"
                             f"  ours   {ours}\n  theirs {theirs}")


def zoo_factory(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """For a session fixture: zoo(kind, dtype=float32) -> ZooModel, under the session's temp dir."""
    root = tmp_path_factory.getbasetemp() / "llm_zoo"
    root.mkdir(exist_ok=True)
    return lambda kind, dtype=torch.float32: zoo_model(kind, dtype, root)

