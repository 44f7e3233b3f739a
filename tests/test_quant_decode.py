"""Weight-only Q8_0 / Q4_0 decode, checked against independent oracles.

The block formats against the ``gguf`` package's port of ggml's quantizers
(byte for byte); the CPU runtime's quantized GEMV against float64 torch on the
dequantized blocks, including zero, subnormal, inf and NaN scales; whole
models against transformers in float32 on weights quantized and dequantized
by ``gguf`` (the same values yirage keeps as blocks). A model test is shown
to fail when a kernel misreads the block layout (nibbles swapped).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine
from yirage.errors import NotSupportedError
from yirage.persistent.layers import LayerError
from yirage.quant import QuantError, QuantizedTensor, dequantize, quantize

gguf_quants = pytest.importorskip("gguf.quants")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType  # noqa: E402 - after the importorskip above
from llm_oracle import KINDS, assert_decode_matches, reference_generate, zoo_factory  # noqa: E402

FORMATS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
SEED = 20261123


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


def awkward_matrix(seed: int, rows: int = 24, k: int = 96) -> torch.Tensor:
    """Random rows plus blocks that test the edge cases: all zero, a negative maximum, exact ties, tiny values."""
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=gen) * 0.05
    w[0, :32] = 0
    w[1, 32:64] = -w[1, 32:64].abs()
    w[1, 40] = -1.0
    w[2, :32] = torch.arange(32) / 2 - 8  # halves: roundf's ties
    w[3, :32] *= 1e-6  # scale below half's normal range: a subnormal d
    w[4, 64:] = 7.0
    return w


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_are_ggml_bytes_and_dequantize_like_gguf(fmt) -> None:
    w = awkward_matrix(SEED)
    ours = quantize(w, fmt)
    theirs = gguf_quants.quantize(w.numpy(), FORMATS[fmt])
    assert ours.shape == (24, 96) and ours.blocks.dtype == torch.uint8
    np.testing.assert_array_equal(ours.blocks.numpy(), theirs)
    np.testing.assert_array_equal(ours.dequantize().numpy(), gguf_quants.dequantize(theirs, FORMATS[fmt]))
    rows = torch.tensor([[3, 0], [1, 1]])
    torch.testing.assert_close(ours.dequantize(rows), ours.dequantize()[rows], rtol=0, atol=0)


def test_bad_matrices_and_blocks_are_refused_with_the_fix() -> None:
    with pytest.raises(QuantError, match="multiple of 32"):
        quantize(torch.zeros(4, 40), "q8_0")
    with pytest.raises(QuantError, match="NaN or inf"):
        quantize(torch.tensor([[float("nan")] * 32]), "q4_0")
    with pytest.raises(QuantError, match="2-D float"):
        quantize(torch.zeros(32), "q8_0")
    with pytest.raises(QuantError, match="unknown quantization format 'q5_k'"):
        quantize(torch.zeros(2, 32), "q5_k")
    with pytest.raises(QuantError, match=r"must have shape \(2, 68\)"):
        QuantizedTensor(torch.zeros(2, 60, dtype=torch.uint8), "q8_0", (2, 64))
    with pytest.raises(QuantError, match="torch.uint8"):
        QuantizedTensor(torch.zeros(2, 68), "q8_0", (2, 64))


def quant_kernel_rows(fmt: str, w: QuantizedTensor, x: torch.Tensor, bias: torch.Tensor | None,
                      res: torch.Tensor | None, groups: bool = False, rows: tuple[int, int] | None = None
                      ) -> torch.Tensor:
    """The CPU runtime's quantized GEMV task body over rows [n0, n1) (default: all; others stay 0), on the blocks
    as they are or, with ``groups``, repacked in 8-row groups the way the runtime does."""
    from yirage_backend_cpu import pk_quant, quant_group

    batch, k = x.shape
    n = w.shape[0]
    out = np.zeros(batch * n, np.float32)
    none = np.empty(0, np.float32)
    code = pk_quant.dtype_code(fmt, w.blocks)  # as the runtime classifies them (non-finite scales: exact path)
    blocks = w.blocks
    if groups:
        assert code in (pk_quant.Q4_0, pk_quant.Q8_0)
        blocks, code = ((quant_group.repack_q4_0(w.blocks), pk_quant.Q4_0G) if code == pk_quant.Q4_0 else
                        (quant_group.repack_q8_0(w.blocks), pk_quant.Q8_0G))
    n0, n1 = rows or (0, n)
    pk_quant.linear_q(x.contiguous().view(-1).numpy(), batch, k, blocks.data_ptr(), code, n0, n1, out, n,
                      none if res is None else res.contiguous().view(-1).numpy(),
                      none if bias is None else bias.numpy(), np.zeros(2 * batch * k, np.float32))
    return torch.from_numpy(out).view(batch, n)


def need_cpu() -> None:
    if not yr.is_backend_available("cpu"):
        pytest.skip("the cpu backend is not available here")


def error_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The kernel's error model: x rounded per block of 32 to int16 (at most half a step of largest|x| / 32767
    per value), plus float32 rounding of the sums."""
    batch, k = x.shape
    step = x.double().abs().view(batch, k // 32, 32).amax(-1) / 32767 / 2  # (batch, blocks)
    per_block = dense.abs().view(dense.shape[0], k // 32, 32).sum(-1)  # (rows, blocks)
    return step @ per_block.t() + 1e-5 * (x.double().abs() @ dense.abs().t())


LAYOUTS = [("q8_0", False), ("q4_0", False), ("q8_0", True), ("q4_0", True)]  # rows, and the runtime's 8-row groups


@pytest.mark.parametrize("k", (32, 96, 576))  # one block, an odd count (the unpaired tail), a model's hidden size
@pytest.mark.parametrize(("fmt", "groups"), LAYOUTS, ids=("q8_0", "q4_0", "q8_0-groups", "q4_0-groups"))
@pytest.mark.parametrize("batch", (2, 5))  # one x row at a time; four at once (groups) and one left
def test_cpu_quant_rows_match_float64_on_the_dequantized_blocks(fmt, groups, k, batch) -> None:
    need_cpu()
    gen = torch.Generator().manual_seed(SEED + k)
    print(f"seed {SEED + k}")
    awkward = awkward_matrix(SEED, 8, 96).repeat(1, k // 32 + 1)[:, :k]  # its edge-case blocks, cut to K
    w = quantize(torch.cat([awkward, torch.randn(40, k, generator=gen)]), fmt)
    x = torch.randn(batch, k, generator=gen) * torch.logspace(-3, 3, batch)[:, None]  # a scale per row
    bias, res = torch.randn(48, generator=gen), torch.randn(batch, 48, generator=gen)
    ours = quant_kernel_rows(fmt, w, x, bias, res, groups)
    dense = w.dequantize().double()
    ref = x.double() @ dense.t() + bias.double() + res.double()
    bound = error_bound(x, dense) + 1e-5 * (bias.abs() + res.abs())
    err = (ours.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_decode_reaches_quantized_rows_through_their_entry_point(fmt) -> None:
    """pk_tasks.linear calls linear_q compiled apart, by address (pk_quant.linear_q_entry): the same bits as
    linear_q called directly; with no entry point (0) the rows are NaN, never a call to address 0."""
    need_cpu()
    from yirage_backend_cpu import pk_quant, pk_tasks

    gen = torch.Generator().manual_seed(SEED)
    w = quantize(torch.randn(24, 64, generator=gen), fmt)
    x = torch.randn(3, 64, generator=gen)
    bias, res = torch.randn(24, generator=gen), torch.randn(3, 24, generator=gen)
    code = pk_quant.dtype_code(fmt, w.blocks)

    def rows(quant: int) -> np.ndarray:
        out = np.zeros(3 * 24, np.float32)
        pk_tasks.linear(x.view(-1).numpy().copy(), 3, 64, w.blocks.data_ptr(), code, 4, 20, out, 24,
                        res.view(-1).numpy(), bias.numpy(), np.zeros(2 * 3 * 64, np.float32), quant)
        return out.reshape(3, 24)

    want = quant_kernel_rows(fmt, w, x, bias, res, rows=(4, 20)).numpy()
    assert np.array_equal(rows(pk_quant.quantized_entry([code])), want)
    unreached = rows(0)
    assert np.isnan(unreached[:, 4:20]).all() and not unreached[:, :4].any() and not unreached[:, 20:].any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_groups_serve_task_ranges_that_cut_groups(fmt) -> None:
    """A task's rows need not start or end on a group of 8: rows outside [n0, n1) stay untouched, rows inside are
    the full GEMV's (bit for bit: the same group pass computes them)."""
    need_cpu()
    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    w = quantize(torch.randn(48, 96, generator=gen), fmt)
    x, res = torch.randn(2, 96, generator=gen), torch.randn(2, 48, generator=gen)
    full = quant_kernel_rows(fmt, w, x, None, res, groups=True)
    for n0, n1 in ((3, 13), (8, 16), (0, 5), (45, 48), (17, 18)):
        part = quant_kernel_rows(fmt, w, x, None, res, groups=True, rows=(n0, n1))
        assert torch.equal(part[:, n0:n1], full[:, n0:n1]), (n0, n1)
        assert not part[:, :n0].any() and not part[:, n1:].any(), (n0, n1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", (4, 9))
def test_cpu_groups_give_each_batch_row_its_batch_1_bits(fmt, batch) -> None:
    """Batch decode dots four x rows per pass over a group: each row's integer sums and float steps are the
    one-row pass's, so a sequence's logits do not depend on its batch; task ranges cutting groups included."""
    need_cpu()
    gen = torch.Generator().manual_seed(SEED + batch)
    w = quantize(torch.randn(40, 96, generator=gen), fmt)
    x = torch.randn(batch, 96, generator=gen) * torch.logspace(-2, 2, batch)[:, None]
    for rows in ((0, 40), (3, 21)):
        together = quant_kernel_rows(fmt, w, x, None, None, groups=True, rows=rows)
        alone = torch.cat([quant_kernel_rows(fmt, w, x[b:b + 1], None, None, groups=True, rows=rows)
                           for b in range(batch)])
        assert torch.equal(together, alone), rows


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_groups_keep_torch_results_for_nonfinite_x(fmt) -> None:
    """x with inf or NaN cannot be scaled to int16: the 8-row groups then take a float32 path, whose infinities and
    NaNs are torch's on the dequantized matrix."""
    need_cpu()
    gen = torch.Generator().manual_seed(SEED)
    w = quantize(torch.rand(16, 64, generator=gen) + 0.1, fmt)  # no zero value: inf * 0 would be NaN
    x = torch.rand(2, 64, generator=gen)
    x[0, 5], x[1, 40] = float("inf"), float("nan")
    ours = quant_kernel_rows(fmt, w, x, None, None, groups=True)
    ref = x @ w.dequantize().t()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)) and torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours[torch.isinf(ref)], ref[torch.isinf(ref)])


@pytest.mark.parametrize(("fmt", "groups"), LAYOUTS, ids=("q8_0", "q4_0", "q8_0-groups", "q4_0-groups"))
def test_cpu_quant_float_fallback_keeps_the_finite_rows_of_a_mixed_batch(fmt, groups) -> None:
    """One NaN in batch row 1 sends the whole batch down the float32 path (x cannot be scaled to int16). Row 0,
    finite, must still be float64's x @ W^T + bias + res on the dequantized blocks (a wrong scale or a lost epilogue
    on that path fails here; the all-non-finite test above compares no finite value), and row 1 is NaN everywhere,
    as in torch."""
    need_cpu()
    gen = torch.Generator().manual_seed(SEED + 7)
    print(f"seed {SEED + 7}")
    k = 96
    w = quantize(torch.randn(24, k, generator=gen), fmt)
    x = torch.randn(2, k, generator=gen)
    x[1, 50] = float("nan")
    bias, res = torch.randn(24, generator=gen), torch.randn(2, 24, generator=gen)
    ours = quant_kernel_rows(fmt, w, x, bias, res, groups)
    dense = w.dequantize().double()
    ref = x.double() @ dense.t() + bias.double() + res.double()
    assert bool(torch.isnan(ref[1]).all()) and bool(torch.isnan(ours[1]).all())
    bound = 1e-5 * (x[0].double().abs() @ dense.abs().t() + bias.abs() + res[0].abs())  # float32 sums, no int16
    err = (ours[0].double() - ref[0]).abs()
    assert bool((err <= bound).all()), f"finite row: max error {float(err.max()):.3g}, bound {float(bound.max()):.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_groups_dequantize_any_row_and_columns(fmt) -> None:
    """The embed lookup reads the repacked blocks too (tied embeddings): every row, column ranges across blocks."""
    need_cpu()
    from yirage_backend_cpu import pk_quant, quant_group

    w = quantize(awkward_matrix(SEED, 24, 96), fmt)
    packed = (quant_group.repack_q4_0 if fmt == "q4_0" else quant_group.repack_q8_0)(w.blocks)
    dense = w.dequantize()
    for row in range(24):
        for c0, count in ((0, 96), (5, 40), (31, 2), (64, 32)):
            got = np.zeros(count, np.float32)
            code = pk_quant.Q4_0G if fmt == "q4_0" else pk_quant.Q8_0G
            pk_quant.dequantize_row(packed.data_ptr(), code, 96, row, c0, count, got)
            assert torch.equal(torch.from_numpy(got), dense[row, c0:c0 + count]), (row, c0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_quant_rows_keep_ieee_specials_of_the_scale(fmt) -> None:
    """A block scale of inf or NaN (hand-made blocks) gives inf / NaN like torch; a zero scale gives zeros."""
    need_cpu()
    w = quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(SEED)), fmt)
    blocks = w.blocks.view(4, 2, -1)
    specials = {0: 0x7C00, 1: 0x7E00, 2: 0x0000, 3: 0x0001}  # +inf, NaN, zero, the smallest subnormal
    for row, bits in specials.items():
        blocks[row, 1, :2] = torch.tensor([bits & 0xFF, bits >> 8], dtype=torch.uint8)
    blocks[0, 1, 2:] = 1 if fmt == "q8_0" else 0x99  # every value of the inf block is +1 * d: the row sums to +inf
    x = torch.rand(1, 64, generator=torch.Generator().manual_seed(SEED)) + 0.5  # positive: inf stays inf
    ours = quant_kernel_rows(fmt, w, x, None, None)[0]
    ref = (x.double() @ w.dequantize().double().t())[0]
    assert ref[0] == float("inf") and ours[0] == float("inf")
    assert torch.isnan(ref[1]) and torch.isnan(ours[1])
    dense = w.dequantize().double()[2:]
    assert bool(((ours[2:].double() - ref[2:]).abs() <= error_bound(x, dense)[0]).all()), (ours[2:], ref[2:])


def quantized_oracle(model, fmt: str):
    """transformers in float32 on matrices quantized and dequantized by gguf: what yirage keeps as blocks."""
    oracle = copy.deepcopy(model.oracle)
    with torch.no_grad():
        for p in oracle.parameters():
            if p.dim() == 2:
                blocks = gguf_quants.quantize(p.detach().numpy(), FORMATS[fmt])
                p.copy_(torch.from_numpy(gguf_quants.dequantize(blocks, FORMATS[fmt])).view(p.shape))
    return oracle


def greedy() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=32, eos_token_id=(), output_logits=True)


