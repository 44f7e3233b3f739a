"""The cpu backend's float semantics match torch's IEEE behaviour (issue 7, item 5).

Fast-math flags made ``silu(x)`` NaN for x <= -88.73 once a loop ran vectorized, ``3 / inf`` NaN and
``exp(nan)`` 0. These tests pin the helpers the kernels and the decode loop use (``fexp``, ``fsilu``,
``fmax``/``fmin``, ``argmax_row``, ``sample_row``, the GEMV tile) and the issue's own reproductions,
always against torch (or float64) as the oracle. The full matrix of ops x dtypes x shape classes is
the conformance kit's extreme-value cases (yirage/testing/extremes.py).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import yirage as yr

pytest.importorskip("numba")
if not yr.is_backend_available("cpu"):
    pytest.skip("the cpu backend is not available", allow_module_level=True)

from numba import njit  # noqa: E402
from yirage_backend_cpu import pk_tasks  # noqa: E402
from yirage_backend_cpu.kernel_lib import (  # noqa: E402
    FASTMATH,
    ferf,
    fexp,
    fgelu,
    float_to_bf16,
    float_to_half,
    fmax,
    fmin,
    fsilu,
    rfma,
    rmax,
)

INF, NAN = math.inf, math.nan
SPECIAL = [NAN, INF, -INF, 1e30, -1e30, -100.0, 100.0, 1e-40, 0.0, -0.0, -88.8, -90.0, 88.8, 1.5, -3.25]


@njit(fastmath=FASTMATH)
def _map_exp(x, out):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        out[i] = fexp(x[i])


@njit(fastmath=FASTMATH)
def _map_erf(x, out):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        out[i] = ferf(x[i])


@njit(fastmath=FASTMATH)
def _map_gelu(x, out):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        out[i] = fgelu(x[i])


@njit(fastmath=FASTMATH)
def _map_silu(x, out):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        out[i] = fsilu(x[i])


@njit(fastmath=FASTMATH)
def _map_swiglu(a, u, out):  # type: ignore[no-untyped-def]
    """The decode loop's SILURES activation, spelled as pk_runtime spells it."""
    for i in range(a.shape[0]):
        out[i] = a[i] / (np.float32(1.0) + fexp(-a[i])) * u[i]


@njit(fastmath=FASTMATH)
def _map_minmax(a, b, hi, lo):  # type: ignore[no-untyped-def]
    for i in range(a.shape[0]):
        hi[i] = fmax(a[i], b[i])
        lo[i] = fmin(a[i], b[i])


@njit(fastmath=FASTMATH)
def _dot(x, y):  # type: ignore[no-untyped-def]
    s = np.float32(0)
    for i in range(x.shape[0]):
        s = rfma(s, x[i], y[i])
    return s


@njit(fastmath=FASTMATH)
def _row_max(x):  # type: ignore[no-untyped-def]
    m = np.float32(-np.inf)
    for i in range(x.shape[0]):
        m = rmax(m, x[i])
    return m


def _same(got: np.ndarray | torch.Tensor, want: torch.Tensor, rtol: float = 2e-7, atol: float = 2e-45) -> None:
    """NaN where want has NaN, equal infinities, equal signs of zeros, finite values per-element close."""
    g, w = torch.as_tensor(got).double(), want.double()
    assert torch.equal(g.isnan(), w.isnan()), f"NaN positions differ: got {g.tolist()} want {w.tolist()}"
    m = ~w.isnan()
    assert torch.equal(torch.signbit(g[m]), torch.signbit(w[m])), f"signs differ: got {g.tolist()} want {w.tolist()}"
    inf = w.isinf()
    assert torch.equal(g[inf], w[inf]), f"infinities differ: got {g.tolist()} want {w.tolist()}"
    fin = m & ~inf
    assert torch.all((g[fin] - w[fin]).abs() <= atol + rtol * w[fin].abs()), f"got {g.tolist()} want {w.tolist()}"


