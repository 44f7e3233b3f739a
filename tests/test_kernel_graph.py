"""Kernel-graph API: building, validation errors, printing, hashing, JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import yirage as yr
from tests.conftest import unavailable_backend
from yirage.graph.ops import GraphError


def rms_linear() -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    x = g.new_input((8, 64), name="x")
    w = g.new_input((64, 32), strides=(1, 64), name="w")
    g.mark_output(g.silu(g.matmul(g.rms_norm(x, (64,)), w)))
    return g


def test_the_spec_example_runs_and_matches_torch() -> None:
    g = yr.new_kernel_graph(backend="cpu")
    X = g.new_input(dims=(16, 256), dtype=yr.float32)
    W = g.new_input(dims=(256, 96), dtype=yr.float32)
    D = g.rms_norm(X, normalized_shape=(256,))
    O = g.silu(g.matmul(D, W))  # noqa: E741 - the spec's names
    g.mark_output(O)
    x, w = torch.randn(16, 256), torch.randn(256, 96)
    (out,) = g(inputs=[x, w])
    expected = torch.nn.functional.silu(torch.nn.functional.rms_norm(x, (256,), eps=1e-6) @ w)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_tensors_carry_dims_and_dtype() -> None:
    g = yr.new_kernel_graph()
    x = g.new_input((2, 3, 4), dtype=yr.bfloat16)
    y = g.reduction(x, 1)
    assert (y.dims, y.dtype, y.num_dims, y.dim(-1)) == ((2, 1, 4), yr.bfloat16, 3, 4)
    assert g.matmul(g.new_input((5, 7)), g.new_input((3, 7, 2))).dims == (3, 5, 2)
    assert (x + x).dims == (2, 3, 4) and (g.new_input((4, 6)) @ g.new_input((6, 1))).dims == (4, 1)


@pytest.mark.parametrize(("build", "words"), [
    (lambda g: g.matmul(g.new_input((4, 8)), g.new_input((9, 2))), ["matmul", "K=8", "K=9"]),
    (lambda g: g.matmul(g.new_input((8,)), g.new_input((8, 2))), ["matmul", "at least 2 dims"]),
    (lambda g: g.add(g.new_input((4, 3)), g.new_input((5, 3))), ["add", "(4, 3)", "(5, 3)", "broadcast"]),
    (lambda g: g.add(g.new_input((4,)), g.new_input((4,), dtype=yr.float16)), ["add", "share one dtype"]),
    (lambda g: g.exp(g.new_input((4,), dtype=yr.int32)), ["exp", "floating-point", "int32"]),
    (lambda g: g.div(g.new_input((4,), dtype=yr.int64), g.new_input((4,), dtype=yr.int64)), ["div", "int64"]),
    (lambda g: g.reduction(g.new_input((4, 5)), 2), ["reduction", "dim=2", "rank 2"]),
    (lambda g: g.softmax(g.new_input((4, 5)), -3), ["softmax", "dim=-3"]),
    (lambda g: g.rms_norm(g.new_input((4, 5)), (4,)), ["rms_norm", "normalized_shape=(4,)", "(5,)"]),
    (lambda g: g.rms_norm(g.new_input((4, 5)), (5,), eps=-1.0), ["eps=-1.0"]),
    (lambda g: g.clamp(g.new_input((4,))), ["clamp", "min_val"]),
    (lambda g: g.clamp(g.new_input((4,)), 2.0, 1.0), ["greater than"]),
    (lambda g: g.clamp(g.new_input((4,), dtype=yr.int32), 0.5, 3), ["integers"]),
    (lambda g: g.clamp(g.new_input((4,), dtype=yr.int32), -5, 3e9), ["fit int32"]),
    (lambda g: g.clamp(g.new_input((4,)), float("nan"), 1.0), ["must be numbers"]),
    (lambda g: g.new_input((True, 3)), ["positive ints"]),
    (lambda g: g.embedding(g.new_input((4,)), g.new_input((10, 3))), ["embedding", "ids must be int"]),
    (lambda g: g.embedding(g.new_input((4,), dtype=yr.int64), g.new_input((10,))), ["table must be 2-D"]),
    (lambda g: g.rotary(g.new_input((2, 5)), g.new_input((2, 5)), g.new_input((2, 5))), ["rotary", "even"]),
    (lambda g: g.rotary(g.new_input((2, 4)), g.new_input((2, 2)), g.new_input((2, 4))), ["head dim 4"]),
    (lambda g: g.attention(g.new_input((1, 6, 8)), g.new_input((1, 4, 3, 8)), g.new_input((1, 4, 3, 8))),
     ["H=6", "H_kv=4"]),
    (lambda g: g.attention(g.new_input((1, 2, 8)), g.new_input((1, 2, 3, 8)), g.new_input((1, 2, 3, 8)),
                           g.new_input((2,), dtype=yr.int32)), ["lengths", "(1,)"]),
    (lambda g: g.new_input((4, 0)), ["positive ints"]),
    (lambda g: g.new_input((4, 5), strides=(1, 5)), ["dense layout"]),
    (lambda g: g.new_input((4, 5), strides=(5,)), ["one entry per dim"]),
])
def test_bad_ops_fail_at_build_time_naming_op_operands_and_expectation(build, words) -> None:
    g = yr.new_kernel_graph()
    with pytest.raises(GraphError) as err:
        build(g)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_an_unsupported_dtype_is_a_type_error_listing_the_supported_ones() -> None:
    with pytest.raises(TypeError, match=r"unsupported dtype 'complex64'; use one of yr\.float32, .*yr\.int64"):
        yr.new_kernel_graph().new_input((4,), dtype="complex64")


def test_tensors_of_another_graph_are_refused() -> None:
    g, h = yr.new_kernel_graph(), yr.new_kernel_graph()
    with pytest.raises(GraphError, match="another KernelGraph"):
        g.exp(h.new_input((3,)))
    with pytest.raises(GraphError, match="expected a yirage Tensor"):
        g.exp(torch.ones(3))


def test_graph_without_outputs_says_so() -> None:
    g = yr.new_kernel_graph()
    g.new_input((3,))
    with pytest.raises(GraphError, match="mark_output"):
        g(inputs=[torch.ones(3)], backend="cpu")


def test_an_unknown_backend_fails_when_the_graph_is_made() -> None:
    with pytest.raises(yr.UnknownBackendError, match="unknown backend 'warp'"):
        yr.new_kernel_graph(backend="warp")


def test_an_unavailable_backend_fails_when_the_graph_is_made() -> None:
    from yirage.backend.selection import registry

    name = unavailable_backend(registry())  # cuda where torch has no CUDA device, else another one
    with pytest.raises(yr.BackendUnavailableError, match=rf"backend {name!r} \(from new_kernel_graph.*is unavailable"):
        yr.new_kernel_graph(backend=name)


def test_a_backend_that_cannot_compile_yet_says_so() -> None:
    from yirage.compiler.lower import build_plan

    class NoCompile(yr.Backend):
        name = "nocompile"

        def probe(self) -> yr.Availability:
            return yr.Availability(True, "a test backend")

    g = rms_linear()
    with pytest.raises(yr.NotSupportedError, match="nocompile.*cannot compile kernel graphs yet"):
        NoCompile().compile(build_plan(g), g)


def test_printing_shows_every_op() -> None:
    text = str(rms_linear())
    assert "x = input(dims=(8, 64), dtype=float32)" in text
    assert "w = input(dims=(64, 32), dtype=float32, strides=(1, 64))" in text
    assert "rms_norm(x, eps=1e-06, normalized_shape=[64])  # (8, 64) float32" in text
    assert "matmul(t2, w)" in text and "outputs: t4" in text


def test_json_round_trip_and_stable_hash_across_processes() -> None:
    g = rms_linear()
    again = yr.KernelGraph.from_json(g.to_json())
    assert again == g and again.digest == g.digest
    code = (
        "import yirage as yr\n"
        "g = yr.new_kernel_graph()\n"
        "x = g.new_input((8, 64), name='x')\n"
        "w = g.new_input((64, 32), strides=(1, 64), name='w')\n"
        "g.mark_output(g.silu(g.matmul(g.rms_norm(x, (64,)), w)))\n"
        "print(g.digest)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == g.digest


def test_the_digest_changes_with_shape_dtype_layout_and_op() -> None:
    def build(dims=(8, 64), dtype=yr.float32, strides=(1, 64), op="silu") -> str:
        g = yr.new_kernel_graph()
        x = g.new_input(dims, dtype=dtype)
        w = g.new_input((dims[-1], 32), strides=strides, dtype=dtype)
        g.mark_output(getattr(g, op)(g.matmul(x, w)))
        return g.digest

    base = build()
    assert len({base, build(dims=(4, 64)), build(dtype=yr.float16), build(strides=None), build(op="gelu")}) == 5


def test_corrupted_json_is_refused_clearly() -> None:
    data = json.loads(rms_linear().to_json())
    data["nodes"][3]["dims"] = [8, 99]
    with pytest.raises(GraphError, match="disagree"):
        yr.KernelGraph.from_json(json.dumps(data))
    data = json.loads(rms_linear().to_json())
    data["nodes"][2]["op"] = "teleport"
    with pytest.raises(GraphError, match="unknown op 'teleport'"):
        yr.KernelGraph.from_json(data)
    with pytest.raises(GraphError, match="format"):
        yr.KernelGraph.from_json({"format": 99, "nodes": [], "outputs": []})
    for outputs in ([99], [-1], ["t0"]):
        data = json.loads(rms_linear().to_json())
        data["outputs"] = outputs
        with pytest.raises(GraphError, match="does not name a node"):
            yr.KernelGraph.from_json(data)
    data = json.loads(rms_linear().to_json())
    data["nodes"][2]["attrs"]["flavour"] = "x"
    with pytest.raises(GraphError, match="unknown attrs"):
        yr.KernelGraph.from_json(data)


def test_compiling_one_graph_from_many_threads_is_safe(tmp_path, monkeypatch) -> None:
    import threading

    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    errors: list[BaseException] = []
    seed = 1234
    gen = torch.Generator().manual_seed(seed)
    x, b = torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen)
    want = torch.nn.functional.silu(x.double() + b.double())  # float64 oracle, computed by torch directly

    def work() -> None:
        try:
            g = yr.new_kernel_graph()
            g.mark_output(g.silu(g.add(g.new_input((3, 40)), g.new_input((40,)))))
            (out,) = g(inputs=[x, b], backend="cpu")
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_requires_grad_inputs_run_without_autograd_and_say_so_once(monkeypatch) -> None:
    from yirage.runtime import executable

    monkeypatch.setattr(executable, "_grad_warned", False)
    g = yr.new_kernel_graph()
    g.mark_output(g.relu(g.new_input((3,))))
    x = torch.tensor([-1.0, 2.0, -3.0], requires_grad=True)
    with pytest.warns(UserWarning, match="do not propagate autograd") as caught:
        (out,) = g(inputs=[x], backend="cpu")
    assert caught[0].filename == __file__  # points at the caller, not at yirage's internals
    assert torch.equal(out, torch.tensor([0.0, 2.0, 0.0])) and not out.requires_grad


def test_graph_backend_defaults_to_the_process_default(isolated_selection) -> None:
    from yirage.backend.registry import Registry

    isolated_selection(Registry(environ={}))
    if not yr.is_backend_available("cpu"):
        pytest.skip("the cpu backend (numba) is unavailable here")
    yr.set_backend("reference")
    g = yr.new_kernel_graph()
    g.mark_output(g.exp(g.new_input((2,))))
    assert g.compile().backend.name == "reference"
    yr.set_backend("cpu")
    assert g.compile().backend.name == "cpu"
    assert g.compile("reference").backend.name == "reference"
