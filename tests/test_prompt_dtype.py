"""``InferEngine(prompt_dtype="bfloat16")``: the prompt's projections round their input to bfloat16 and multiply in
bf16, and its attention runs in bf16, as transformers runs a bf16 model's Linear layers and attention. Oracles:
float64 arithmetic on the rounded operands, and transformers (float32, the same bf16 weights) with every Linear's
input and output rounded to bf16 by hooks and its own SDPA attention given q, k and v rounded to bf16."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from llm_oracle import zoo_factory

from yirage.engine import InferEngine
from yirage.models.config import ModelError
from yirage.models.prefill import rounded_linear

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return zoo_factory(tmp_path_factory)


def test_the_input_is_rounded_to_bf16_before_the_product() -> None:
    # 1 + 3 * 2^-9 lies between the bf16 neighbours 1 and 1 + 2^-7 and rounds up; minus 1 it is 2^-7 (float32
    # activations would give 3 * 2^-9, a bf16 value too)
    x = torch.tensor([[1 + 3 * 2.0 ** -9, -1.0]]).repeat(5, 1)
    w = torch.ones(8, 2, dtype=BF16)
    out = rounded_linear(BF16, None)(x, w)
    assert out.dtype == torch.float32 and out.shape == (5, 8)
    assert torch.equal(out, torch.full((5, 8), 2.0 ** -7))


def test_random_products_match_float64_on_the_rounded_operands() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=gen)
    w = torch.randn(72, 96, generator=gen).to(BF16)
    out = rounded_linear(BF16, None)(x, w)
    exact = x.to(BF16).double() @ w.double().t()
    # the product is rounded to bf16 once: within half a bf16 ulp (8 significant bits) of float64's, plus the
    # float32 accumulation's error
    half_ulp = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 8)
    assert bool(((out.double() - exact).abs() <= half_ulp + 1e-5 * exact.abs() + 1e-6).all())
    assert torch.equal(out, out.to(BF16).float())  # bf16 values, as a transformers bf16 Linear returns


def test_the_next_projection_gets_the_rounded_input_and_its_product_is_rounded() -> None:
    calls = []

    def then(x, weight):  # type: ignore[no-untyped-def]
        calls.append((x.dtype, weight.dtype))
        return torch.full((x.shape[0], weight.shape[0]), 1 + 2.0 ** -10) if weight.dtype == BF16 else None

    linear = rounded_linear(BF16, then)
    assert torch.equal(linear(torch.randn(3, 16), torch.randn(4, 16, dtype=BF16)), torch.ones(3, 4))
    assert linear(torch.randn(3, 16), torch.randn(4, 16)) is None  # a float32 matrix: as it is, torch's then
    assert calls == [(BF16, BF16), (torch.float32, torch.float32)]


def test_the_prefill_matches_transformers_with_bf16_rounded_linears(zoo, pk_backend) -> None:
    """The prefill's logits against transformers whose every Linear sees and returns bf16-rounded values, on every
    PersistentKernel backend (torch's bf16 matmul on its device; the cpu backend's bf16 dot products). The input
    rounding moves the logits by several bf16 ulps, so the float32 prefill fails the same bound."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def bf16_sdpa(module, query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        out, weights = sdpa_attention_forward(module, query.to(BF16), key.to(BF16), value.to(BF16), *args, **kwargs)
        return out.float(), weights

    AttentionInterface.register("yirage_test_bf16_sdpa", bf16_sdpa)
    model = zoo("llama-gqa", BF16)
    oracle = copy.deepcopy(model.oracle)
    oracle.config._attn_implementation = "yirage_test_bf16_sdpa"
    for module in oracle.modules():
        if isinstance(module, torch.nn.Linear) and module is not oracle.lm_head:  # float32 logits (rounded_linear)
            module.register_forward_pre_hook(lambda m, args: (args[0].to(BF16).float(),))
            module.register_forward_hook(lambda m, args, out: out.to(BF16).float())
    ids = torch.randint(0, oracle.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = oracle(ids).logits.double()
    # a hidden product accumulated in another order may round to the neighbouring bf16 value: a quarter of a
    # bf16 ulp at the largest logit bounds what that moves here (measured: 0 with torch's matmul, 0.006 with the
    # cpu backend's tiles; the float32 prefill 0.2)
    ulp = 2.0 ** (math.floor(math.log2(float(want.abs().max()))) - 7)
    bound = max(1e-3 * float((want.amax(-1) - want.amin(-1)).min()), ulp / 4)
    errors = {}
    for prompt_dtype in ("bfloat16", None):
        engine = InferEngine(model.path, backend=pk_backend, prompt_dtype=prompt_dtype)
        engine.reset_cache(2, 16)  # the logits come back on the backend's device
        logits = engine.forward(ids).cpu()
        errors[prompt_dtype] = float((logits.double() - want).abs().max())
        assert not torch.equal(logits, logits.bfloat16().float())  # the LM head's logits stay float32: no ties
    assert errors["bfloat16"] <= bound < errors[None], (errors, bound)


def test_prompt_dtypes_are_checked(zoo) -> None:
    with pytest.raises(ModelError, match="prompt_dtype='float16' is not supported"):
        InferEngine(zoo("llama-gqa", BF16).path, backend="reference", prompt_dtype="float16")
    with pytest.raises(ModelError, match="this model's are torch.float32; load it with dtype='bfloat16'"):
        InferEngine(zoo("llama-gqa").path, backend="reference", prompt_dtype="bfloat16")