def _tiled(n: int) -> np.ndarray:
    return np.resize(np.array(SPECIAL, np.float32), n)


def test_fastmath_holds_no_flag_that_changes_special_values() -> None:
    # reassoc and contract change special values too (a / d * b -> a * b / d overflows; an FMA keeps an
    # overflowing product finite): reductions opt in per instruction instead (racc/rfma/rmax)
    assert isinstance(FASTMATH, set) and not FASTMATH & {"fast", "nnan", "ninf", "nsz", "arcp", "afn", "reassoc",
                                                          "contract"}
    assert pk_tasks.OPTS["fastmath"] is FASTMATH


@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 64, 67, 1000])
def test_fexp_and_fsilu_special_values_at_every_width(n: int) -> None:
    x = _tiled(n)
    out = np.empty_like(x)
    _map_exp(x, out)
    _same(out, torch.exp(torch.from_numpy(x).double()).float(), rtol=2e-7, atol=1.5e-45)
    _map_silu(x, out)
    # float32 silu: -0.0 for x <= -88.73 (exp(-x) overflows), NaN for -inf and NaN, inf for inf; torch agrees
    _same(out, torch.nn.functional.silu(torch.from_numpy(x)), rtol=5e-7, atol=1.2e-38)


def test_fexp_matches_float64_over_the_whole_range() -> None:
    x = np.concatenate([np.linspace(-110, 90, 200_001, dtype=np.float32),
                        np.array([88.72283172607422, 88.72283935546875, -103.97208, -87.5], np.float32)])
    out = np.empty_like(x)
    _map_exp(x, out)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64)).astype(np.float32)  # float32 overflow and underflow, rounded once
    assert np.array_equal(np.isinf(out), np.isinf(want))
    fin = np.isfinite(want)
    normal = fin & (want >= np.finfo(np.float32).tiny)
    rel = np.abs(out[normal].astype(np.float64) - want[normal]) / want[normal]
    assert rel.max() < 2e-7
    assert np.abs(out[fin & ~normal].astype(np.float64) - want[fin & ~normal]).max() <= 2 ** -149  # denormals


def test_silu_in_the_decode_loop_survives_huge_negative_gates() -> None:
    gates = np.resize(np.array([-100.0, -1e30, -88.8, -1e4, 100.0, 1e30, 0.5], np.float32), 64)
    up = np.resize(np.array([2.0, -3.0, 1e30, 0.25], np.float32), 64)
    out = np.empty_like(gates)
    _map_swiglu(gates, up, out)
    a, u = torch.from_numpy(gates), torch.from_numpy(up)
    want = torch.nn.functional.silu(a) * u
    assert not np.isnan(out).any()
    _same(out, want, rtol=5e-7, atol=1.2e-38)


def test_fmax_fmin_propagate_nan_like_torch() -> None:
    a = np.array([NAN, 1.0, NAN, -0.0, 0.0, -INF, 2.0, 3.0], np.float32)
    b = np.array([1.0, NAN, NAN, 0.0, -0.0, 5.0, INF, -INF], np.float32)
    hi, lo = np.empty_like(a), np.empty_like(a)
    _map_minmax(a, b, hi, lo)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert torch.equal(torch.from_numpy(hi).isnan(), torch.maximum(ta, tb).isnan())
    assert torch.equal(torch.from_numpy(lo).isnan(), torch.minimum(ta, tb).isnan())
    m = ~torch.maximum(ta, tb).isnan()
    assert torch.equal(torch.from_numpy(hi)[m], torch.maximum(ta, tb)[m])
    assert torch.equal(torch.from_numpy(lo)[m], torch.minimum(ta, tb)[m])
    # a tie keeps the first operand, as torch.clamp keeps x: clamp(-0.0, min=0.0) is -0.0
    assert math.copysign(1.0, hi[3]) == math.copysign(1.0, torch.clamp(torch.tensor(-0.0), min=0.0).item())


