"""The MPS backend's stages: Metal source with a launch header, written to the cache, launched in order.

There is no Mac here, so what runs everywhere is what needs no Metal compiler:
every plan the conformance kit compiles goes through render -> build -> the
launch header and back, and through the launcher with a fake
``torch.mps.compile_shader`` library that records each dispatch. The checks
hold that to independent sources: the plan (buffers, inputs, outputs), the
core renderer's Launch list, and the ``[[buffer(i)]]`` bindings parsed from the
MSL itself. Tests that need Apple silicon run the conformance kit on mps and
compare with torch; elsewhere they skip with the probe's reason.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from yirage_backend_domestic.hip_build import conformance_plans
from yirage_backend_mps import MPSBackend
from yirage_backend_mps.compile import (
    MAX_BUFFERS,
    MetalBuildError,
    MetalProgram,
    build,
    load,
    torch_compile_shader,
)

import yirage as yr
from yirage.backend.selection import registry
from yirage.codegen.cstyle import render
from yirage.codegen.dialects import dialect
from yirage.codegen.exprs import UnsupportedExprError
from yirage.codegen.launch import C_COMMENT, LaunchHeader, LaunchHeaderError
from yirage.compiler.kernel_ir import KernelPlan
from yirage.compiler.lower import build_plan
from yirage.compiler.stages import compile_cached
from yirage.errors import BackendUnavailableError, NotSupportedError

METAL = dialect("metal")
MPS = registry().get("mps")
ON_MAC = MPS.availability().ok
needs_mac = pytest.mark.skipif(not ON_MAC, reason=f"needs an Apple silicon GPU: {MPS.availability().reason}")


@pytest.fixture(scope="module")
def kit_plans() -> dict[str, KernelPlan]:
    return conformance_plans()


def _metal_cannot(plan: KernelPlan) -> bool:
    """Metal has no double, nor (yet) an erf for gelu: read off the plan's text."""
    text = str(plan)
    return "float64" in text or ("gelu(" in text and "erf" not in METAL.math)


def _buffer_bindings(source: str) -> dict[str, list[tuple[int, str]]]:
    """kernel -> [(i, parameter name)] for every ``[[buffer(i)]]`` parameter, parsed from the MSL."""
    out = {}
    for m in re.finditer(r"^kernel void (\w+)\((.*)\) \{$", source, re.M):
        out[m.group(1)] = [(int(b), re.sub(r"\s*\[\[.*", "", p).split()[-1].lstrip("*"))
                           for p in m.group(2).split(", ") for b in re.findall(r"\[\[buffer\((\d+)\)\]\]", p)]
    return out


def _inputs(plan: KernelPlan) -> list[Any]:
    """Seeded tensors laid out as the plan's input buffers declare (ids are 0: always in range)."""
    gen = torch.Generator().manual_seed(0)
    inputs: list[Any] = [None] * (1 + max((b.index for b in plan.buffers.values() if b.role == "input"), default=-1))
    for name in plan.inputs:
        b = plan.buffers[name]
        t = torch.empty_strided(b.dims, b.strides, dtype=b.dtype.torch)
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(b.dims, generator=gen))
        else:
            t.zero_()
        inputs[b.index] = t
    return inputs


class FakeKernel:
    """Records each dispatch (copies of its tensors as they were) like torch's _mps_MetalKernel would run it."""

    def __init__(self, name: str, calls: list, limit: int) -> None:
        self.name, self.calls, self.max_threads_per_threadgroup = name, calls, limit
        self.effect = None  # optional callable(*args) run at dispatch

    def __call__(self, *args: Any, threads: Any = None, group_size: Any = None) -> None:
        self.calls.append((self.name, args, [a.clone() for a in args], threads, group_size))
        if self.effect is not None:
            self.effect(*args)


class FakeLibrary:
    """A stand-in for ``torch.mps.compile_shader(source)``: one FakeKernel per ``kernel void`` in the source."""

    def __init__(self, source: str, limit: int = 1024) -> None:
        self.source, self.calls, self.kernels = source, [], {}
        for name in re.findall(r"^kernel void (\w+)\(", source, re.M):
            self.kernels[name] = FakeKernel(name, self.calls, limit)

    def __getattr__(self, name: str) -> FakeKernel:
        if name in ("source", "calls", "kernels"):
            raise AttributeError(name)
        try:
            return self.kernels[name]
        except KeyError:
            raise RuntimeError(f"no function {name} in the library") from None


