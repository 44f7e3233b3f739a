"""The C-family renderer renders every kit-like plan in OpenCL C, CUDA, HIP and Metal, structurally sound.

No string snapshots: the checks parse what was rendered (kernel signatures
against the launch descriptions and the plan's buffers, barriers beside
local-memory reductions, braces) and hold it to the plan, which the renderer
does not produce. Whether the code computes the right thing is the
conformance kit's job on a backend that runs it (opencl on PoCL).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

import yirage as yr
from yirage.codegen.cstyle import Gemm, Launch, render
from yirage.codegen.dialect import Dialect
from yirage.codegen.dialects import dialect
from yirage.codegen.exprs import UnsupportedExprError
from yirage.compiler.kernel_ir import Attention, KernelPlan, Matmul, Row
from yirage.compiler.lower import build_plan
from yirage.testing.plugin import RANDOM_GRAPHS
from yirage.testing.random_graphs import seeded_graph

DIALECTS = ["opencl", "cuda", "hip", "metal"]


def _hand_graphs() -> dict[str, yr.KernelGraph]:
    graphs = {}
    g = yr.new_kernel_graph()
    x, w, r = g.new_input((4, 32)), g.new_input((32, 16), strides=(1, 32)), g.new_input((4, 16))
    g.mark_output(g.add(g.silu(g.matmul(g.rms_norm(x, (32,)), w)), r))
    graphs["rms_matmul_epilogue"] = g
    g = yr.new_kernel_graph()
    a, b = g.new_input((1, 2, 8)), g.new_input((3, 8, 5))
    g.mark_output(g.matmul(g.exp(a), b))
    graphs["batched_prologue"] = g
    g = yr.new_kernel_graph()  # 2**20 multiply-adds: split around a GEMM step by host_gemm dialects
    x, w, r = g.new_input((4, 16, 64)), g.new_input((64, 256), strides=(1, 64)), g.new_input((256,))
    g.mark_output(g.silu(g.add(g.matmul(g.rms_norm(x, (64,)), w), r)))
    graphs["large_matmul_epilogue"] = g
    g = yr.new_kernel_graph()
    x, cos, sin = (g.new_input((4, 16)) for _ in range(3))
    g.mark_output(g.softmax(g.rotary(x, cos, sin), -1))
    g.mark_output(g.reduction(g.new_input((3, 5, 7)), 1))
    g.mark_output(g.softmax(g.new_input((4, 50)), 0))
    graphs["rows"] = g
    g = yr.new_kernel_graph()
    q, k, v = g.new_input((2, 8, 16)), g.new_input((2, 2, 12, 16)), g.new_input((2, 2, 12, 16))
    g.mark_output(g.attention(q, k, v, g.new_input((2,), dtype=yr.int32)))
    g.mark_output(g.embedding(g.new_input((2, 5), dtype=yr.int64), g.new_input((50, 24))))
    graphs["attention_embedding"] = g
    g = yr.new_kernel_graph()
    a, b = g.new_input((6, 5), dtype=yr.int64), g.new_input((5,), dtype=yr.int64)
    g.mark_output(g.clamp(g.relu(g.sub(g.mul(a, b), g.square(b))), 0, 20))
    g.mark_output(g.reduction(g.add(a, b), 0))
    graphs["integers"] = g
    g = yr.new_kernel_graph()
    g.mark_output(g.gelu(g.new_input((3, 70))))
    graphs["gelu"] = g
    g = yr.new_kernel_graph()
    x = g.new_input((3, 70), dtype=yr.float64)
    g.mark_output(g.pow(g.sqrt(x), x))
    graphs["float64"] = g
    return graphs


PLANS: dict[str, KernelPlan] = {name: build_plan(g) for name, g in _hand_graphs().items()}
PLANS.update({f"seeded_graph({s})": build_plan(seeded_graph(s)) for s in range(RANDOM_GRAPHS)})


def _unsupported(plan: KernelPlan, d: Dialect) -> list[str]:
    """What the dialect cannot do, worked out from the plan's text (not the renderer's own tables)."""
    text = str(plan)
    missing = [fn for fn in ("gelu", "exp", "silu", "pow", "sqrt") if f"{fn}(" in text
               and fn not in d.functions]
    missing += [dt for dt in ("float64",) if dt in text and dt not in d.types]
    return missing


def _signatures(source: str, kernel_word: str) -> dict[str, list[str]]:
    """kernel name -> parameter names, parsed from the rendered source."""
    out = {}
    for m in re.finditer(rf"{re.escape(kernel_word)} (?:__launch_bounds__\(\d+\) )?(\w+)\((.*)\) \{{$", source, re.M):
        params = [re.sub(r"\s*\[\[.*?\]\]", "", p).split()[-1].lstrip("*") for p in m.group(2).split(", ")]
        assert m.group(1) not in out, f"kernel {m.group(1)} defined twice"
        out[m.group(1)] = params
    return out


def _body(source: str, name: str) -> str:
    start = re.search(rf"\b{name}\(", source).start()
    depth, i = 0, source.index("{", start)
    for j in range(i, len(source)):
        depth += {"{": 1, "}": -1}.get(source[j], 0)
        if depth == 0:
            return source[i:j + 1]
    raise AssertionError(f"unbalanced braces in kernel {name}")


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("dialect_name", DIALECTS)
def test_renders_every_plan_with_sound_structure(dialect_name: str, name: str) -> None:
    plan, d = PLANS[name], dialect(dialect_name)
    missing = _unsupported(plan, d)
    if missing:
        with pytest.raises(UnsupportedExprError, match=missing[0]):
            render(plan, d)
        return
    rendered = render(plan, d)
    source = rendered.source
    assert source.count("{") == source.count("}")
    sigs = _signatures(source, d.kernel)
    assert list(sigs) == [x.kernel for x in rendered.launches], "one kernel per launch, in launch order"
    id_names = [p.split()[1] for p in d.id_params]
    scratch = {s.name for s in rendered.scratch}
    for launch in rendered.launches:
        params = sigs[launch.kernel]
        assert params == list(launch.args) + id_names, f"{launch.kernel}: parameters vs launch arguments"
        assert len(set(launch.args)) == len(launch.args)
        assert all(a in plan.buffers or a in scratch for a in launch.args)
        assert launch.groups >= 1 and launch.local >= 1
    steps = rendered.steps
    assert [x for x in steps if isinstance(x, Launch)] == [x for x in rendered.launches if x.kernel not in
                                                           {g.fallback for g in steps if isinstance(g, Gemm)}]
    for k in plan.kernels:
        launches = [x for x in rendered.launches if x.kernel in (k.name, f"{k.name}_pro", f"{k.name}_full")]
        args = {a for x in launches for a in x.args}
        main = next(x for x in launches if x.kernel == k.name)
        assert main.args[0] == k.out, "the kernel's output is its first argument"
        assert set(k.reads()) <= args, f"{k.name} reads {k.reads()} but is passed {sorted(args)}"
        body = _body(source, k.name)
        for var in re.findall(rf"{d.index_type} (\w+) = ", body):  # compilers warn about unused ones (CI: -Werror)
            reads = [x for x in body.splitlines() if re.search(rf"\b{var}\b", x)
                     and not re.match(rf"\s*({d.index_type} )?{var} = ", x)]
            assert reads, f"{k.name}: index variable {var} is declared but never read"
        barriers = body.count(d.barrier)
        if isinstance(k, Row):
            assert f"{d.local} " in body, f"{k.name}: a row kernel reduces in local memory"
            assert barriers >= 2 * len(k.reductions), f"{k.name}: {barriers} barriers"
            assert main.groups == plan_rows(k)
        elif isinstance(k, Attention):  # one work-group per (batch, head): max and sum reduced in local memory
            assert f"{d.local} " in body and barriers >= 4, f"{k.name}: {barriers} barriers"
            assert main.groups == k.batch * k.heads and d.barrier_global in body
        else:
            assert barriers == 0, f"{k.name} synchronizes without sharing local memory"
        if isinstance(k, Matmul):
            # blocked shapes: each work-item owns acc[MB][NB][lanes] (dot) or acc[MB][VW] (rows) outputs;
            # the naive one a single output. The work-items cover the output, padded by at most one group.
            block = re.search(r"\bacc\[(\d+)\]\[(\d+)\](\[\d+\])?;", body)
            per_item = int(block.group(1)) * int(block.group(2)) if block else 1
            outputs = _prod(plan.buffers[k.out].dims)
            assert main.global_size * per_item >= outputs, "every output element is owned by a work-item"
            assert (main.global_size - main.local) * per_item < outputs, "at most one group of idle work-items"


def plan_rows(k: Row) -> int:
    return _prod([d for i, d in enumerate(k.space) if i != k.axis])


def _prod(dims: object) -> int:
    n = 1
    for d in dims:  # type: ignore[attr-defined]
        n *= d
    return n


def test_inputs_are_read_only_and_outputs_writable_in_signatures() -> None:
    plan = PLANS["rms_matmul_epilogue"]
    source = render(plan, dialect("opencl")).source
    for name, b in plan.buffers.items():
        consts = re.findall(rf"__global (const )?\w+\* {name}\b", source)
        assert consts, f"{name} is passed to no kernel"
        if b.role == "input":
            assert all(c == "const " for c in consts), f"input {name} is writable somewhere"
        else:
            assert "" in consts, f"{b.role} {name} is written by no kernel"


@pytest.mark.parametrize("dialect_name", DIALECTS)
def test_float16_and_bfloat16_tensors_are_passed_in_their_storage_type(dialect_name: str) -> None:
    d = dialect(dialect_name)
    g = yr.new_kernel_graph()
    h, b = g.new_input((4, 8), dtype=yr.float16), g.new_input((4, 8), dtype=yr.bfloat16)
    g.mark_output(g.softmax(g.mul(h, h), -1))
    g.mark_output(g.relu(b))
    plan = build_plan(g)
    source = render(plan, d).source
    for name, buf in plan.buffers.items():
        if buf.role == "temp":
            continue
        storage = re.escape(d.narrow[buf.dtype.name][0])
        assert re.search(rf"{storage}\*( __restrict__)? {name}\b", source), f"{name} ({buf.dtype}) in {source}"


def test_metal_names_the_functions_it_cannot_spell() -> None:
    with pytest.raises(UnsupportedExprError, match=r"gelu.*erf.*dialects/metal\.py"):
        render(PLANS["gelu"], dialect("metal"))


def test_missing_math_function_is_a_clear_error_not_a_keyerror() -> None:
    bare = replace(dialect("opencl"), name="bare", math={"sqrt": "sqrt"})
    plan = PLANS["rms_matmul_epilogue"]  # silu needs exp
    with pytest.raises(UnsupportedExprError, match=r"bare dialect cannot spell the IR function\(s\) silu"):
        render(plan, bare)


def test_missing_dtype_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedExprError, match=r"metal dialect cannot compute in float64"):
        render(PLANS["float64"], dialect("metal"))


def test_unknown_dialect_names_the_choices() -> None:
    with pytest.raises(ValueError, match="cuda, hip, metal, opencl"):
        dialect("vulkan")


def test_dialect_files_are_spellings_only() -> None:
    from pathlib import Path

    import yirage.codegen.dialects as pkg

    for name in DIALECTS:  # the spellings, its GEMV wide loads' among them (a table of a few lines): no functions
        text = (Path(pkg.__file__).parent / f"{name}.py").read_text()
        assert "def " not in text, f"{name}.py defines a function: a dialect holds spellings, not rendering"
        lines = text.splitlines()
        assert len(lines) <= 45, f"{name}.py has {len(lines)} lines: a dialect holds spellings, not rendering"


# -- large matmuls: prologue kernel -> host GEMM -> epilogue kernel where the dialect has a BLAS at hand ---------
def _w1_graph() -> yr.KernelGraph:
    """docs/benchmarks.md's W1 shape: rms_norm(x) * gain @ W + residual, W stored like an nn.Linear weight."""
    g = yr.new_kernel_graph()
    x, gain, r = g.new_input((64, 4096)), g.new_input((4096,)), g.new_input((64, 4096))
    w = g.new_input((4096, 4096), strides=(1, 4096))
    g.mark_output(g.add(g.matmul(g.mul(g.rms_norm(x, (4096,)), gain), w), r))
    return g


