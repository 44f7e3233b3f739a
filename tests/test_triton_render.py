"""The Triton renderer: sound module structure, masked memory access, clear refusals, the triton backend's probe.

Structure checks parse the rendered module with ``ast`` and hold it to the
plan and the launch list (no string snapshots). A few hand graphs run in
Triton's interpreter against torch here (cheap); the whole conformance kit
runs on the interpreter in ``make triton-interpret``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.codegen.exprs import UnsupportedExprError
from yirage.codegen.triton import render_triton
from yirage.compiler.kernel_ir import Call, KernelPlan, Load, Pointwise
from yirage.compiler.lower import build_plan
from yirage.testing.oracle import assert_matches_torch, random_inputs
from yirage.testing.plugin import RANDOM_GRAPHS
from yirage.testing.random_graphs import seeded_graph


def _hand_graphs() -> dict[str, yr.KernelGraph]:
    graphs = {}
    g = yr.new_kernel_graph()
    x, w, r = g.new_input((20, 32)), g.new_input((32, 24), strides=(1, 32)), g.new_input((20, 24))
    g.mark_output(g.add(g.silu(g.matmul(g.rms_norm(x, (32,)), w)), r))
    graphs["rms_matmul_dot"] = g
    g = yr.new_kernel_graph()
    x, w = g.new_input((3, 40), dtype=yr.bfloat16), g.new_input((40, 70), dtype=yr.bfloat16)
    g.mark_output(g.matmul(g.rms_norm(x, (40,)), w))
    graphs["rms_gemv_bf16"] = g
    g = yr.new_kernel_graph()
    a, b = g.new_input((1, 2, 8)), g.new_input((3, 8, 5))
    g.mark_output(g.matmul(g.exp(a), b))
    graphs["batched_prologue"] = g
    g = yr.new_kernel_graph()
    x, cos, sin = (g.new_input((4, 16)) for _ in range(3))
    g.mark_output(g.softmax(g.rotary(x, cos, sin), -1))
    g.mark_output(g.reduction(g.new_input((3, 5, 7)), 1))
    g.mark_output(g.softmax(g.new_input((4, 50)), 0))
    graphs["rows"] = g
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((2, 8, 16)), g.new_input((2, 2, 12, 16)), g.new_input((2, 2, 12, 16))
    g.mark_output(g.attention(q, k, v, g.new_input((2,), dtype=yr.int32)))
    g.mark_output(g.embedding(g.new_input((2, 5), dtype=yr.int64), g.new_input((50, 24), dtype=yr.float16)))
    graphs["attention_embedding"] = g
    g = yr.new_kernel_graph()
    a, b = g.new_input((6, 5), dtype=yr.int64), g.new_input((5,), dtype=yr.int64)
    g.mark_output(g.clamp(g.relu(g.sub(g.mul(a, b), g.square(b))), 0, 20))
    g.mark_output(g.reduction(g.add(a, b), 0))
    graphs["integers"] = g
    g = yr.new_kernel_graph()
    x = g.new_input((3, 70), dtype=yr.float64)
    g.mark_output(g.pow(g.sqrt(x), g.gelu(x)))
    graphs["float64"] = g
    return graphs


PLANS: dict[str, KernelPlan] = {name: build_plan(g) for name, g in _hand_graphs().items()}
PLANS.update({f"seeded_graph({s})": build_plan(seeded_graph(s)) for s in range(RANDOM_GRAPHS)})


def _kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Functions decorated with ``@triton.jit`` in the rendered module."""
    return {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)
            and any(ast.unparse(d) == "triton.jit" for d in f.decorator_list)}