@pytest.mark.parametrize("backend", ("cpu", "reference"))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_decode_matches_transformers_on_the_dequantized_weights(kind, fmt, backend, zoo) -> None:
    if backend == "cpu":
        need_cpu()
    model = zoo(kind)
    reference = reference_generate(quantized_oracle(model, fmt), model.reference.ids)
    engine = InferEngine(model.path, backend=backend, dtype=fmt)
    qkv = engine.model.blocks[0]["qkv"]
    assert isinstance(qkv, QuantizedTensor) and qkv.format == fmt  # kept as blocks: the bytes a step reads
    result = engine.generate(model.reference.ids, greedy())
    assert_decode_matches(reference, result.tokens, result.logits, label=f"{model.label}, {fmt} on {backend}")


def test_the_quantized_comparison_fails_when_a_kernel_swaps_the_nibbles(zoo) -> None:
    """The oracle sees a misread block layout: one layer's Q4_0 nibbles swapped, as a kernel bug would read them."""
    need_cpu()
    model = zoo("llama-gqa")
    reference = reference_generate(quantized_oracle(model, "q4_0"), model.reference.ids)
    engine = InferEngine(model.path, backend="cpu", dtype="q4_0")
    gate_up = engine.model.blocks[0]["gate_up"].blocks.view(-1, 18)
    gate_up[:, 2:] = (gate_up[:, 2:] >> 4) | (gate_up[:, 2:] << 4)
    result = engine.generate(model.reference.ids, greedy())
    with pytest.raises(AssertionError, match="decode logits differ"):
        assert_decode_matches(reference, result.tokens, result.logits)


