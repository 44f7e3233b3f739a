"""The cpu runtime's GEMV tile on float32, bf16 and f16 rows (float_dot's hand-written dot plus the scalar
tail), against float64 torch on the same widened weights: every K class (under a line, whole lines, a tail),
batch rows, task ranges, bias and residual epilogues, and torch's special values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import yirage as yr

pytest.importorskip("numba")
if not yr.is_backend_available("cpu"):
    pytest.skip("the cpu backend is not available", allow_module_level=True)

from yirage_backend_cpu import pk_tasks  # noqa: E402

SEED = 20261126
CODES = {torch.float32: pk_tasks.F32, torch.bfloat16: pk_tasks.BF16, torch.float16: pk_tasks.F16}
SENTINEL = -7.25


def run_tile(w: torch.Tensor, x: torch.Tensor, n0: int, n1: int, res: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """out (batch, n) filled with SENTINEL, then rows n0..n1 written by pk_tasks.linear."""
    batch, k = x.shape
    n = w.shape[0]
    out = np.full(batch * n, SENTINEL, np.float32)
    none = np.empty(0, np.float32)
    xs = x.contiguous().view(-1).numpy().copy()
    r = none if res is None else res.contiguous().view(-1).numpy()
    b = none if bias is None else bias.numpy()
    pk_tasks.linear(xs, batch, k, w.data_ptr(), CODES[w.dtype], n0, n1, out, n, r, b, np.zeros(4 * batch * k,
                                                                                             np.float32), 0)
    return torch.from_numpy(out).view(batch, n)


def expected(w: torch.Tensor, x: torch.Tensor, res: torch.Tensor | None, bias: torch.Tensor | None
             ) -> torch.Tensor:
    want = x.double() @ w.double().t()
    if bias is not None:
        want = want + bias.double()
    if res is not None:
        want = want + res.double()
    return want


def assert_rows(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    assert torch.equal(got.isnan(), want.isnan()), "NaN where torch has none, or the reverse"
    inf = want.isinf()
    assert torch.equal(got[inf].double(), want[inf]), "an infinite result differs from torch's"
    fin = want.isfinite()
    if not fin.any():
        return
    # float32 products and sums of K terms in another order: a few ulps of the sum of |terms| per term
    tol = 4e-7 * math.sqrt(k) * (1 + want[fin].abs().max().item())
    assert torch.allclose(got[fin].double(), want[fin], rtol=1e-5, atol=tol)


@pytest.mark.parametrize("dtype", list(CODES), ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("k", [1, 31, 32, 33, 64, 96, 577, 1543])
@pytest.mark.parametrize("batch", [3, 9])  # one row at a time; 2 x 4 tiles, a weight row x 4, and one left
def test_tile_rows_match_float64_on_the_widened_weights(dtype: torch.dtype, k: int, batch: int) -> None:
    print(f"seed {SEED + k}")
    gen = torch.Generator().manual_seed(SEED + k)
    n = 21
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(batch, k, generator=gen)
    res = torch.randn(batch, n, generator=gen)
    bias = torch.randn(n, generator=gen)
    n0, n1 = 5, 17  # a task's range: rows outside it stay untouched
    got = run_tile(w, x, n0, n1, res, bias)
    want = expected(w.float(), x, res, bias)
    assert_rows(got[:, n0:n1], want[:, n0:n1], k)
    assert bool((got[:, :n0] == SENTINEL).all() and (got[:, n1:] == SENTINEL).all()), "wrote outside its rows"
    assert_rows(run_tile(w, x, 0, n), expected(w.float(), x, None, None), k)


@pytest.mark.parametrize("dtype", list(CODES), ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("k", [40, 96])  # a tail and whole lines: specials in both parts
def test_tile_keeps_torchs_special_values(dtype: torch.dtype, k: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    n = 8
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(3, k, generator=gen)  # batch row 0 finite: the weights' specials show alone
    w[1, 3], w[2, k - 1], w[3, 0] = math.inf, math.nan, -math.inf  # inf in the lines, NaN in the tail (k = 40)
    w[4, 5], w[4, 6] = math.inf, -math.inf  # inf - inf within one row: NaN
    x[1, 7] = math.nan
    w[5] = 0.0
    x[2, 9] = math.inf  # 0 * inf: NaN in row 5 of batch row 2, +-inf elsewhere
    w = w.to(dtype)
    assert_rows(run_tile(w, x, 0, n), expected(w.float(), x, None, None), k)


@pytest.mark.parametrize("dtype", list(CODES), ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("batch", [4, 5, 8, 13])
@pytest.mark.parametrize("rows", [(0, 1), (3, 10), (2, 12)])  # one weight row; odd and even task ranges
def test_batch_rows_get_the_bits_of_one_row_decodes(dtype: torch.dtype, batch: int, rows: tuple[int, int]) -> None:
    """Batch decode computes each row with the batch-1 path's products and sums in its order: a sequence's
    logits (so its greedy tokens) do not depend on the batch it decodes in. And every result is right."""
    gen = torch.Generator().manual_seed(SEED + batch)
    k, n = 96 + 7, 12  # whole lines and a tail
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(batch, k, generator=gen)
    w[1, 4], x[batch - 1, 2] = math.inf, math.nan  # specials inside a tile
    n0, n1 = rows
    got = run_tile(w, x, n0, n1)
    assert_rows(got[:, n0:n1], expected(w.float(), x, None, None)[:, n0:n1], k)
    alone = torch.cat([run_tile(w, x[b:b + 1], n0, n1) for b in range(batch)])
    assert torch.equal(got[:, n0:n1].isnan(), alone[:, n0:n1].isnan())
    same = ~alone[:, n0:n1].isnan()
    assert torch.equal(got[:, n0:n1][same], alone[:, n0:n1][same]), "a batch row differs from its batch-1 bits"


def test_tile_fails_on_a_misread_widening() -> None:
    """The oracle tells bf16 from f16 bits: the same 16-bit weights read with the other code differ."""
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, 64, generator=gen)
    as_f16 = w.view(torch.float16)  # the same bits, declared f16
    got = run_tile(as_f16, x, 0, 6)
    with pytest.raises(AssertionError):
        assert_rows(got, expected(w.float(), x, None, None), 64)