# -- what runs everywhere ---------------------------------------------------------------------------------------
@pytest.mark.skipif(ON_MAC, reason="MPS is available here")
def test_mps_is_unavailable_here_and_compile_says_why() -> None:
    avail = MPS.availability()
    assert not avail.ok and "macOS" in avail.reason
    g = yr.new_kernel_graph()
    g.mark_output(g.exp(g.new_input((4, 8))))
    with pytest.raises(BackendUnavailableError, match="MPS needs macOS"):
        g.compile("mps")


def test_claims_what_metal_computes() -> None:
    assert MPSBackend.kernel_dtypes == {"float32", "float16", "bfloat16", "int32", "int64"}  # Metal has no double


def test_every_kit_plan_round_trips_through_render_build_and_the_launch_header(
        kit_plans: dict[str, KernelPlan], tmp_path: Path) -> None:
    rendered_count = 0
    for name, plan in kit_plans.items():
        if _metal_cannot(plan):
            with pytest.raises(UnsupportedExprError):
                MPS.render(plan)
            continue
        source = MPS.render(plan)
        rendered = render(plan, METAL)
        header, _, body = source.partition("\n")
        assert header.startswith(LaunchHeader.prefix(C_COMMENT)) and body == rendered.source, name
        workdir = tmp_path / name
        workdir.mkdir()
        path = build(source, workdir)
        assert path.parent == workdir and path.read_text(encoding="utf-8") == source
        meta = LaunchHeader.read(path.read_text(encoding="utf-8"), str(path), C_COMMENT)
        assert meta.launches == rendered.launches and meta.scratch == rendered.scratch, name
        assert meta.inputs == tuple((n, plan.buffers[n].index, plan.buffers[n].dtype.name) for n in plan.inputs)
        assert meta.outputs == tuple(plan.outputs)
        assert {b[0] for b in meta.buffers} == {n for n, b in plan.buffers.items() if b.role != "input"}
        assert all(tuple(plan.buffers[n].dims) == dims and plan.buffers[n].dtype.name == dt
                   for n, dims, dt, _ in meta.buffers)
        bindings = _buffer_bindings(body)
        for launch in meta.launches:
            assert bindings[launch.kernel] == list(enumerate(launch.args)), f"{name}: {launch.kernel} bindings"
            assert len(launch.args) <= MAX_BUFFERS
        rendered_count += 1
    assert rendered_count >= 200, f"only {rendered_count} kit plans rendered in Metal"


def test_launcher_dispatches_every_launch_in_order_with_its_buffers(kit_plans: dict[str, KernelPlan]) -> None:
    for name, plan in kit_plans.items():
        if _metal_cannot(plan):
            continue
        source = MPS.render(plan)
        library = FakeLibrary(source)
        program = MetalProgram(source, name, compile_shader=lambda s, lib=library: lib, device="cpu")
        inputs = _inputs(plan)
        outputs = program(inputs)
        launches = render(plan, METAL).launches
        calls = library.calls
        assert [c[0] for c in calls] == [x.kernel for x in launches], name
        scratch = {s.name: s for s in render(plan, METAL).scratch}
        bound: dict[str, Any] = {}
        for (_, args, before, threads, group_size), launch in zip(calls, launches, strict=True):
            assert threads == launch.groups * launch.local and group_size == launch.local, name  # a uniform grid
            assert len(args) == len(launch.args)
            for arg, copy, buf in zip(args, before, launch.args, strict=True):
                assert bound.setdefault(buf, arg) is arg, f"{name}: {buf} is one tensor across launches"
                assert arg.device.type == "cpu"
                if buf in scratch:
                    s = scratch[buf]
                    assert arg.dtype == getattr(torch, s.dtype) and arg.numel() == s.count
                    if not any(buf in x.args for x in launches[:launches.index(launch)]):
                        assert not copy.any(), f"{name}: scratch {buf} is zero-filled"
                    continue
                b = plan.buffers[buf]
                if b.role == "input":
                    assert arg is inputs[b.index], f"{name}: input {buf} is the caller's tensor itself"
                elif b.role == "output":
                    assert arg.shape == b.dims and arg.dtype == b.dtype.torch
                else:
                    assert arg.numel() == max(1, math.prod(b.dims))
        assert len(outputs) == len(plan.outputs)
        for out, buf in zip(outputs, plan.outputs, strict=True):
            assert out is bound[buf] and out.shape == plan.buffers[buf].dims