@pytest.mark.parametrize("dialect_name", DIALECTS)
def test_a_large_fused_matmul_is_split_around_a_gemm_only_where_the_dialect_has_host_gemm(dialect_name: str) -> None:
    plan, d = build_plan(_w1_graph()), dialect(dialect_name)
    (k,) = plan.kernels
    x, gain, r, w = sorted(plan.inputs, key=lambda n: plan.buffers[n].index)  # graph input order
    out = plan.outputs[0]
    rendered = render(plan, d)
    source, launches = rendered.source, {x.kernel: x for x in rendered.launches}
    if dialect_name in ("opencl", "metal"):  # unchanged: the prologue, then one blocked kernel over K
        assert rendered.steps == rendered.launches and list(launches) == [f"{k.name}_pro", k.name]
        assert re.search(r"for \(\w+ \w+ = 0; \w+ < 4096; \w+ \+= \d+\)", _body(source, k.name))
        return
    pro, gemm, epi = rendered.steps
    scratch = {s.name: (s.count, s.dtype) for s in rendered.scratch}
    assert isinstance(gemm, Gemm) and (pro.kernel, epi.kernel) == (f"{k.name}_pro", k.name)
    # the prologue writes A = x * gain, row-scaled, as a contiguous (M, K) float32 scratch: the GEMM's a
    assert pro.args[0] == gemm.a and scratch[gemm.a] == (64 * 4096, "float32") and set(pro.args[1:]) == {x, gain}
    assert (gemm.a_dims, gemm.a_strides) == ((64, 4096), (4096, 1))
    # B is the weight input as the caller lays it out; the accumulator is a (M, N) float32 scratch
    assert (gemm.b, gemm.b_dims, gemm.b_strides) == (w, (4096, 4096), plan.buffers[w].strides)
    assert scratch[gemm.out] == (64 * 4096, "float32") and gemm.out_dims == (64, 4096) and gemm.dtype == "float32"
    # the epilogue: one work-item per output, out = acc + residual, no loop
    assert epi.args == (out, gemm.out, r) and epi.global_size >= 64 * 4096 > epi.global_size - epi.local
    body = _body(source, k.name)
    assert "for (" not in body and re.search(rf"v_acc = {gemm.out}\[gid\];", body)
    # the whole fused kernel stays, outside the steps, as the GEMM's IEEE fallback: what the dialect
    # renders for this matmul without host_gemm
    assert (gemm.fallback, gemm.epilogue) == (f"{k.name}_full", k.name) and gemm.fallback in launches
    whole = render(plan, replace(d, host_gemm=False))
    assert _body(source, gemm.fallback) == _body(whole.source, k.name)
    assert launches[gemm.fallback].args == next(x.args for x in whole.launches if x.kernel == k.name)[:1] + (
        gemm.a,) + next(x.args for x in whole.launches if x.kernel == k.name)[2:]


