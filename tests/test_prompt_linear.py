"""The cpu backend's prompt projections over Q8_0 / Q4_0 blocks (prompt_linear.py) against float64 torch on the
dequantized matrix, under the kernels' error model; the cases it leaves to torch; weights changed in place; and a
quantized model's prefill through it against the torch prefill. The tiles take every row count up to their cap
here (``TILES``: prompt_rows.ALWAYS); when they run on a real prompt is test_prompt_rows.py's subject."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import yirage as yr
from yirage.quant import quantize

pytest.importorskip("numba")
if not yr.is_backend_available("cpu"):
    pytest.skip("the cpu backend is not available", allow_module_level=True)

from yirage_backend_cpu import bf16_dot  # noqa: E402
from yirage_backend_cpu import prompt_linear as pl  # noqa: E402
from yirage_backend_cpu.prompt_rows import ALWAYS, CAPS  # noqa: E402

SEED = 20261127
FORMATS = ("q8_0", "q4_0")
TILES = pl.PromptLinear(ALWAYS)  # the tiles wherever they can read W, up to their row cap


def bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """x rounded per block of 32 to int16 (half a step of the block's largest |x| / 32767 per value), plus float32
    rounding of the sums."""
    m, k = x.shape
    step = x.double().abs().view(m, k // 32, 32).amax(-1) / 32767 / 2
    per_block = dense.abs().view(dense.shape[0], k // 32, 32).sum(-1)
    return step @ per_block.t() + 1e-5 * (x.double().abs() @ dense.abs().t())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, 16, CAPS["q8_0"]])  # one row; four at a time and one left; a prompt
def test_rows_match_float64_on_the_dequantized_blocks(fmt: str, m: int) -> None:
    gen = torch.Generator().manual_seed(SEED + m)
    w = quantize(torch.randn(56, 96, generator=gen), fmt)
    x = torch.randn(m, 96, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    got = TILES(x, w)
    assert got is not None and got.shape == (m, 56) and got.dtype == torch.float32
    dense = w.dequantize().double()
    err = (got.double() - x.double() @ dense.t()).abs()
    assert bool((err <= bound(x, dense)).all()), f"max error {float(err.max()):.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_thread_split_does_not_change_a_bit(fmt: str) -> None:
    gen = torch.Generator().manual_seed(SEED)
    w = quantize(torch.randn(72, 64, generator=gen), fmt)
    x = torch.randn(9, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = TILES(x, w)
        torch.set_num_threads(3)
        three = TILES(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("m", [1, 5, "most"])
def test_float_weights_are_read_as_they_are(dtype: torch.dtype, m: Any) -> None:
    """bf16 / f16 matrices: the decode's float tiles on the weights widened in registers, no float32 copy; f32
    matrices through the same tiles for short prompts."""
    most = CAPS[pl.FLOAT_KINDS[dtype]]
    m = most if m == "most" else m
    gen = torch.Generator().manual_seed(SEED + m)
    w = torch.randn(43, 100, generator=gen).to(dtype)  # odd rows (a pair and one left); K with a tail
    x = torch.randn(m, 100, generator=gen)
    got = TILES(x, w)
    assert got is not None and got.shape == (m, 43)
    want = x.double() @ w.double().t()
    tol = 4e-7 * 10 * (1 + want.abs().max().item())  # float32 sums of K = 100 products in another order
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=tol)
    assert TILES(torch.randn(most + 1, 100), w) is None  # torch's GEMM from there


@pytest.mark.skipif(not bf16_dot.native(), reason="this CPU has no AVX512-BF16 dot products")
@pytest.mark.parametrize("m", [1, 3, 4, 7, 16])
def test_rounded_bf16_prompts_use_native_bf16_dot_products(m: int) -> None:
    """prompt_dtype="bfloat16": x arrives rounded, as bfloat16; the 2 x 4 tiles, their row and column tails (43
    weight rows: pairs and an odd one; m % 4 prompt rows) against float64 on the same bf16 values."""
    gen = torch.Generator().manual_seed(SEED + m)
    w = torch.randn(43, 96, generator=gen).bfloat16()
    x = torch.randn(m, 96, generator=gen).bfloat16()
    got = TILES(x, w)
    assert got is not None and got.dtype == torch.float32 and got.shape == (m, 43)
    want = x.double() @ w.double().t()
    bound = 96 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())  # float32 sums of 96 exact products
    assert bool(((got.double() - want).abs() <= bound).all())
    assert TILES(x[:, :80].contiguous(), w[:, :80].contiguous()) is None  # K not whole 32s: torch's
    assert TILES(x, w.float()) is None  # a float32 matrix under a bf16 x
    assert TILES(torch.zeros(CAPS["bf16 x"] + 1, 96).bfloat16(), w) is None  # torch's bf16 GEMM


def test_what_it_cannot_read_is_left_to_torch() -> None:
    gen = torch.Generator().manual_seed(SEED)
    run = TILES
    x = torch.randn(4, 64, generator=gen)
    w = quantize(torch.randn(16, 64, generator=gen), "q8_0")
    assert run(torch.randn(CAPS["f32"] + 1, 64), torch.randn(16, 64)) is None  # torch's GEMM from there
    assert run(x, torch.randn(16, 64).bfloat16().t().contiguous().t()) is None  # not row-major
    assert run(x, quantize(torch.randn(12, 64, generator=gen), "q4_0")) is None  # rows not whole groups of 8
    assert run(torch.randn(CAPS["q8_0"] + 1, 64), w) is None  # a long prompt: dequantize + GEMM is faster
    assert run(x.double(), w) is None
    assert run(torch.randn(4, 32), w) is None  # K does not match
    nan_scale = quantize(torch.randn(16, 64, generator=gen), "q8_0")
    nan_scale.blocks[3, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # a NaN half scale: the exact path
    assert run(x, nan_scale) is None
    assert run(x, w) is not None


def test_blocks_changed_in_place_are_read_again() -> None:
    gen = torch.Generator().manual_seed(SEED)
    w = quantize(torch.randn(16, 64, generator=gen), "q4_0")
    x = torch.randn(3, 64, generator=gen)
    before = TILES(x, w)
    w.blocks.copy_(quantize(torch.randn(16, 64, generator=gen), "q4_0").blocks)
    after = TILES(x, w)
    dense = w.dequantize().double()
    assert not torch.equal(before, after)
    assert bool(((after.double() - x.double() @ dense.t()).abs() <= bound(x, dense)).all())


def test_a_weight_planned_once_is_planned_again_after_an_in_place_change() -> None:
    """Each weight's parts are worked out on its first call and kept (PromptLinear._plan); a scale made NaN in
    place afterwards must send the next call to torch's exact path, not to the kept plan's tiles."""
    gen = torch.Generator().manual_seed(SEED)
    w = quantize(torch.randn(16, 64, generator=gen), "q8_0")
    x = torch.randn(3, 64, generator=gen)
    assert TILES(x, w) is not None
    w.blocks[3, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)
    assert TILES(x, w) is None
    f = torch.randn(16, 64, generator=gen).bfloat16()
    before = TILES(x, f)
    f.mul_(-2)
    assert torch.equal(TILES(x, f), before * -2)  # the kept plan reads the same buffer, now doubled and negated
    f.data = torch.randn(40, 64, generator=gen).bfloat16()  # new storage and shape, and no version change
    assert torch.equal(TILES(x, f), pl.PromptLinear(ALWAYS)(x, f))  # planned anew: not the freed 16-row buffer


def test_plans_go_with_their_weights() -> None:
    import gc

    run = pl.PromptLinear(ALWAYS)
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, 64, generator=gen)
    weights = [quantize(torch.randn(16, 64, generator=gen), "q4_0"), torch.randn(8, 64, generator=gen).bfloat16()]
    for w in weights:
        assert run(x, w) is not None
    assert len(run._plans) == 2
    del weights, w
    gc.collect()
    assert not run._plans


@pytest.mark.parametrize("dtype", ["q8_0", torch.bfloat16], ids=["q8_0", "bf16"])
def test_a_prefill_through_it_matches_the_torch_prefill(tmp_path, dtype) -> None:
    """The same model and prompt, prefilled with the backend's projections and with torch's: logits within the
    int16 rounding of x (q8_0) or float32 sums in another order (bf16), and every KV cache row written."""
    from yirage.engine import InferEngine
    from yirage.models.llama import LlamaModel  # noqa: F401 - the engine's model type

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    engine = InferEngine(tmp_path, backend="cpu", dtype=dtype)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(SEED))  # 14 rows: under both row limits
    pos = torch.arange(7).expand(2, 7)
    engine.reset_cache(2, 16)
    used = []
    real = pl.PromptLinear.__call__

    def spy(self, x, weight):  # type: ignore[no-untyped-def]
        out = real(self, x, weight)
        used.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YIRAGE_CPU_PROMPT_TILES", "always")
        mp.setattr(pl.PromptLinear, "__call__", spy)
        ours = engine.forward(ids, pos)
    assert used and all(used), "the engine's prefill did not go through the backend's projections"
    k_ours = [k.clone() for k in engine.model.k_cache]
    torch_logits = engine.model.forward(ids, pos)  # linear=None: dequantize + GEMM
    assert (ours - torch_logits).abs().max().item() < 1e-3 * (1 + torch_logits.abs().max().item())
    for got, want in zip(k_ours, engine.model.k_cache, strict=True):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-4)
    assert not np.allclose(ours.numpy(), 0)


def test_a_prompt_continued_at_later_positions_sees_the_cached_ones(tmp_path) -> None:
    """Prefill 5 tokens, then 3 more at positions 5..7 (the masked attention path, not the causal one): the last
    logits equal transformers' on all 8 tokens at once."""
    from yirage.engine import InferEngine

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    engine = InferEngine(tmp_path, backend="cpu")
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(SEED))
    engine.reset_cache(1, 8)
    engine.forward(ids[:, :5])
    later = engine.forward(ids[:, 5:], torch.arange(5, 8)[None])
    with torch.no_grad():
        want = hf(ids).logits[:, 5:]
    torch.testing.assert_close(later, want, rtol=1e-4, atol=1e-4)
