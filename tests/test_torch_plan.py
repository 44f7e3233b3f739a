"""The torch-device lowering (``yirage.codegen.torch_plan``) and the ``torch`` backend, beyond the kit.

The conformance kit runs the ``torch`` backend on every op and pattern; these tests cover what it does
not: the status checks' errors and messages, plans whose kernels are not the graph's ops one by one
(fused groups, hand-built plans in their own order), the IR's own semantics (ties and NaNs of max/min,
per-row loads), placement on another torch device (``meta``: no host read may happen there) and the
mixin a domestic backend inherits. Oracles: torch expressions in float64, written here.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys

import pytest
import torch

import yirage as yr
from yirage.backend import plugins
from yirage.backend.base import Backend
from yirage.backend.torch_stages import TORCH_LOWERING_DTYPES, TorchLoweringStages
from yirage.codegen.exprs import UnsupportedExprError
from yirage.codegen.torch_plan import TorchPlan, run_plan
from yirage.compiler.kernel_ir import (
    Buffer,
    Call,
    Const,
    KernelPlan,
    Load,
    Matmul,
    Pointwise,
    Reduction,
    Row,
    Var,
)
from yirage.compiler.lower import build_plan
from yirage.errors import NotSupportedError
from yirage.graph.dtypes import float32, int64
from yirage.graph.kernel_graph import contiguous_strides


def _buf(name: str, dims: tuple[int, ...], role: str, index: int = -1, dtype=float32) -> Buffer:
    return Buffer(name, dims, dtype, contiguous_strides(dims), role, index)


def _embedding_graph() -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    ids, table = g.new_input((2, 3), dtype=yr.int32), g.new_input((10, 4))
    g.mark_output(g.relu(g.embedding(ids, table)))
    return g


def _attention_graph() -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((3, 4, 8)), g.new_input((3, 2, 5, 8)), g.new_input((3, 2, 5, 8))
    g.mark_output(g.attention(q, k, v, g.new_input((3,), dtype=yr.int64)))
    return g


# -- status checks -------------------------------------------------------------------------------


def test_out_of_range_ids_raise_index_error_naming_the_first_bad_position() -> None:
    plan = build_plan(_embedding_graph())
    table = torch.randn(10, 4)
    for ids, pos in (([[1, 2, 3], [4, 10, 5]], 4), ([[-1, 2, 3], [4, 5, 99]], 0)):
        with pytest.raises(IndexError, match=rf"must lie in \[0, 10\); the id at flat position {pos} of input in0"):
            run_plan(plan, [torch.tensor(ids, dtype=torch.int32), table])
    good = torch.tensor([[0, 9, 3], [4, 4, 1]], dtype=torch.int32)
    (out,) = run_plan(plan, [good, table])
    torch.testing.assert_close(out, table.double()[good.long()].relu().float(), rtol=0, atol=0)


@pytest.mark.parametrize(("lengths", "pos", "value"), [([5, 0, 2], 1, 0), ([1, 5, 6], 2, 6), ([-3, 9, 1], 0, -3)])
def test_bad_attention_lengths_raise_value_error_naming_the_batch_and_length(lengths, pos, value) -> None:
    plan = build_plan(_attention_graph())
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 2, 5, 8, generator=gen), torch.randn(3, 2, 5, 8)
    with pytest.raises(ValueError, match=rf"must lie in \[1, 5\]; batch {pos} has length {value}$"):
        run_plan(plan, [q, k, v, torch.tensor(lengths)])


def test_cache_rows_past_the_length_are_never_read() -> None:
    """NaN and inf beyond each batch's length (stale cache rows) must not reach the output (0 * inf is NaN)."""
    plan = build_plan(_attention_graph())
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 2, 5, 8, generator=gen), torch.randn(3, 2, 5, 8)
    lengths = torch.tensor([2, 5, 3])
    k_bad, v_bad = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        k_bad[b, :, n:] = math.nan
        v_bad[b, :, n:] = math.inf
    (out,) = run_plan(plan, [q, k_bad, v_bad, lengths])
    want = torch.empty(3, 4, 8, dtype=torch.float64)
    for b, n in enumerate(lengths.tolist()):  # float64 oracle over the valid rows only, GQA: head h reads h // 2
        kk, vv = k[b, :, :n].double().repeat_interleave(2, 0), v[b, :, :n].double().repeat_interleave(2, 0)
        p = torch.softmax(torch.einsum("hd,hsd->hs", q[b].double(), kk) / math.sqrt(8), -1)
        want[b] = torch.einsum("hs,hsd->hd", p, vv)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


