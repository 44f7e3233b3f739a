"""The cuda backend runs each plan kernel class as CUDA C or as Triton (``YIRAGE_CUDA_KERNELS``, ``kernel_languages``).

No GPU here. Oracles: the plan's own kernel types (routing), the two renderers' own
launch lists (``cstyle.render`` in the CUDA dialect, ``render_triton``: what must run,
in which language, with which buffers), NVRTC and Triton's ahead-of-time compiler
(both sources compile for sm_90), and the graph evaluated in float64 by torch
(``graph_oracle``) for a plan run with its Triton steps in Triton's interpreter on CPU
tensors. The CUDA side is the recording fake driver of test_cuda_launch; the Triton side
a recording fake (or, in a child process, the real interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import yirage as yr
from yirage.codegen.cstyle import Gemm, render
from yirage.codegen.dialects.cuda import DIALECT
from yirage.codegen.launch import C_COMMENT, LaunchHeader, TritonLaunch
from yirage.codegen.triton import render_triton
from yirage.compiler.lower import build_plan

pytest.importorskip("cuda.bindings", reason="the CUDA backend's tests need cuda-bindings: "
                    "pip install 'yirage-backend-cuda[nvrtc]'")
from test_cuda_launch import FakeDriver, mixed_graph, mixed_inputs  # noqa: E402
from yirage_backend_cuda import CUDABackend, KernelLanguageError  # noqa: E402
from yirage_backend_cuda.driver import CudaModule, LaunchError  # noqa: E402
from yirage_backend_cuda.launch import PlanLauncher, read_meta  # noqa: E402
from yirage_backend_cuda.mixed import TritonMissingError, split_source  # noqa: E402
from yirage_backend_cuda.nvrtc import ToolchainError, compile_cuda, toolchain  # noqa: E402

#: the plan kernel classes, by the kernel IR's type names (written here, not taken from the backend)
CLASS_OF = {"Pointwise": "pointwise", "Row": "row", "Matmul": "matmul", "Embedding": "embedding",
            "Attention": "attention"}
ALL = sorted(CLASS_OF.values())


def backend(setting: Any) -> CUDABackend:
    b = CUDABackend()
    b.kernel_languages = setting
    return b


def nvrtc() -> None:
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")


# -- the setting -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "triton"), [
    (None, set()), ("", set()), ("cuda", set()), ("triton", set(ALL)), (" Triton ", set(ALL)),
    ("matmul=triton,row=cuda", {"matmul"}), ("attention=triton, embedding = triton", {"attention", "embedding"}),
    ({"row": "triton", "pointwise": "cuda"}, {"row"}),
])
def test_settings_parse_to_one_language_per_kernel_class(value: Any, triton: set[str]) -> None:
    want = {c: "triton" if c in triton else "cuda" for c in ALL}
    assert backend(value).kernel_languages == want


@pytest.mark.parametrize(("value", "pattern"), [
    ("opencl", r"'opencl' is neither a language nor a class=language pair"),
    ("matmul=hip", r"unknown language 'hip' for matmul"),
    ("gemm=triton", r"unknown kernel class 'gemm'"),
    ("row=triton,row=cuda", r"kernel class row is set twice"),
    ({"softmax": "triton"}, r"unknown kernel class 'softmax'"),
    (3, r"must be a string or a mapping"),
])
def test_bad_settings_name_the_valid_values(value: Any, pattern: str) -> None:
    with pytest.raises(KernelLanguageError, match=pattern) as info:
        backend(value)
    assert all(word in str(info.value) for word in ["'cuda'", "'triton'", *ALL])


def test_the_environment_variable_fills_the_setting_until_one_is_assigned(monkeypatch: pytest.MonkeyPatch) -> None:
    b = CUDABackend()
    monkeypatch.setenv("YIRAGE_CUDA_KERNELS", "embedding=triton")
    assert b.kernel_languages == {c: "triton" if c == "embedding" else "cuda" for c in ALL}
    b.kernel_languages = "cuda"
    assert set(b.kernel_languages.values()) == {"cuda"}  # assigned wins over the environment
    b.kernel_languages = None
    monkeypatch.setenv("YIRAGE_CUDA_KERNELS", "matmul=fast")
    with pytest.raises(KernelLanguageError, match=r"YIRAGE_CUDA_KERNELS='matmul=fast': unknown language 'fast'"):
        b.render(build_plan(mixed_graph()))
    monkeypatch.delenv("YIRAGE_CUDA_KERNELS")
    assert set(b.kernel_languages.values()) == {"cuda"}


# -- routing -----------------------------------------------------------------------------------------------------------
def split_graph() -> yr.KernelGraph:
    """A pointwise kernel, a large float32 product (a cuBLAS ``Gemm`` step when CUDA C) and a row softmax."""
    g = yr.new_kernel_graph()
    a, w = g.new_input((16, 128)), g.new_input((128, 256))
    g.mark_output(g.softmax(g.matmul(g.exp(a), w), -1))
    return g


@pytest.mark.parametrize("setting", ["cuda", "triton", "matmul=triton", "embedding=triton,attention=triton",
                                     "row=triton,embedding=triton", "pointwise=triton,row=triton"])
@pytest.mark.parametrize("graph", [mixed_graph, split_graph])
def test_each_plan_kernel_runs_in_the_language_of_its_class(setting: str, graph: Any) -> None:
    plan = build_plan(graph())
    chosen = backend(setting).kernel_languages
    want = {k.name: chosen[CLASS_OF[type(k).__name__]] for k in plan.kernels}
    assert backend(setting).languages_for(plan) == want
    meta = read_meta(backend(setting).render(plan), "plan")
    cuda, tri = render(plan, DIALECT), render_triton(plan)
    expected: list[tuple[str, str]] = []  # (language, kernel or gemm name) in plan order, from the two renderers
    for k in plan.kernels:
        if want[k.name] == "triton":
            expected += [("triton", x.kernel) for x in tri.launches if x.kernel == k.name]
        else:
            expected += [("gemm", s.name) if isinstance(s, Gemm) else ("cuda", s.kernel) for s in cuda.steps
                         if (s.name if isinstance(s, Gemm) else s.kernel) in (k.name, f"{k.name}_pro")]
    got = [("gemm", s.name) if isinstance(s, Gemm) else (("triton" if isinstance(s, TritonLaunch) else "cuda"),
                                                           s.kernel) for s in meta.steps]
    assert got == expected
    if "triton" not in want.values():  # all CUDA C: the source is the CUDA rendering, nothing else
        assert meta.triton == () and split_source(backend(setting).render(plan))[1] == ""
        assert (meta.launches, meta.scratch, meta.steps) == (cuda.launches, cuda.scratch, cuda.steps)


def test_a_plan_set_to_triton_without_triton_installed_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import yirage_backend_cuda.mixed as mixed

    monkeypatch.setattr(mixed, "module_installed", lambda name: False)
    plan = build_plan(mixed_graph())
    with pytest.raises(TritonMissingError, match=r"k1 \(matmul\).*pip install 'triton.*YIRAGE_CUDA_KERNELS=cuda"):
        backend("matmul=triton").render(plan)
    assert read_meta(backend("cuda").render(plan), "plan").triton == ()  # all CUDA C needs no triton


def test_a_mixed_plan_caches_both_renderings_in_one_entry(tmp_path: Path) -> None:
    nvrtc()
    from yirage.compiler.stages import compile_cached

    class Entry(CUDABackend):
        def load(self, artifact: Any) -> Any:  # type: ignore[override]
            return artifact

    b = Entry()
    if b.availability().ok:
        pytest.skip("a GPU is present: target() is its arch, not the compile-check archs")
    plan = build_plan(mixed_graph())
    b.kernel_languages = "attention=triton"
    artifact = compile_cached(b, plan, root=tmp_path)
    assert sorted(artifact.files) == ["kernels.cu", "kernels.py", "kernels.sm_80.cubin", "kernels.sm_90.cubin"]
    assert (artifact.directory / "kernels.py").read_text() == render_triton(plan).source
    cu = (artifact.directory / "kernels.cu").read_text()
    assert cu.partition("\n")[2] == render(plan, DIALECT).source  # every kernel's CUDA C, compiled to the cubins
    assert [x.kernel for x in read_meta(cu, "entry").triton] == [k.name for k in plan.kernels
                                                                 if type(k).__name__ == "Attention"]
    b.kernel_languages = "cuda"  # another setting, another entry; the all-CUDA one has no Triton module
    other = compile_cached(b, plan, root=tmp_path)
    assert other.key != artifact.key and "kernels.py" not in other.files


# -- the launch sequence of a mixed plan ---------------------------------------------------------------------------
class RecordingTriton:
    """The Triton side's stand-in: records each launch among the fake driver's calls, so the order shows."""

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver

    def __call__(self, step: Any, tensors: list[torch.Tensor]) -> None:
        assert len(tensors) == len(step.args)
        self.driver.calls.append(("triton", (step.kernel, tuple(t.data_ptr() for t in tensors), step.grid[0])))


def mixed_launcher(plan: Any, setting: str, driver: FakeDriver, triton: Any) -> PlanLauncher:
    """A launcher over a cubin of empty kernels named like the CUDA launches (the fake never runs them)."""
    meta = read_meta(backend(setting).render(plan), "plan")
    stubs = "".join(f'extern "C" __global__ void {x.kernel}() {{}}\n' for x in meta.launches) or "\n"
    module = CudaModule(compile_cuda(stubs, "sm_80", ptxas="never").cubin, 0, driver=driver, capability=(8, 0))
    return PlanLauncher(meta, module, torch.device("cpu"), lambda: 77, triton)


def test_a_mixed_plan_interleaves_both_languages_in_plan_order_on_shared_buffers() -> None:
    nvrtc()
    plan = build_plan(mixed_graph())
    setting = "matmul=triton,attention=triton"  # embedding (CUDA C) -> matmul (Triton) -> row (CUDA C) -> attention
    cuda, tri = render(plan, DIALECT), render_triton(plan)
    driver = FakeDriver()
    inputs = mixed_inputs()
    outputs = mixed_launcher(plan, setting, driver, RecordingTriton(driver))(inputs)
    launches = [(n, a) for n, a in driver.calls if n in ("cuLaunchKernel", "triton")]
    want = {k.name: "triton" if CLASS_OF[type(k).__name__] in ("matmul", "attention") else "cuda"
            for k in plan.kernels}
    assert [(n, a[0]) for n, a in launches] == [("triton" if want[k.name] == "triton" else "cuLaunchKernel", k.name)
                                                for k in plan.kernels]  # one launch each here, in plan order
    by_name = {x.kernel: x for x in cuda.launches} | {("t", x.kernel): x for x in tri.launches}
    pointer: dict[str, int] = {n: inputs[plan.buffers[n].index].data_ptr() for n in plan.inputs}
    pointer.update({n: o.data_ptr() for n, o in zip(plan.outputs, outputs, strict=True)})
    scratch: dict[tuple[str, str], int] = {}
    for name, call in launches:
        triton = name == "triton"
        launch = by_name[("t", call[0]) if triton else call[0]]
        ptrs = call[1] if triton else call[5]
        if triton:
            assert call[2] == launch.grid[0]
        assert len(ptrs) == len(launch.args)
        own = {s.name for s in (tri if triton else cuda).scratch}
        for arg, ptr in zip(launch.args, ptrs, strict=True):
            if arg in own:  # each rendering's scratch is its own, one buffer per name for the call
                assert scratch.setdefault(("triton" if triton else "cuda", arg), ptr) == ptr
            else:  # plan buffers (inputs, outputs, temporaries) are shared across the languages
                assert pointer.setdefault(arg, ptr) == ptr, (call[0], arg)
    temps = [n for n, b in plan.buffers.items() if b.role == "temp"]
    assert temps and all(n in pointer for n in temps)  # a temporary written by one language is read by the other
    assert len(set(scratch.values())) == len(scratch) and not set(scratch.values()) & set(pointer.values())
    # every status flag (the CUDA embedding's, the Triton attention's) was zeroed before the first launch and is read
    statuses = {scratch[("cuda", "k0_st")], scratch[("triton", "k3_st")]}
    first = next(i for i, (n, _) in enumerate(driver.calls) if n in ("cuLaunchKernel", "triton"))
    assert statuses <= {a[0] for n, a in driver.calls[:first] if n == "cuMemsetD8Async"}
    assert {a[1] for a in driver.of("cuMemcpyDtoHAsync")} == statuses
    assert driver.names()[-1] == "cuStreamSynchronize" and driver.depth == 0


def test_a_cuda_gemm_step_feeds_a_triton_row_kernel_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    nvrtc()
    plan = build_plan(split_graph())
    driver = FakeDriver()

    def matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        driver.calls.append(("torch.matmul", (out.data_ptr(),)))
        return out

    monkeypatch.setattr(torch, "matmul", matmul)
    gen = torch.Generator().manual_seed(1)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # IEEE allowed to go to cuBLAS (a module property: no monkeypatch)
    try:
        mixed_launcher(plan, "row=triton", driver, RecordingTriton(driver))(
            [torch.randn(16, 128, generator=gen), torch.randn(128, 256, generator=gen)])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    order = [(n, a[0]) for n, a in driver.calls if n in ("cuLaunchKernel", "triton")] + [
        (n, a[0]) for n, a in driver.calls if n == "torch.matmul"]
    names = [n for n, _ in driver.calls if n in ("cuLaunchKernel", "triton", "torch.matmul")]
    assert names == ["cuLaunchKernel", "torch.matmul", "triton"], names  # exp, the GEMM, then the softmax
    gemm_out = order[-1][1]
    row = next(a for n, a in driver.calls if n == "triton")
    assert gemm_out in row[1]  # the Triton softmax reads what the GEMM wrote


def test_a_plan_with_triton_steps_needs_a_triton_runner() -> None:
    nvrtc()
    with pytest.raises(LaunchError, match="no Triton runner"):
        mixed_launcher(build_plan(mixed_graph()), "triton", FakeDriver(), None)


# -- both sources compile ahead of time; the Triton steps run in the interpreter --------------------------------------
def test_both_renderings_of_a_mixed_plan_compile_for_sm_90(tmp_path: Path) -> None:
    """NVRTC compiles the CUDA part for sm_90 (what build does); Triton compiles the module's kernels for
    GPUTarget("cuda", 90, 32) with test_triton_aot's compiler, in a child process (Triton's JIT, no interpreter)."""
    nvrtc()
    pytest.importorskip("triton", reason="triton is not installed: pip install 'triton>=3.0,<3.6'")
    plan = build_plan(mixed_graph())
    source = backend("matmul=triton,attention=triton,row=triton").render(plan)
    cuda_part, module = split_source(source)
    assert module and "@triton.jit" in module and "@triton.jit" not in cuda_part
    compile_cuda(cuda_part, "sm_90", name="kernels.cu")
    meta = read_meta(cuda_part, "plan")
    header = json.loads(cuda_part.partition("\n")[0].removeprefix(LaunchHeader.prefix(C_COMMENT)))
    plain = {s["name"]: s["name"].removeprefix("triton:") for s in header["scratch"]}
    aot = {"inputs": header["inputs"], "buffers": header["buffers"],
           "scratch": [dict(s, name=plain[s["name"]]) for s in header["scratch"]],
           "launches": [{"kernel": x.kernel, "args": [plain.get(a, a) for a in x.args],
                         "constexprs": [list(c) for c in x.constexprs], "num_warps": x.num_warps} for x in meta.triton]}
    (tmp_path / "kernels.py").write_text("# yirage-launch: " + json.dumps(aot) + "\n" + module, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "test_triton_aot.py"), "cuda", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["kernels"] == len(meta.triton) == 3 and not result["failures"], result["failures"]


INTERPRETED = """
import json, sys, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_cuda_launch import FakeDriver, mixed_graph, mixed_inputs
from test_cuda_kernel_languages import mixed_launcher
from yirage.compiler.lower import build_plan
from yirage.reference.magnitude import graph_oracle
from yirage.testing.oracle import assert_close
from yirage_backend_cuda import CUDABackend
from yirage_backend_cuda.mixed import TritonRunner, split_source