def swap_nibbles_in_place(model) -> None:
    gate_up = model.blocks[0]["gate_up"].blocks.view(-1, 18)
    gate_up[:, 2:] = (gate_up[:, 2:] >> 4) | (gate_up[:, 2:] << 4)


def test_blocks_changed_in_place_between_runs_reach_the_decode(zoo) -> None:
    """The CPU runtime reads Q4_0 from its own repacked copy: an in-place torch update of the blocks after a run
    must reach the next run (the copy is remade), exactly as a decoder built after the update sees it."""
    need_cpu()
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend="cpu", dtype="q4_0")
    before = engine.generate(model.reference.ids, greedy())  # builds (and keeps) the decoder
    swap_nibbles_in_place(engine.model)
    after = engine.generate(model.reference.ids, greedy())
    fresh = InferEngine(model.path, backend="cpu", dtype="q4_0")
    swap_nibbles_in_place(fresh.model)
    want = fresh.generate(model.reference.ids, greedy())
    assert not torch.equal(before.logits, want.logits)  # the update matters
    assert torch.equal(after.logits, want.logits)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_model_never_compiles_the_float_tiles(fmt, zoo) -> None:
    """A decode whose every matrix is quantized runs its projections through pk_tasks.linear_blocks_entry, never
    linear_entry (the float tiles: 4-5 s of a cold start on 2 cores); with one float matrix (here the LM head) it
    gets linear_entry. Both decode to the oracle's tokens: a float matrix given the blocks' entry gives NaN rows."""
    need_cpu()
    from yirage_backend_cpu.pk_entry import LINEAR_ENTRY
    from yirage_backend_cpu.pk_tasks import linear_blocks_entry, linear_entry

    model = zoo("llama-gqa")
    oracle = quantized_oracle(model, fmt)
    for float_head in (False, True):
        engine = InferEngine(model.path, backend="cpu", dtype=fmt)
        if float_head:
            engine.model.lm_head = engine.model.lm_head.dequantize()
            oracle.lm_head.weight.data.copy_(engine.model.lm_head)
        result = engine.generate(model.reference.ids, greedy())
        (decoder,) = engine._decoders.values()
        want = linear_entry if float_head else linear_blocks_entry
        assert decoder.runtime.entries[LINEAR_ENTRY] == want.address
        assert_decode_matches(reference_generate(oracle, model.reference.ids), result.tokens, result.logits)