def test_ferf_matches_float64_erf_and_gelu_matches_torch() -> None:
    """erf within 2 float32 ulps everywhere (both branches, the 0.875 and 4.0 seams, tiny and denormal x),
    +-1 at +-inf, NaN for NaN; GELU within torch's own float32 rounding of erf-based GELU."""
    x = np.concatenate([np.linspace(-6, 6, 400_001, dtype=np.float32),
                        np.array([0.875, -0.875, np.nextafter(np.float32(0.875), np.float32(0)), 4.0, -4.0,
                                  1e-30, -1e-30, 1e-40, 0.0, -0.0, 1e30, -1e30], np.float32)])
    out = np.empty_like(x)
    _map_erf(x, out)
    want = np.array([math.erf(v) for v in x.astype(np.float64)])
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert (np.abs(out - want) / ulp).max() <= 2.0, float((np.abs(out - want) / ulp).max())
    assert np.array_equal(np.signbit(out[x == 0]), np.signbit(x[x == 0]))  # erf(-0.0) is -0.0
    special = np.array([INF, -INF, NAN], np.float32)
    got = np.empty_like(special)
    _map_erf(special, got)
    assert got[0] == 1.0 and got[1] == -1.0 and math.isnan(got[2])
    gelu = np.empty_like(x)
    _map_gelu(x, gelu)
    theirs = torch.nn.functional.gelu(torch.from_numpy(x)).numpy().astype(np.float64)  # torch's float32 GELU
    # 0.5 * x * (1 + erf): a few ulps of the result, plus a few ulps of 1 times |x| where 1 + erf cancels
    bound = 1e-6 * np.abs(theirs) + np.abs(x.astype(np.float64)) * 2.0 ** -21
    assert bool((np.abs(gelu - theirs) <= bound).all()), float((np.abs(gelu - theirs) - bound).max())
    ir_text = "\n".join(_map_gelu.inspect_llvm().values())
    assert re.search(r"<(4|8|16) x float>", ir_text), "the GELU loop no longer vectorizes (a scalar erf call?)"


def test_reductions_still_vectorize_and_propagate_nan() -> None:
    gen = np.random.default_rng(0)
    x, y = gen.standard_normal(4096).astype(np.float32), gen.standard_normal(4096).astype(np.float32)
    assert abs(_dot(x, y) - float(np.dot(x.astype(np.float64), y))) < 1e-3
    assert _row_max(x) == x.max()
    x[100] = NAN
    assert math.isnan(_row_max(x)) and math.isnan(_dot(x, y))
    for fn in (_dot, _row_max):  # the loop vectorizer still turns both into vector code (no timing involved)
        ir_text = "\n".join(fn.inspect_llvm().values())
        assert re.search(r"<(4|8|16) x float>", ir_text), f"{fn.__name__} no longer vectorizes"


def test_argmax_row_matches_torch_argmax_with_nan_and_inf() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(50, generator=gen) for _ in range(6)]
    rows[1][[7, 30]] = NAN  # the first NaN wins
    rows[2][0] = NAN
    rows[3][[4, 9]] = INF  # the first of equal maxima wins
    rows[4][:] = -INF
    rows[5][[3, 40]] = 5.0
    for row in rows:
        logits = np.concatenate([np.zeros(3, np.float32), row.numpy()])  # base offset 3
        assert pk_tasks.argmax_row(logits, 3, 50) == int(torch.argmax(row))
    # seeded rows of every length around the 16-lane blocks, with specials dropped in, against torch
    seed = 20261123
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30], np.float32)
    for n in [*range(1, 70), 1000, 4099]:
        for _ in range(8):
            row = rng.standard_normal(n).astype(np.float32)
            for _ in range(int(rng.integers(0, 4))):
                row[rng.integers(0, n)] = specials[rng.integers(0, len(specials))]
            if rng.random() < 0.1:
                row[:] = -np.inf if rng.random() < 0.5 else row[0]
            logits = np.concatenate([np.zeros(3, np.float32), row])
            assert pk_tasks.argmax_row(logits, 3, n) == int(torch.argmax(torch.from_numpy(row))), row