g = mixed_graph()
plan = build_plan(g)
b = CUDABackend()
b.kernel_languages = "triton"
module = Path({directory!r}) / "kernels.py"
module.write_text(split_source(b.render(plan))[1])
runner = TritonRunner(module, "interp", torch.device("cpu"), [k.name for k in plan.kernels])
launcher = mixed_launcher(plan, "triton", FakeDriver(memory=True), runner.launch)
def expect(error, pattern, fn):
    try:
        fn()
    except error as exc:
        assert __import__("re").search(pattern, str(exc)), str(exc)
    else:
        raise AssertionError(f"no {{error.__name__}} matching {{pattern!r}}")

inputs = mixed_inputs()
outs = launcher(inputs)
refs, scales = graph_oracle(g, inputs)
for out, ref, scale, node in zip(outs, refs, scales, g.output_nodes, strict=True):
    assert_close(out, ref, node.dtype.name, scale)
expect(IndexError, r"ids must lie in \\[0, 10\\); the id at flat position 2 of input in0",
       lambda: launcher(mixed_inputs(ids=[1, 2, 10, 3, 4, 5])))
expect(ValueError, r"lengths must lie in \\[1, 12\\]; batch 1 has length 13",
       lambda: launcher(mixed_inputs(lengths=[3, 13])))