def _vector_names(fn: ast.FunctionDef) -> set[str]:
    """Names whose value derives from ``tl.arange`` (index vectors and what is computed from them)."""
    vectors: set[str] = set()
    changed = True
    while changed:
        changed = False
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, text = node.targets[0].id, ast.unparse(node.value)
                used = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                if target not in vectors and ("tl.arange" in text or used & vectors):
                    vectors.add(target)
                    changed = True
    return vectors


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_launch_names_a_jit_kernel_whose_parameters_match(name: str) -> None:
    plan = PLANS[name]
    rendered = render_triton(plan)
    tree = ast.parse(rendered.source)  # valid Python
    kernels = _kernels(tree)
    assert [x.kernel for x in rendered.launches] == [k.name for k in plan.kernels], "one launch per plan kernel"
    scratch = {s.name for s in rendered.scratch}
    for launch, k in zip(rendered.launches, plan.kernels, strict=True):
        fn = kernels[launch.kernel]
        params = [a.arg for a in fn.args.args]
        constexprs = [a.arg for a in fn.args.args if a.annotation is not None
                      and ast.unparse(a.annotation) == "tl.constexpr"]
        assert params == [f"p_{a}" for a in launch.args] + list(launch.params), f"{launch.kernel}: parameters"
        assert constexprs == list(launch.params), "block sizes are constexpr parameters, given at launch"
        assert all(v >= 1 and v & (v - 1) == 0 for v in launch.params.values()), "tl.arange needs powers of 2"
        assert launch.args[0] == k.out and set(k.reads()) <= set(launch.args)
        assert all(a in plan.buffers or a in scratch for a in launch.args)
        assert len(launch.grid) == 1 and launch.grid[0] >= 1
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    defined = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert called <= defined | {"float", "range"}, f"calls to undefined helpers: {called - defined}"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_load_and_store_over_an_index_vector_is_masked(name: str) -> None:
    """A vector of addresses past a tensor's end must never be dereferenced: the mask keeps lanes in bounds."""
    tree = ast.parse(render_triton(PLANS[name]).source)
    for fn in _kernels(tree).values():
        vectors = _vector_names(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("tl.load", "tl.store"):
                pointer = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
                if pointer & vectors:
                    assert any(kw.arg == "mask" for kw in node.keywords), (
                        f"{fn.name}: unmasked {ast.unparse(node)}")


def test_float_only_functions_on_integers_are_refused_before_rendering() -> None:
    plan = PLANS["integers"]
    a = next(b for b in plan.buffers.values() if b.role == "input")
    out = next(b for b in plan.buffers.values() if b.role == "output" and b.dims == a.dims)
    bad = KernelPlan(plan.digest, plan.buffers, [Pointwise("k0", out.name, out.dims, Call("exp", (Load(a.name),)))],
                     plan.inputs, plan.outputs)
    with pytest.raises(UnsupportedExprError, match=r"Triton renderer has no integer spelling of exp.*float dtype"):
        render_triton(bad)


def test_an_unknown_ir_function_is_a_clear_error_not_a_keyerror() -> None:
    plan = PLANS["float64"]
    x = next(b for b in plan.buffers.values() if b.role == "input")
    out = next(b for b in plan.buffers.values() if b.role == "output")
    bad = KernelPlan(plan.digest, plan.buffers, [Pointwise("k0", out.name, out.dims, Call("tanh", (Load(x.name),)))],
                     plan.inputs, plan.outputs)
    with pytest.raises(UnsupportedExprError, match=r"Triton renderer has no spelling for the IR function 'tanh'"):
        render_triton(bad)


def test_float64_constants_keep_every_bit() -> None:
    """Triton 3.0 types a bare Python float as float32: 0.1 must not reach a float64 kernel that way."""
    g = yr.new_kernel_graph()
    g.mark_output(g.clamp(g.new_input((4,), dtype=yr.float64), min_val=0.1))
    source = render_triton(build_plan(g)).source
    assert "tl.full([], 0.1, tl.float64)" in source


def test_import_yirage_and_the_renderer_does_not_import_triton() -> None:
    """Importing yirage and the Triton renderer never imports triton; listing the backends imports it only where
    the triton backend's probe must (a GPU is visible: it checks that triton imports there, to tell the truth)."""
    code = ("import sys, yirage, yirage.codegen.triton, yirage.backend.triton_stages\n"
            "assert 'triton' not in sys.modules, 'triton imported by import yirage / the renderer'\n"
            "yirage.get_available_backends()\n"
            "import torch\n"
            "assert torch.cuda.is_available() or 'triton' not in sys.modules, 'triton imported without a GPU'\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr


# -- the triton backend's probe and a few graphs in Triton's interpreter -----------------------------------------

triton = pytest.importorskip("triton", reason="triton is not installed: pip install 'yirage-backend-triton[triton]'")
#: Triton's interpreter must be switched on before triton is imported (its library functions are jit'd at import)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 from the process start: "
                                      "make triton-interpret")


def test_probe_without_a_gpu_or_the_interpreter_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import yirage_backend_triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    avail = yirage_backend_triton.TritonBackend().probe()
    assert not avail.ok and "TRITON_INTERPRET=1" in avail.reason and "GPU" in avail.reason


def test_probe_without_triton_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import yirage_backend_triton

    monkeypatch.setattr(yirage_backend_triton, "module_installed", lambda name: False)
    avail = yirage_backend_triton.TritonBackend().probe()
    assert not avail.ok and "pip install 'yirage-backend-triton[triton]'" in avail.reason


@pytest.mark.skipif(INTERPRETING, reason="triton was imported in interpreter mode")
def test_interpreter_switched_on_too_late_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import yirage_backend_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    avail = yirage_backend_triton.TritonBackend().probe()
    assert not avail.ok and "before Python starts" in avail.reason


SMOKE = """
import torch, torch.nn.functional as F, yirage as yr
from yirage.testing.oracle import assert_matches_torch, random_inputs
info = yr.get_backend_info("triton")
assert info["available"] and not info["auto"] and info["torch_device"] == "cpu", info
g = yr.new_kernel_graph()
x, w, r = g.new_input((20, 32)), g.new_input((32, 24), strides=(1, 32)), g.new_input((20, 24))
g.mark_output(g.softmax(g.add(g.silu(g.matmul(g.rms_norm(x, (32,)), w)), r), -1))
rms = lambda x: F.rms_norm(x, (32,), eps=1e-6)
assert_matches_torch(g, random_inputs(g, seed=3), "triton", lambda x, w, r: torch.softmax(F.silu(rms(x) @ w) + r, -1))
print("ok")
"""


def test_a_fused_graph_runs_in_tritons_interpreter_like_torch() -> None:
    """RMSNorm -> matmul (tl.dot) -> silu + residual -> softmax, interpreted on CPU tensors (a fresh process:
    TRITON_INTERPRET=1 must be set before triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SMOKE], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@interpreter_only
def test_interpreter_mode_is_available_on_cpu_tensors_but_never_auto() -> None:
    from yirage.backend.selection import registry

    backend = registry().get("triton")
    avail = backend.availability()
    assert avail.ok and not avail.auto and "interpreter" in avail.reason
    assert backend.torch_device == "cpu" and backend.device_kind == "cpu"  # auto passes over it whatever its priority
    assert backend.target().endswith("|interpreter") and triton.__version__ in backend.fingerprint()


@interpreter_only
def test_fused_rms_norm_bf16_gemv() -> None:
    g = _hand_graphs()["rms_gemv_bf16"]
    assert_matches_torch(g, random_inputs(g, seed=3), "triton", lambda x, w: F.rms_norm(x, (40,), eps=1e-6) @ w,
                         scale=lambda x, w: F.rms_norm(x, (40,), eps=1e-6).abs() @ w.abs())


@interpreter_only
def test_attention_lengths_and_embedding_ids_are_checked() -> None:
    g = yr.new_kernel_graph()
    ids, table = g.new_input((4,), dtype=yr.int32), g.new_input((10, 8))
    g.mark_output(g.embedding(ids, table))
    with pytest.raises(IndexError, match=r"ids must lie in \[0, 10\); the id at flat position 2"):
        g(inputs=[torch.tensor([1, 2, 10, 3], dtype=torch.int32), torch.randn(10, 8)], backend="triton")
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((1, 2, 8)), g.new_input((1, 2, 4, 8)), g.new_input((1, 2, 4, 8))
    g.mark_output(g.attention(q, k, v, g.new_input((1,), dtype=yr.int64)))
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 4\]; batch 0 has length 5"):
        g(inputs=[torch.randn(1, 2, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.tensor([5])],
          backend="triton")


@interpreter_only
def test_other_block_sizes_give_the_same_results(tmp_path) -> None:
    """Block sizes are launch data (for autotuning): smaller ones take the looping paths, same answers."""
    from yirage.backend.selection import registry
    from yirage.backend.triton_stages import TritonProgram, _import

    backend = registry().get("triton")
    g = yr.new_kernel_graph()
    x, w = g.new_input((20, 40)), g.new_input((40, 24))
    g.mark_output(g.softmax(x, -1))
    g.mark_output(g.matmul(x, w))
    g.mark_output(g.matmul(g.new_input((2, 40)), w))
    path = backend.build(backend.render(build_plan(g)), tmp_path)
    inputs = random_inputs(g, seed=5)
    want = [torch.softmax(inputs[0], -1), inputs[0] @ inputs[1], inputs[2] @ inputs[1]]
    program = TritonProgram(_import(path, "blocks_test"), "cpu")
    program.launches = [(kernel, replace(x, constexprs=tuple((n, 16) for n, _ in x.constexprs)))
                        for kernel, x in program.launches]
    for got, expect in zip(program(inputs), want, strict=True):
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@interpreter_only
def test_every_block_size_the_triton_knobs_offer_computes_the_graph() -> None:
    """The ``block`` (row) and ``block_n`` / ``block_k`` (gemv) knobs: every value a search may pick gives torch's
    float64 answer, on a row longer than the narrowest block and a product whose K and N are not block multiples."""
    from yirage.backend.selection import registry
    from yirage.compiler.lower import build_plan
    from yirage.compiler.schedule import check_knobs, with_schedule

    backend = registry().get("triton")
    g = yr.new_kernel_graph()
    x, w = g.new_input((2, 300)), g.new_input((300, 700))
    g.mark_output(g.softmax(g.matmul(x, w), -1))
    plan = build_plan(g)
    knobs = check_knobs(backend.schedule_knobs(plan), plan, "triton")
    assert sorted(k.name for k in knobs) == ["block", "block_k", "block_n"], knobs
    gen = torch.Generator().manual_seed(4)
    xs, ws = torch.randn(2, 300, generator=gen), torch.randn(300, 700, generator=gen) / 20
    want = (xs.double() @ ws.double()).softmax(-1)
    for column in range(max(len(k.values) for k in knobs)):
        schedule: dict[str, dict[str, Any]] = {}
        for k in knobs:
            schedule.setdefault(k.kernel, {})[k.name] = k.values[min(column, len(k.values) - 1)]
        (got,) = backend.compile(with_schedule(plan, schedule), g)([xs, ws])
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7, msg=str(schedule))