def test_quantized_gguf_files_round_trip_exactly(tmp_path, zoo) -> None:
    """A Q8_0 / Q4_0 GGUF read with dtype='q8_0' / 'q4_0' keeps the file's values: re-quantizing them is lossless."""
    from yirage.models.gguf_export import export_gguf
    from yirage.models.llama import LlamaModel

    model = zoo("llama-gqa")  # its q/k rows are permuted in the file and restored on load: whole rows, whole blocks
    for fmt in FORMATS:
        path = export_gguf(tmp_path / f"m-{fmt}.gguf", model.oracle.config, model.oracle.state_dict(), fmt.upper())
        floats, blocks = LlamaModel.from_gguf(path), LlamaModel.from_gguf(path, dtype=fmt)
        for name in ("qkv", "o", "gate_up", "down"):
            torch.testing.assert_close(blocks.blocks[1][name].dequantize(), floats.blocks[1][name], rtol=0, atol=0)
        torch.testing.assert_close(blocks.lm_head.dequantize(), floats.lm_head, rtol=0, atol=0)


def test_backends_that_cannot_read_blocks_refuse_them_at_attach() -> None:
    from yirage.backend.selection import registry

    refusing = [b.value for b in yr.get_available_backends()
                if "q8_0" not in registry().get(b.value).persistent_weight_formats]
    if not refusing:
        pytest.skip("every available backend reads quantized weights")
    step, tokens = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 8, dtype=torch.int64)
    pk = yr.PersistentKernel(max_seq_length=8, meta_tensors=[step, tokens], backend=refusing[0])
    with pytest.raises(NotSupportedError, match=r"does not read q8_0 weights.*use a backend that does \(.*cpu.*\)"):
        pk.attach_input(quantize(torch.randn(64, 32), "q8_0"), "w")