def test_sample_row_never_draws_nan_and_handles_infinities() -> None:
    def draws(row: list[float], top_k: int = 0, top_p: float = 1.0) -> set[int]:
        logits = np.array(row, np.float32)
        return {int(pk_tasks.sample_row(logits, 0, len(row), 1.0, top_k, top_p, np.uint64(seed + 1)))
                for seed in range(200)}

    assert draws([NAN, 0.0, NAN, 1.0]) <= {1, 3}
    assert draws([0.0, INF, 3.0, INF]) == {1, 3}  # +inf logits take all the mass, shared equally
    assert draws([-INF, NAN, -INF, NAN]) == {1}  # nothing to draw from: argmax's pick (the first NaN)
    assert draws([-INF, -INF, -INF]) == {0}
    assert draws([NAN, 2.0, 1.0], top_k=1) == {1}


def test_the_sampling_picker_runs_behind_its_entry_point_and_argmax_needs_none() -> None:
    """pk_tasks.pick_rows samples through sample_entry (compiled apart, by address): the draws sample_row makes
    with the position-seeded state; with no entry point (0) a sampling layer picks -1, never a call to address
    0; an argmax layer needs no entry point."""
    from yirage_backend_cpu.pk_entry import compiled

    batch, vocab, layer = 3, 40, 0
    lp, lf = np.zeros((1, 32), np.int64), np.zeros((1, 4), np.float64)
    lp[layer, pk_tasks.C_KIND], lp[layer, pk_tasks.C_K] = pk_tasks.SAMPLE, vocab
    lp[layer, pk_tasks.C_SEED], lp[layer, pk_tasks.C_TOP_K] = 7, 11
    lf[layer, pk_tasks.F_TEMPERATURE], lf[layer, pk_tasks.F_TOP_P] = 0.7, 0.9
    logits = np.random.default_rng(3).standard_normal(batch * vocab).astype(np.float32)
    step = np.array([4, 9, 2], np.int64)

    def picks(address: int) -> list[int]:
        picked = np.full(batch, -5, np.int64)
        pk_tasks.pick_rows(lp, lf, layer, logits, step, picked, batch, address)
        return picked.tolist()

    want = [int(pk_tasks.sample_row(logits, b * vocab, vocab, 0.7, 11, 0.9,
                                    np.uint64(7 * 1000003 + int(step[b]) * 7919 + b * 104729 + 1)))
            for b in range(batch)]
    assert picks(int(compiled(pk_tasks.sample_entry).address)) == want
    assert picks(0) == [-1] * batch
    lp[layer, pk_tasks.C_KIND] = pk_tasks.ARGMAX
    assert picks(0) == [int(np.argmax(logits[b * vocab:(b + 1) * vocab])) for b in range(batch)]


def test_gemv_tile_propagates_special_values_like_torch() -> None:
    k, n = 67, 9
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(2, k, generator=gen)
    w[2, 5], w[4, 0], x[1, 7] = INF, NAN, -1e30
    out = np.full(2 * n, -7.0, np.float32)
    none = np.empty(0, np.float32)
    xs = x.flatten().numpy().copy()
    pk_tasks.linear(xs, 2, k, w.data_ptr(), pk_tasks.F32, 0, n, out, n, none, none, np.zeros(4 * k, np.float32), 0)
    want = x.double() @ w.double().t()
    got = torch.from_numpy(out).view(2, n)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[want.isinf()], want[want.isinf()].float())
    fin = want.isfinite()
    assert torch.allclose(got[fin].double(), want[fin], rtol=1e-5, atol=1e-4 * (1 + want[fin].abs().max().item()))