run = launcher.capturable()
run(mixed_inputs(ids=[1, 2, 3, -1, 4, 5]))  # recorded in the persistent flags, not raised
expect(IndexError, r"a capturable call had bad input: .*flat position 3", run.check_status)
print("ok")
"""


def test_triton_steps_compute_the_graph_and_raise_the_same_status_errors(tmp_path: Path) -> None:
    """Every kernel as Triton, in Triton's interpreter on CPU tensors (child process: TRITON_INTERPRET=1 must be
    set before triton is imported, and raw addresses reach the fake driver's memset and copies)."""
    nvrtc()
    pytest.importorskip("triton", reason="triton is not installed: pip install 'triton>=3.0,<3.6'")
    code = INTERPRETED.format(tests=str(Path(__file__).parent), directory=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


# -- where an NVIDIA GPU exists ---------------------------------------------------------------------------------------
GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.version.cuda and not torch.version.hip),
    reason="needs an NVIDIA GPU and a CUDA build of torch: here the mixed launch path is checked with a recording "
           "driver, NVRTC/Triton AOT compiles and Triton's interpreter")


@GPU
@pytest.mark.parametrize("setting", ["triton", ""])
def test_where_a_gpu_exists_the_conformance_kit_passes_with_either_language(setting: str) -> None:
    pytest.importorskip("triton", reason="triton is not installed: pip install 'triton>=3.0,<3.6'")
    root = Path(__file__).resolve().parent.parent
    import importlib.util

    workers = ["-n", str(min(4, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
    # within make gpu-check's budget (8 minutes for everything on one H100 with 16 cores): the kit's plans compile
    # on 4 workers; a kit that needs longer here is a finding in itself
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", *workers, "--pyargs",
                           "yirage.testing.conformance", "--yirage-backend", "cuda", "-k", "not extreme"],
                          capture_output=True, text=True, timeout=420, cwd=root,
                          env={**os.environ, "YIRAGE_CUDA_KERNELS": setting})
    assert done.returncode == 0, textwrap.shorten(done.stdout[-4000:] + done.stderr[-2000:], 6000)


def test_the_language_knob_of_a_plan_schedule_overrides_the_class_setting_per_kernel() -> None:
    """``g.superoptimize()`` sets one kernel's language through the plan's schedule: only that kernel moves."""
    from yirage.compiler.schedule import check_knobs, with_schedule

    pytest.importorskip("triton", reason="the language knob is offered only where triton is installed")
    plan = build_plan(split_graph())
    b = backend("cuda")
    knobs = check_knobs(b.schedule_knobs(plan), plan, "cuda")
    languages = [(k.kernel, k.values) for k in knobs if k.name == "language"]
    assert languages == [(k.name, ("cuda", "triton")) for k in plan.kernels]
    last = plan.kernels[-1].name  # the row softmax
    scheduled = with_schedule(plan, {last: {"language": "triton"}})
    assert b.languages_for(scheduled) == {**dict.fromkeys((k.name for k in plan.kernels), "cuda"), last: "triton"}
    meta = read_meta(b.render(scheduled), "plan")
    tri = [s.kernel for s in meta.steps if isinstance(s, TritonLaunch)]
    assert tri == [last] and read_meta(b.render(plan), "plan").triton == ()
    row = [k.values for k in backend("row=triton").schedule_knobs(plan) if k.name == "language"][-1]
    assert row == ("triton", "cuda")


def test_every_c_family_knob_value_compiles_for_sm_90() -> None:
    """The C-family knobs the cuda backend offers (a row kernel's work-group size, cuBLAS or the generated product):
    NVRTC compiles every value's CUDA C, and the launch records carry the chosen group size (no GPU here: the
    values are run on PoCL by test_opencl_graphs and on a GPU by make gpu-check's superoptimize part)."""
    from yirage.compiler.schedule import with_schedule

    nvrtc()
    plan = build_plan(split_graph())
    knobs = [k for k in backend("cuda").schedule_knobs(plan) if k.name != "language"]
    assert {k.name for k in knobs} == {"group", "host_gemm"}, knobs
    for column in range(max(len(k.values) for k in knobs)):
        schedule: dict[str, dict[str, Any]] = {}
        for k in knobs:
            schedule.setdefault(k.kernel, {})[k.name] = k.values[min(column, len(k.values) - 1)]
        source = backend("cuda").render(with_schedule(plan, schedule))
        compile_cuda(source, "sm_90", name="kernels.cu")
        meta = read_meta(source, "plan")
        gemm = [s for s in meta.steps if isinstance(s, Gemm)]
        host = next(v["host_gemm"] for v in schedule.values() if "host_gemm" in v)
        assert bool(gemm) == host, (schedule, meta.steps)
        group = next(v["group"] for v in schedule.values() if "group" in v)
        row = plan.kernels[-1].name
        assert [x.local for x in meta.launches if x.kernel == row] == [group], (schedule, meta.launches)