def test_quantized_blocks_are_only_for_matrices() -> None:
    step, tokens = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 8, dtype=torch.int64)
    pk = yr.PersistentKernel(max_seq_length=8, meta_tensors=[step, tokens], backend="reference")
    norm = pk.attach_input(quantize(torch.randn(1, 32), "q8_0"), "norm")
    weight = pk.attach_input(quantize(torch.randn(64, 32), "q8_0"), "w")
    x = pk.new_tensor((1, 32), name="x")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(torch.randn(64, 32), "embed"), x)
    with pytest.raises(LayerError, match="quantized blocks are for matrices"):
        pk.rmsnorm_linear_layer(x, norm, weight, pk.new_tensor((1, 64), name="y"))


def test_blocks_read_outside_the_cpu_kernel_stay_exact() -> None:
    """dequantize() over any leading shape is the blocks' values (the torch prefill and the reference use it)."""
    w = quantize(awkward_matrix(SEED), "q4_0")
    flat = dequantize(w.blocks.view(2, 12, -1), "q4_0", 96)
    torch.testing.assert_close(flat.view(24, 96), w.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("groups", (False, True), ids=("rows", "q4-groups"))
@pytest.mark.parametrize("f16c", (True, False), ids=("f16c", "integer-widening"))
def test_every_half_scale_widens_exactly(f16c, groups, monkeypatch) -> None:
    """All 65536 half bit patterns as block scales, through both widenings quant_dot can compile (F16C, and the
    integer one hosts without F16C get): each row is one Q8_0 block (or one Q4_0 block in the runtime's 8-row
    groups, which widen 8 scales at once) of quants 1 dotted with x = 1, so it must be exactly 32 * d in float32
    (inf stays inf, NaN stays NaN, subnormal halves keep their value)."""
    need_cpu()
    from numba import njit
    from yirage_backend_cpu import quant_dot

    if f16c and not quant_dot.F16C:
        pytest.skip("this host has no F16C")
    monkeypatch.setattr(quant_dot, "F16C", f16c)  # read when the intrinsic is compiled, below

    @njit(cache=False)
    def rows(xq, dx, blocks, out):  # type: ignore[no-untyped-def]
        for r in range(out.shape[0]):
            out[r] = quant_dot.dot_q8_x16_row(xq.ctypes.data, dx.ctypes.data, blocks.ctypes.data + r * 34, 1)

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if groups:
        from yirage_backend_cpu import quant_group

        @njit(cache=False)
        def group_rows(xq, dx, packed, out):  # type: ignore[no-untyped-def]
            lo, hi, sums = (xq & 255).astype(np.uint8), (xq >> 8).astype(np.int8), np.zeros(1, np.int32)
            for g in range(out.shape[0] // 8):
                quant_group.dot_q4_group(lo.ctypes.data, hi.ctypes.data, sums.ctypes.data, dx.ctypes.data,
                                         packed.ctypes.data + g * 144, 1, out.ctypes.data + g * 32,
                                         packed.ctypes.data + packed.nbytes)

        blocks = np.full((1 << 16, 18), 0x99, np.uint8)  # every Q4_0 value 9 - 8 = +1
        blocks[:, :2] = bits.view(np.uint8).reshape(-1, 2)
        packed = quant_group.repack_q4_0(torch.from_numpy(blocks)).numpy()
        out = np.empty(1 << 16, np.float32)
        group_rows(np.ones(32, np.int16), np.ones(1, np.float32), packed, out)
    else:
        blocks = np.ones((1 << 16, 34), np.uint8)
        blocks[:, :2] = bits.view(np.uint8).reshape(-1, 2)
        out = np.empty(1 << 16, np.float32)
        rows(np.ones(32, np.int16), np.ones(1, np.float32), blocks, out)
    want = (bits.view(np.float16).astype(np.float64) * 32).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan], want[~nan])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("vnni", (True, False), ids=("vnni", "portable"))
