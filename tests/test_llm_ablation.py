"""Ablations: the LLM comparison with transformers must FAIL on a deliberately broken yirage model.

A test that cannot fail proves nothing: with transformers' default init, a
Qwen2 greedy test passed with o_proj zeroed or KV heads swapped. Here each
break is applied to the yirage side only (the loaded ``engine.model``; the
transformers oracle is untouched) and ``assert_decode_matches`` — the very
check tests/test_persistent.py passes on the intact models — must raise
AssertionError:

- ``model``: the break applies to the prefill and the decode kernel alike;
- ``decoder``: only the PersistentKernel is built from the broken weights while
  the torch prefill stays intact, so step 0 still matches and the decode steps
  alone must fail: the per-step decode comparison catches the bug by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import yirage as yr
import yirage.models.prefill as prefill
from yirage.engine import GenerationConfig, InferEngine

pytest.importorskip("transformers")

from llm_oracle import NEW_TOKENS, assert_decode_matches, zoo_factory  # noqa: E402 - needs transformers


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


@pytest.fixture(params=[b.value for b in yr.get_available_backends()])
def backend(request) -> str:
    """Every available backend with a PersistentKernel runtime: each must fail on every break."""
    from yirage.backend.selection import registry

    if type(registry().get(request.param)).persistent_runtime is yr.Backend.persistent_runtime:
        pytest.skip(f"backend {request.param!r} has no PersistentKernel runtime yet")
    return request.param


# -- the breaks: each replaces tensors of a LlamaModel (never writes into them), so they can be undone ---------


def _slot_rows(model: Any, group: int, slot: int) -> slice:
    """Rows of the regrouped qkv weight (LlamaModel._qkv_order) for kv group ``group``.

    Slots 0..group_size-1 are that group's query heads, then its key head, then its value head.
    """
    c = model.config
    start = (group * (c.group + 2) + slot) * c.head_dim
    return slice(start, start + c.head_dim)


def no_rope(model: Any) -> None:
    """Positions are not rotated into queries and keys."""
    model.cos, model.sin = torch.ones_like(model.cos), torch.zeros_like(model.sin)


def swapped_kv_heads(model: Any) -> None:
    """kv heads 0 and 1 trade places: each query group attends with the other group's keys and values."""
    slots = (model.config.group, model.config.group + 1)  # the key and the value head of a group
    for blk in model.blocks:
        for key in ("qkv", "qkv_bias"):
            if key in blk:
                t = blk[key].clone()
                for s in slots:
                    t[_slot_rows(model, 0, s)], t[_slot_rows(model, 1, s)] = (
                        blk[key][_slot_rows(model, 1, s)], blk[key][_slot_rows(model, 0, s)])
                blk[key] = t


def zeroed_o_proj(model: Any) -> None:
    """The last layer's attention output projection is zero: its attention contributes nothing."""
    model.blocks[-1]["o"] = torch.zeros_like(model.blocks[-1]["o"])


def wrong_gqa_grouping(model: Any) -> None:
    """Query head h is served by kv head h % kv_heads instead of h // group (the classic GQA indexing bug).

    The query heads are re-slotted so that the heads with h % kv_heads == g sit
    in group g, and o_proj's columns follow them: only the kv head changes.
    """
    c, d = model.config, model.config.head_dim
    order = sorted(range(c.heads), key=lambda h: (h % c.kv_heads, h))  # slot s now holds head order[s]
    for blk in model.blocks:
        for key in ("qkv", "qkv_bias"):
            if key in blk:
                t = blk[key].clone()
                for s, h in enumerate(order):
                    t[_slot_rows(model, s // c.group, s % c.group)] = blk[key][_slot_rows(model, h // c.group,
                                                                                         h % c.group)]
                blk[key] = t
        o = blk["o"].clone()
        for s, h in enumerate(order):
            o[:, s * d:(s + 1) * d] = blk["o"][:, h * d:(h + 1) * d]
        blk["o"] = o


def qkv_bias_dropped(model: Any) -> None:
    """Qwen2's q/k/v biases are not added."""
    for blk in model.blocks:
        del blk["qkv_bias"]