# -- the reproductions through compiled graphs ------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8), (1, 9), (1, 64), (4, 20000)])
def test_graph_silu_exp_div_special_values(shape: tuple[int, int]) -> None:
    g = yr.new_kernel_graph()
    x, y = g.new_input(shape), g.new_input(shape)
    g.mark_output(g.silu(x))
    g.mark_output(g.exp(x))
    g.mark_output(g.div(x, y))
    g.mark_output(g.relu(x))
    n = shape[0] * shape[1]
    tx = torch.from_numpy(_tiled(n)).view(shape)
    ty = torch.from_numpy(np.roll(_tiled(n), 5)).view(shape)
    silu, exp, div, relu = g(inputs=[tx, ty], backend="cpu")
    _same(silu, torch.nn.functional.silu(tx), rtol=5e-7, atol=1.2e-38)
    _same(exp, torch.exp(tx), rtol=5e-7, atol=1.5e-45)
    _same(div, tx / ty, rtol=0.0, atol=0.0)
    _same(relu, torch.relu(tx), rtol=0.0, atol=0.0)


def test_graph_fused_expressions_are_not_reassociated_or_contracted() -> None:
    # silu(-1e30) * 1e30 + inf is inf in torch; reassociated to (-1e30 * 1e30) / inf it was NaN.
    # 1e30 * 1e30 + (-inf) is NaN in torch (the product overflows); one FMA gave -inf.
    g = yr.new_kernel_graph()
    a, b, r = (g.new_input((1, 64)) for _ in range(3))
    g.mark_output(g.add(g.mul(g.silu(a), b), r))
    g.mark_output(g.add(g.mul(a, b), r))
    for ta, tb, tr in [(-1e30, 1e30, INF), (1e30, 1e30, -INF), (-100.0, -1e4, 3.0)]:
        inputs = [torch.full((1, 64), v) for v in (ta, tb, tr)]
        swiglu, fma = g(inputs=inputs, backend="cpu")
        _same(swiglu, torch.nn.functional.silu(inputs[0]) * inputs[1] + inputs[2])
        _same(fma, inputs[0] * inputs[1] + inputs[2])


def test_graph_softmax_rows_of_nan_and_infinities_match_torch() -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((5, 64))
    g.mark_output(g.softmax(x, -1))
    t = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    t[0, :] = -INF  # torch: NaN
    t[1, 3] = NAN
    t[2, 10] = INF
    t[3, 7] = -INF
    t[4, 1] = 1e30
    (out,) = g(inputs=[t], backend="cpu")
    _same(out, torch.softmax(t, -1), rtol=2e-6, atol=1.2e-38)


@njit(cache=False)
def _narrow_all(x, out_bf16, out_f16):  # type: ignore[no-untyped-def]
    for i in range(x.size):
        out_bf16[i] = float_to_bf16(x[i])
        out_f16[i] = float_to_half(x[i])


def test_16_bit_cache_stores_round_like_torch() -> None:
    """A 16-bit KV cache's stores (kernel_lib.float_to_bf16/float_to_half) give torch's bits for every kind of
    float32: ties both ways, the largest values that round up to inf, denormals, infinities and NaN."""
    rng = np.random.default_rng(29)
    bits = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
                           np.array([0x3F808000, 0x3F818000, 0x7F7F8000, 0x7F7FFFFF, 0x477FF000, 0x477FEFFF,
                                     0x00000001, 0x80000001, 0x33000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                                     0xFFC00001, 0x7F800001, 0x00000000, 0x80000000], np.uint32)])
    x = bits.view(np.float32)
    out_bf16, out_f16 = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    _narrow_all(x, out_bf16, out_f16)
    t = torch.from_numpy(x)
    want_bf16 = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    want_f16 = t.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(out_bf16[~nan], want_bf16[~nan])
    assert np.array_equal(out_f16[~nan], want_f16[~nan])
    # a NaN stays a NaN (its payload is the instruction set's)
    assert (((out_bf16[nan] & 0x7F80) == 0x7F80) & ((out_bf16[nan] & 0x7F) != 0)).all()
    assert (((out_f16[nan] & 0x7C00) == 0x7C00) & ((out_f16[nan] & 0x3FF) != 0)).all()