def test_groups_take_int16_x_exactly_through_both_byte_dots(vnni, fmt, monkeypatch) -> None:
    """The group dots split int16 x into an unsigned low and a signed high byte (quant_group): through vpdpbusd
    and through the portable integer vectors hosts without VNNI compile, every block's integer sum must be the
    exact sum of q * x (q: the weight's integer value), here at int16's extremes (+-32767 in every block: the
    high byte's sign and the folded offset) and q's (-128 / -8), checked against float64 sums of the dequantized
    blocks."""
    need_cpu()
    from numba import njit
    from yirage_backend_cpu import quant_group

    if vnni and not quant_group.VNNI:
        pytest.skip("this host has no AVX-512 VNNI")
    monkeypatch.setattr(quant_group, "VNNI", vnni)  # read when the intrinsics are compiled, below

    @njit(cache=False)
    def rows(x, packed, n, nb, out, xlo, xhi, sums, dx, q8):  # type: ignore[no-untyped-def]
        ok = quant_group.quantize_x16_split(x.ctypes.data, nb, xlo.ctypes.data, xhi.ctypes.data, sums.ctypes.data,
                                            dx.ctypes.data)
        for g in range(n // 8):
            if q8:
                quant_group.dot_q8_group(xlo.ctypes.data, xhi.ctypes.data, sums.ctypes.data, dx.ctypes.data,
                                         packed.ctypes.data + g * nb * 272, nb, out.ctypes.data + g * 32, 0)
            else:
                quant_group.dot_q4_group(xlo.ctypes.data, xhi.ctypes.data, sums.ctypes.data, dx.ctypes.data,
                                         packed.ctypes.data + g * nb * 144, nb, out.ctypes.data + g * 32,
                                         packed.ctypes.data + packed.nbytes)
        return ok

    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    k, n = 96, 16
    w = quantize(torch.randn(n, k, generator=gen), fmt)
    w.blocks.view(n, -1, 34 if fmt == "q8_0" else 18)[0, 0, 2:] = 0x80 if fmt == "q8_0" else 0  # q = -128 / -8
    x = torch.randn(k, generator=gen)
    x[::32], x[1::32] = 5.0, -5.0  # each block's largest |x| twice, both signs: quants +-32767
    x[5] = -4.99
    packed = (quant_group.repack_q8_0 if fmt == "q8_0" else quant_group.repack_q4_0)(w.blocks).numpy()
    out = np.zeros(n, np.float32)
    scratch = (np.zeros(k, np.uint8), np.zeros(k, np.int8), np.zeros(k // 32, np.int32), np.zeros(k // 32, np.float32))
    assert rows(x.numpy(), packed, n, k // 32, out, *scratch, fmt == "q8_0") == 1
    bb = 34 if fmt == "q8_0" else 18
    xq = torch.round(x.double().view(-1, 32) / 5.0 * 32767).view(-1)  # the rounding the kernel does: an oracle
    sums = (w.dequantize().double().view(n, -1, 32) / w.blocks.view(n, -1, bb)[:, :, :2].contiguous()
            .view(torch.float16).double()).round()  # q, (n, blocks, 32)
    ints = (sums * xq.view(1, -1, 32)).sum(-1)  # exact: integers below 2^53
    scales = w.blocks.view(n, -1, bb)[:, :, :2].contiguous().view(torch.float16).double().squeeze(-1)
    ref = (ints * scales * (5.0 / 32767)).sum(-1)
    err = (torch.from_numpy(out).double() - ref).abs()
    bound = 1e-6 * (ints.abs() * scales.abs() * (5.0 / 32767)).sum(-1) + 1e-30
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g} against bound {float(bound.min()):.3g}"