# -- plans that are not the graph op by op ---------------------------------------------------------


def test_a_fused_plan_matches_torch_op_by_op() -> None:
    """Fusion inlines exp into the matmul's prologue, RMSNorm into its row scale and silu + residual into its
    epilogue, and runs a reduction declared first after them: the plan's kernels, not the graph's ops."""
    g = yr.new_kernel_graph()
    x, w = g.new_input((2, 6, 16)), g.new_input((16, 12), strides=(1, 16))
    r, y = g.new_input((12,)), g.new_input((6, 16))
    total = g.reduction(g.mul(x, y), 1)  # declared first
    mm = g.add(g.silu(g.matmul(g.mul(g.rms_norm(x, (16,)), g.exp(y)), w)), r)
    g.mark_output(total)
    g.mark_output(mm)
    g.mark_output(g.softmax(mm, -1))
    plan = build_plan(g)
    kinds = [type(k).__name__ for k in plan.kernels]
    assert len(plan.kernels) < len(g.nodes) - len(g.inputs) and "Matmul" in kinds, plan
    matmul = next(k for k in plan.kernels if isinstance(k, Matmul))
    assert matmul.row_scale is not None and not isinstance(matmul.a, Load) and isinstance(matmul.epilogue, Call), plan
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 6, 16, generator=gen), torch.randn(12, 16, generator=gen).t(), torch.randn(12, generator=gen),
          torch.randn(6, 16, generator=gen)]
    got = run_plan(plan, xs)
    X, W, R, Y = (t.double() for t in xs)
    rms = X * torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + 1e-6)
    want_mm = torch.nn.functional.silu((rms * Y.exp()) @ W) + R
    wants = [(X * Y).sum(1, keepdim=True), want_mm, torch.softmax(want_mm, -1)]
    for out, want in zip(got, wants, strict=True):
        assert out.dtype == torch.float32 and out.is_contiguous()
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_a_hand_built_plan_runs_in_its_own_order_with_ir_semantics() -> None:
    """Kernels in an order no graph lowering gives, a per-row output that loads a buffer, max/min ties
    and NaNs (first operand on ties, NaN from either side), a folded constant call and rotate_half over
    a broadcast buffer."""
    buffers = {b.name: b for b in [
        _buf("in0", (3, 4), "input", 0), _buf("in1", (4,), "input", 1), _buf("in2", (1, 4), "input", 2),
        _buf("tmp", (3, 4), "temp"), _buf("out0", (3, 1), "output", 0), _buf("out1", (3, 4), "output", 1),
        _buf("out2", (3, 4), "output", 2),
    ]}
    kernels = [
        # out1 first: max(in0, in1) with ties and NaNs, then min with a folded constant 2 * 1.5 = 3
        Pointwise("k0", "out1", (3, 4), Call("min", (Call("max", (Load("in0"), Load("in1"))),
                                                      Call("mul", (Const(2.0), Const(1.5)))))),
        Pointwise("k1", "tmp", (3, 4), Call("add", (Load("in0"), Load("in2", rotate_half=True)))),
        Row("k2", "out0", (3, 4), 1, (Reduction("s", "sum", Load("tmp")),), Call("mul", (Var("s"), Load("in2"))),
            per_row=True),
        Pointwise("k3", "out2", (3, 4), Load("tmp")),
    ]
    plan = KernelPlan("hand", buffers, kernels, ["in0", "in1", "in2"], ["out0", "out1", "out2"])
    a = torch.tensor([[0.0, -0.0, math.nan, 1.0], [5.0, -1.0, 2.0, math.nan], [-0.0, 0.0, 4.0, -7.0]])
    b = torch.tensor([-0.0, 0.0, 1.0, math.nan])
    c = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out0, out1, out2 = run_plan(plan, [a, b, c])
    want1 = torch.tensor([[0.0, -0.0, math.nan, math.nan], [3.0, 0.0, 2.0, math.nan], [-0.0, 0.0, 3.0, math.nan]])
    assert torch.equal(out1.isnan(), want1.isnan())
    assert torch.equal(torch.nan_to_num(out1), torch.nan_to_num(want1))
    assert torch.equal(torch.signbit(out1), torch.signbit(want1)), "ties must keep the first operand (signed zeros)"
    rotated = torch.tensor([[-3.0, -4.0, 1.0, 2.0]], dtype=torch.float64)  # rotate_half(in2), broadcast over rows
    tmp = a.double() + rotated
    assert torch.equal(out2.isnan(), tmp.isnan())
    assert torch.equal(torch.nan_to_num(out2.double()), torch.nan_to_num(tmp))
    want0 = tmp.sum(1, keepdim=True) * 1.0  # the per-row output reads in2 at index 0 of the reduced axis
    assert torch.equal(out0.isnan(), want0.isnan())
    torch.testing.assert_close(torch.nan_to_num(out0.double()), torch.nan_to_num(want0))
    assert out2.data_ptr() != a.data_ptr()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_kernel_folded_to_a_constant_fills_its_output_on_the_calls_device(device: str) -> None:
    buffers = {"in0": _buf("in0", (2, 3), "input", 0), "out0": _buf("out0", (2, 3), "output", 0),
               "out1": _buf("out1", (2, 3), "output", 1)}
    kernels = [Pointwise("k0", "out0", (2, 3), Call("sqrt", (Call("add", (Const(7.0), Const(2.0))),))),
               Row("k1", "out1", (2, 3), 1, (Reduction("s", "sum", Const(0.5)),), Call("mul", (Var("s"), Load("in0"))),
                   per_row=False)]
    out0, out1 = run_plan(KernelPlan("const", buffers, kernels, ["in0"], ["out0", "out1"]),
                          [torch.ones(2, 3, device=device)], device=device)
    assert out0.device.type == out1.device.type == device and out0.shape == out1.shape == (2, 3)
    if device == "cpu":
        assert torch.equal(out0, torch.full((2, 3), 3.0)) and torch.equal(out1, torch.full((2, 3), 1.5))