def test_status_check_raises_with_the_bad_position_and_value() -> None:
    g = yr.new_kernel_graph()
    ids, table = g.new_input((4,), dtype=yr.int64), g.new_input((10, 8))
    g.mark_output(g.embedding(ids, table))
    plan = build_plan(g)
    launches = render(plan, METAL).launches
    checked = next(x for x in launches if x.check is not None)
    library = FakeLibrary(MPS.render(plan))
    status_at = checked.args.index(checked.check.status)
    library.kernels[checked.kernel].effect = lambda *a: a[status_at].fill_(3)  # "bad id at position 2"
    program = MetalProgram(MPS.render(plan), "embedding", compile_shader=lambda s: library, device="cpu")
    with pytest.raises(IndexError, match=r"\[0, 10\).*position 2\b"):
        program([torch.tensor([1, 2, 12, 3]), torch.randn(10, 8)])


def test_loading_through_the_core_cache_compiles_once(tmp_path: Path) -> None:
    libraries: list[FakeLibrary] = []

    def fake(source: str) -> FakeLibrary:
        libraries.append(FakeLibrary(source))
        return libraries[-1]

    class OffMac(MPSBackend):
        def target(self) -> str:
            return "fake GPU|macOS 0"

        def load(self, artifact: Any) -> Any:
            return load(artifact, compile_shader=fake)

    g = yr.new_kernel_graph()
    g.mark_output(g.softmax(g.new_input((4, 50)), -1))
    first = compile_cached(OffMac(), build_plan(g), root=tmp_path)
    second = compile_cached(OffMac(), build_plan(g), root=tmp_path)
    assert first is second and len(libraries) == 1
    assert [p.name for p in (tmp_path / "mps").rglob("*.metal")] == ["kernels.metal"]


def test_compiler_errors_and_missing_kernels_are_metal_build_errors() -> None:
    g = yr.new_kernel_graph()
    g.mark_output(g.exp(g.new_input((4, 8))))
    source = MPS.render(build_plan(g))

    def rejecting(src: str) -> Any:
        raise RuntimeError("program_source:12:5: error: use of undeclared identifier 'x'")

    with pytest.raises(MetalBuildError, match="undeclared identifier"):
        MetalProgram(source, "x.metal", compile_shader=rejecting, device="cpu")
    with pytest.raises(MetalBuildError, match="no kernel"):
        MetalProgram(source, "x.metal", compile_shader=lambda s: FakeLibrary(""), device="cpu")
    with pytest.raises(LaunchHeaderError, match="x.metal does not start with a launch header"):
        MetalProgram(source.partition("\n")[2], "x.metal", compile_shader=FakeLibrary, device="cpu")


def test_threadgroups_above_the_pipeline_limit_are_refused() -> None:
    g = yr.new_kernel_graph()
    g.mark_output(g.softmax(g.new_input((4, 300)), -1))  # a row kernel of 256 threads per group
    source = MPS.render(build_plan(g))
    with pytest.raises(NotSupportedError, match="at most 128"):
        MetalProgram(source, "x.metal", compile_shader=lambda s: FakeLibrary(s, limit=128), device="cpu")


def test_more_buffers_than_metal_binds_are_refused_at_render() -> None:
    g = yr.new_kernel_graph()
    xs = [g.new_input((8,)) for _ in range(MAX_BUFFERS + 4)]
    total = xs[0]
    for x in xs[1:]:
        total = g.add(total, x)
    g.mark_output(total)
    with pytest.raises(NotSupportedError, match=f"at most {MAX_BUFFERS}"):
        MPS.render(build_plan(g))


def test_fast_math_is_refused_before_torch_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_MPS_FAST_MATH", "1")
    with pytest.raises(NotSupportedError, match="PYTORCH_MPS_FAST_MATH"):
        torch_compile_shader("kernel void k() {}")


# -- on Apple silicon ----------------------------------------------------------------------------------------------
@needs_mac
def test_softmax_and_rms_norm_match_torch_on_mps() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    g = yr.new_kernel_graph()
    a = g.new_input((6, 50))
    g.mark_output(g.softmax(a, -1))
    g.mark_output(g.rms_norm(a, (50,)))
    soft, rms = g(inputs=[x.float().to("mps")], backend="mps")
    assert soft.device.type == "mps"
    torch.testing.assert_close(soft.cpu().double(), torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms.cpu().double(), want, rtol=1e-4, atol=1e-5)


@needs_mac
def test_conformance_kit_passes_on_mps(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "yirage.testing.conformance", "-q",
                          "--yirage-backend", "mps", "-p", "no:cacheprovider"],
                         capture_output=True, text=True, timeout=1800, cwd=tmp_path, env=dict(os.environ))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