# name -> (model kind, weight dtype, break)
ABLATIONS: dict[str, tuple[str, Any, Callable[[Any], None]]] = {
    "no-rope": ("llama-gqa", torch.float32, no_rope),
    "no-rope-bf16": ("llama-gqa", torch.bfloat16, no_rope),  # the bf16/fp16 greedy tests once passed without RoPE
    "no-rope-fp16": ("mistral-gqa", torch.float16, no_rope),
    "swapped-kv-heads": ("mistral-gqa", torch.float32, swapped_kv_heads),
    "zeroed-o-proj": ("qwen2-bias-tied", torch.float32, zeroed_o_proj),
    "wrong-gqa-grouping": ("llama-gqa", torch.float32, wrong_gqa_grouping),
    "qkv-bias-dropped": ("qwen2-bias-tied", torch.float32, qkv_bias_dropped),
}


def broken_engine(path: Any, backend: str, ablate: Callable[[Any], None], where: str,
                  monkeypatch: pytest.MonkeyPatch) -> InferEngine:
    """An engine whose whole model (``where="model"``) or only its decode kernel (``"decoder"``) is broken."""
    engine = InferEngine(path, backend=backend)
    model = engine.model
    if where == "model":
        if ablate is no_rope:  # the RoPE tables are rebuilt by reset_cache: break their source
            def identity_tables(config: Any, positions: int, device: Any = "cpu") -> tuple[Any, Any]:
                return (torch.ones(positions, config.head_dim, device=device),
                        torch.zeros(positions, config.head_dim, device=device))

            monkeypatch.setattr(prefill, "rope_tables", identity_tables)
        else:
            ablate(model)
        return engine
    build = model.build_decoder

    def build_broken(*args: Any, **kwargs: Any) -> Any:
        intact = ([dict(blk) for blk in model.blocks], model.cos, model.sin)
        ablate(model)
        try:
            return build(*args, **kwargs)  # the kernel keeps the broken tensors it attached
        finally:
            model.blocks, (model.cos, model.sin) = intact[0], intact[1:]  # the prefill sees the intact model

    monkeypatch.setattr(model, "build_decoder", build_broken)
    return engine


def run(engine: InferEngine, ids: Any) -> Any:
    return engine.generate(ids, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=(), output_logits=True))


def test_the_decoder_only_harness_without_a_break_passes(backend, zoo, monkeypatch) -> None:
    """Control: the same wrapper and check pass when nothing is broken (so the prefill really is restored)."""
    for kind, dtype in sorted({(kind, dtype) for kind, dtype, _ in ABLATIONS.values()}, key=str):
        model = zoo(kind, dtype)
        engine = broken_engine(model.path, backend, lambda m: None, "decoder", monkeypatch)
        result = run(engine, model.reference.ids)
        assert_decode_matches(model.reference, result.tokens, result.logits, label=f"{model.label} on {backend}")


def check_break_fails(name: str, where: str, backend: str, zoo: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, dtype, ablate = ABLATIONS[name]
    model = zoo(kind, dtype)
    ref = model.reference
    result = run(broken_engine(model.path, backend, ablate, where, monkeypatch), ref.ids)
    label = f"{model.label} with {name} in the {where} on {backend}"
    if where == "decoder":  # the prefill is intact, so the first token's logits still match
        assert_decode_matches(ref, result.tokens, result.logits, steps=range(1), label=label)
    with pytest.raises(AssertionError, match="decode logits differ from transformers"):
        assert_decode_matches(ref, result.tokens, result.logits, steps=range(1, NEW_TOKENS), label=label)
    with pytest.raises(AssertionError, match="decode logits differ from transformers"):
        assert_decode_matches(ref, result.tokens, result.logits, label=label)


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_a_break_in_the_decode_kernel_alone_fails_the_comparison(name, backend, zoo, monkeypatch) -> None:
    check_break_fails(name, "decoder", backend, zoo, monkeypatch)


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_a_break_in_the_whole_model_fails_the_comparison(name, zoo, monkeypatch) -> None:
    """Prefill and decode broken alike; on cpu only (the reference backend runs the decoder-only breaks)."""
    if not yr.is_backend_available("cpu"):
        pytest.skip("the cpu backend is not available here")
    check_break_fails(name, "model", "cpu", zoo, monkeypatch)