def test_an_ir_function_it_cannot_compute_is_named() -> None:
    buffers = {"in0": _buf("in0", (4,), "input", 0), "out0": _buf("out0", (4,), "output", 0)}
    plan = KernelPlan("bad", buffers, [Pointwise("k0", "out0", (4,), Call("tanh", (Load("in0"),)))], ["in0"], ["out0"])
    with pytest.raises(UnsupportedExprError, match="'tanh'.*torch_plan.py"):
        TorchPlan(plan)


def test_wrong_inputs_are_refused_with_what_was_expected() -> None:
    plan = build_plan(_embedding_graph())
    runner = TorchPlan(plan)
    with pytest.raises(ValueError, match="2 input"):
        runner([torch.zeros(2, 3, dtype=torch.int32)])
    with pytest.raises(ValueError, match=r"input 1 \(in1\).*\(10, 4\) float32 on cpu"):
        runner([torch.zeros(2, 3, dtype=torch.int32), torch.zeros(10, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"input 0 \(in0\) .* is .* on meta"):
        runner([torch.zeros(2, 3, dtype=torch.int32, device="meta"), torch.zeros(10, 4)])


# -- placement -------------------------------------------------------------------------------------


def test_on_meta_a_plan_without_status_checks_makes_meta_outputs() -> None:
    """Meta tensors have no data, so any host read (``.item()``, ``bool(t)``) raises: none may happen."""
    g = yr.new_kernel_graph()
    x, w, c = (g.new_input(dims, dtype=yr.bfloat16) for dims in ((4, 32), (32, 8), (4, 8)))
    h = g.matmul(g.rms_norm(x, (32,)), w)
    g.mark_output(g.softmax(g.add(h, c), -1))
    g.mark_output(g.reduction(h, 0))
    g.mark_output(g.rotary(h, c, c))
    g.mark_output(x)
    plan = build_plan(g)
    inputs = [torch.empty(dims, dtype=torch.bfloat16, device="meta") for dims in ((4, 32), (32, 8), (4, 8))]
    outs = run_plan(plan, inputs, device="meta")
    assert [(o.device.type, tuple(o.shape), o.dtype) for o in outs] == [
        ("meta", (4, 8), torch.bfloat16), ("meta", (1, 8), torch.bfloat16), ("meta", (4, 8), torch.bfloat16),
        ("meta", (4, 32), torch.bfloat16)]


@pytest.mark.parametrize("graph", [_embedding_graph, _attention_graph])
def test_on_meta_a_plan_with_a_status_check_is_refused_up_front(graph) -> None:
    with pytest.raises(NotSupportedError, match=r"meta device: kernel\(s\) k0 .*host read.*'cpu'"):
        TorchPlan(build_plan(graph()), "meta")


class _MetaLowering(TorchLoweringStages, Backend):
    """What a domestic backend does: the mixin first, its own device."""

    name = "metatest"
    torch_device = "meta"

    def probe(self):
        return yr.Availability(True, "test")


def test_the_mixin_compiles_for_the_backends_own_device() -> None:
    g = yr.new_kernel_graph()
    g.mark_output(g.gelu(g.new_input((3, 5), dtype=yr.float16)))
    backend = _MetaLowering()
    assert backend.kernel_dtypes == TORCH_LOWERING_DTYPES == frozenset(
        {"float32", "float16", "bfloat16", "float64", "int32", "int64"})
    run = backend.compile(build_plan(g), g)
    (out,) = run([torch.empty(3, 5, dtype=torch.float16, device="meta")])
    assert out.is_meta and out.dtype == torch.float16


# -- the torch backend -----------------------------------------------------------------------------


@pytest.fixture
def torch_backend_class(monkeypatch: pytest.MonkeyPatch) -> type[Backend]:
    """``TorchBackend``, imported without registering it for the rest of the session where yirage does not yet.

    Importing the module registers the core plugin (``install_core_plugin``); in a test run where
    ``yirage/__init__.py`` does not import it, that would add ``torch`` to every later registry.
    """
    monkeypatch.setattr(plugins, "_core_plugins", list(plugins._core_plugins))
    return importlib.import_module("yirage.backend.torch_backend").TorchBackend


def test_the_torch_backend_is_an_unfused_fallback_that_auto_passes_over(torch_backend_class) -> None:
    TorchBackend = torch_backend_class  # noqa: N806 - the class under its own name
    backend = TorchBackend()
    avail = backend.availability()
    assert avail.ok and not avail.auto and "unfused" in avail.reason
    assert 0 < TorchBackend.priority < 20 and TorchBackend.torch_device == "cpu"
    assert TorchBackend.kernel_dtypes == TORCH_LOWERING_DTYPES
    g = yr.new_kernel_graph()
    a, b = g.new_input((2, 3), dtype=yr.int64), g.new_input((3,), dtype=yr.int64)
    g.mark_output(g.clamp(g.mul(a, b), -5, 5))
    x, y = torch.tensor([[1, -2, 3], [4, 5, -6]]), torch.tensor([3, 2, -1])
    (out,) = backend.compile(build_plan(g), g)([x, y])
    assert out.dtype == torch.int64 and torch.equal(out, (x * y).clamp(-5, 5))


def test_importing_the_backend_module_does_not_import_torch() -> None:
    code = "import sys, yirage.backend.torch_backend, yirage.backend.torch_stages; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_int64_buffers_keep_their_dtype_through_temps() -> None:
    buffers = {b.name: b for b in [_buf("in0", (2, 3), "input", 0, int64), _buf("t", (2, 3), "temp", dtype=int64),
                                   _buf("out0", (2, 1), "output", 0, int64)]}
    kernels = [Pointwise("k0", "t", (2, 3), Call("square", (Load("in0"),))),
               Row("k1", "out0", (2, 3), 1, (Reduction("r", "sum", Load("t")),), Var("r"), per_row=True)]
    x = torch.tensor([[2**31, 1, 2], [3, -4, 5]])
    (out,) = run_plan(KernelPlan("ints", buffers, kernels, ["in0"], ["out0"]), [x])
    assert out.dtype == torch.int64 and torch.equal(out, (x * x).sum(1, keepdim=True))