@pytest.mark.parametrize("dialect_name", ["cuda", "hip"])
def test_small_or_float16_weight_matmuls_stay_kernels_and_bare_products_need_no_epilogue(dialect_name: str) -> None:
    d = dialect(dialect_name)
    small = render(PLANS["rms_matmul_epilogue"], d)  # 4 x 32 x 16: one kernel launch is cheaper
    assert small.steps == small.launches
    g = yr.new_kernel_graph()
    g.mark_output(g.matmul(g.new_input((64, 64), dtype=yr.float16), g.new_input((64, 128), dtype=yr.float16)))
    halves = render(build_plan(g), d)
    assert halves.steps == halves.launches  # B in float16: the GEMM would need a float32 copy of it
    g = yr.new_kernel_graph()
    g.mark_output(g.matmul(g.new_input((2, 64, 64), dtype=yr.float64), g.new_input((64, 128), dtype=yr.float64)))
    plan = build_plan(g)
    bare = render(plan, d)  # the GEMM writes the output itself: no prologue, no epilogue kernel
    (gemm,) = bare.steps
    assert isinstance(gemm, Gemm) and (gemm.a, gemm.out, gemm.dtype) == ("in0", plan.outputs[0], "float64")
    assert (gemm.b_dims, gemm.out_dims, gemm.epilogue) == ((64, 128), (2, 64, 128), "")
    assert [x.kernel for x in bare.launches] == [gemm.fallback] == [plan.kernels[0].name]
