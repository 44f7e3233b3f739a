"""The CUDA backend's launch path: launch metadata in the cache entry, argument marshalling, the two call modes.

No GPU here, so the driver is a recording fake (``FakeDriver``, written from the
CUDA driver API's documented signatures, not from the launcher): it returns
handles, records every call and, when asked to, acts on host memory the way the
device would (memset, copy, a kernel's status write). Tensors are CPU tensors
then, whose addresses the fake can check. Oracles: the core renderer's own
``Launch``/``Scratch`` lists and the plan (what must be passed), the parameter
lists NVRTC compiled (parsed from the source), torch for values. GPU tests run
the conformance kit and a CUDA-graph capture on cuda, and skip elsewhere.
"""

from __future__ import annotations

import ctypes
import enum
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import yirage as yr
from yirage.codegen.cstyle import render
from yirage.codegen.dialects.cuda import DIALECT
from yirage.codegen.launch import LaunchHeaderError
from yirage.compiler.lower import build_plan
from yirage.compiler.stages import Artifact, compile_cached

pytest.importorskip("cuda.bindings", reason="the CUDA backend's tests need cuda-bindings: "
                    "pip install 'yirage-backend-cuda[nvrtc]'")
from yirage_backend_cuda import CUDABackend  # noqa: E402
from yirage_backend_cuda.cubin import inspect_cubin  # noqa: E402
from yirage_backend_cuda.driver import CudaModule, LaunchError  # noqa: E402
from yirage_backend_cuda.launch import PlanLauncher, capturable, open_entry, read_meta  # noqa: E402
from yirage_backend_cuda.nvrtc import ToolchainError, compile_cuda, toolchain  # noqa: E402

ARCHS = ("sm_80", "sm_90")
WAITS_AND_READS = {"cuStreamSynchronize", "cuCtxSynchronize", "cuMemcpyDtoHAsync", "cuMemcpyDtoH",
                   "cuStreamQuery", "cuEventSynchronize"}


class FakeDriver:
    """A stand-in for ``cuda.bindings.driver``: same call shapes, returns ``(CUresult, *values)``."""

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    class CUfunction_attribute(enum.Enum):  # noqa: N801 - the driver's spelling
        CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0

    class CUstreamCaptureStatus(enum.Enum):
        CU_STREAM_CAPTURE_STATUS_NONE = 0
        CU_STREAM_CAPTURE_STATUS_ACTIVE = 1

    def __init__(self, *, memory: bool = False, capturing: bool = False, kernels: dict | None = None) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.depth = 0  # context pushes minus pops
        self.memory, self.capturing, self.kernels = memory, capturing, kernels or {}

    def _ok(self, name: str, *args: Any, needs_ctx: bool = True) -> None:
        assert not needs_ctx or self.depth > 0, f"{name} was called with no current context"
        self.calls.append((name, args))

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def of(self, name: str) -> list[tuple]:
        return [a for n, a in self.calls if n == name]

    S = CUresult.CUDA_SUCCESS

    def cuGetErrorString(self, status: Any) -> tuple:
        return self.S, b"fake error"

    def cuInit(self, flags: int) -> tuple:
        self._ok("cuInit", flags, needs_ctx=False)
        return (self.S,)

    def cuDeviceGet(self, index: int) -> tuple:
        self._ok("cuDeviceGet", index, needs_ctx=False)
        return self.S, ("device", index)

    def cuDevicePrimaryCtxRetain(self, device: Any) -> tuple:
        self._ok("cuDevicePrimaryCtxRetain", device, needs_ctx=False)
        return self.S, ("ctx", device)

    def cuCtxPushCurrent(self, ctx: Any) -> tuple:
        self.depth += 1
        return (self.S,)

    def cuCtxPopCurrent(self) -> tuple:
        assert self.depth > 0
        self.depth -= 1
        return self.S, "ctx"

    def cuModuleLoadData(self, image: bytes) -> tuple:
        self._ok("cuModuleLoadData", len(image))
        return self.S, "module"

    def cuModuleGetFunction(self, module: Any, name: bytes) -> tuple:
        self._ok("cuModuleGetFunction", name)
        return self.S, ("function", name.decode())

    def cuFuncGetAttribute(self, attr: Any, fn: Any) -> tuple:
        return self.S, 1024

    def cuStreamIsCapturing(self, stream: int) -> tuple:
        self._ok("cuStreamIsCapturing", stream)
        status = self.CUstreamCaptureStatus
        return self.S, (status.CU_STREAM_CAPTURE_STATUS_ACTIVE if self.capturing
                        else status.CU_STREAM_CAPTURE_STATUS_NONE)

    def cuMemsetD8Async(self, ptr: int, value: int, count: int, stream: int) -> tuple:
        self._ok("cuMemsetD8Async", ptr, value, count, stream)
        if self.memory:
            ctypes.memset(ptr, value, count)
        return (self.S,)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, count: int, stream: int) -> tuple:
        self._ok("cuMemcpyDtoHAsync", dst, src, count, stream)
        if self.memory:
            ctypes.memmove(dst, src, count)
        return (self.S,)

    def cuStreamSynchronize(self, stream: int) -> tuple:
        self._ok("cuStreamSynchronize", stream)
        return (self.S,)

    def cuCtxSynchronize(self) -> tuple:
        self._ok("cuCtxSynchronize")
        return (self.S,)

    def cuLaunchKernel(self, fn: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: int, params: Any, extra: Any) -> tuple:
        values, types = params  # the (values, ctypes types) form cuda-bindings packs itself
        assert len(values) == len(types) and all(t is ctypes.c_void_p for t in types)
        name = fn[1]
        self._ok("cuLaunchKernel", name, (gx, gy, gz), (bx, by, bz), shared, stream, tuple(values), extra)
        if self.memory and name in self.kernels:
            self.kernels[name](*values)  # the test's stand-in for what the kernel does
        return (self.S,)


def mixed_graph() -> yr.KernelGraph:
    """Every kernel kind: embedding (checked ids), fused RMSNorm+matmul with a prologue and a transposed
    weight, a row softmax, attention with checked lengths; float16/bfloat16 storage and temporaries."""
    g = yr.new_kernel_graph()
    ids, table = g.new_input((2, 3), dtype=yr.int64), g.new_input((10, 8), dtype=yr.float16)
    w = g.new_input((8, 4), strides=(1, 8), dtype=yr.float16)
    h = g.matmul(g.rms_norm(g.embedding(ids, table), (8,)), w)
    g.mark_output(g.softmax(g.silu(h), -1))
    q = g.new_input((2, 4, 16), dtype=yr.bfloat16)
    k, v = (g.new_input((2, 2, 12, 16), dtype=yr.bfloat16) for _ in range(2))
    g.mark_output(g.attention(q, k, v, g.new_input((2,), dtype=yr.int32)))
    return g


def mixed_inputs(ids: list[int] | None = None, lengths: list[int] | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.tensor(ids or [1, 2, 3, 4, 5, 9]).reshape(2, 3), torch.randn(10, 8, generator=gen).half(),
            torch.randn(4, 8, generator=gen).half().t(), torch.randn(2, 4, 16, generator=gen).bfloat16(),
            torch.randn(2, 2, 12, 16, generator=gen).bfloat16(), torch.randn(2, 2, 12, 16, generator=gen).bfloat16(),
            torch.tensor(lengths or [5, 12], dtype=torch.int32)]


class _Entry(CUDABackend):
    """The CUDA backend up to its build stage: load hands back the verified cache entry."""

    def load(self, artifact: Artifact) -> Artifact:  # type: ignore[override]
        return artifact

    def target(self) -> str:
        """The compile-check archs on every machine (on a GPU host target() would be its one arch)."""
        return "sm_80,sm_90"


@pytest.fixture(scope="module")
def entry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Artifact]:
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    backend = _Entry()
    plan = build_plan(mixed_graph())
    return plan, compile_cached(backend, plan, root=tmp_path_factory.mktemp("cache"))


def signature_arity(source: str, kernel: str) -> int:
    """How many parameters the compiled source declares for ``kernel`` (what NVRTC saw)."""
    m = re.search(rf'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?{kernel}\(([^)]*)\)', source)
    assert m, kernel
    return len(m[1].split(","))


def launcher_for(entry: tuple[Any, Artifact], driver: FakeDriver, device: Any = None) -> PlanLauncher:
    _, artifact = entry
    meta, cubin = open_entry(artifact, "sm_80")
    module = CudaModule(cubin, 0, driver=driver, capability=(8, 0))
    return PlanLauncher(meta, module, device or torch.device("cpu"), lambda: 77)


def launcher_for_plan(plan: Any, driver: FakeDriver) -> PlanLauncher:
    """A launcher for ``plan`` over a cubin of empty kernels with its kernel names: the fake never runs them,
    and compiling the real ones is slow (the cache-entry tests above use real ones)."""
    meta = read_meta(CUDABackend().render(plan), "plan")
    stubs = "".join(f'extern "C" __global__ void {x.kernel}() {{}}\n' for x in meta.launches)
    module = CudaModule(compile_cuda(stubs, "sm_80", ptxas="never").cubin, 0, driver=driver, capability=(8, 0))
    return PlanLauncher(meta, module, torch.device("cpu"), lambda: 77)


# -- the cache entry alone is enough to load ----------------------------------------------------------------------
def test_the_cache_entry_holds_the_launch_metadata_and_a_cubin_per_arch(entry) -> None:
    plan, artifact = entry
    assert artifact.files == ("kernels.cu", "kernels.sm_80.cubin", "kernels.sm_90.cubin")
    rendered = render(plan, DIALECT)
    for arch in ARCHS:
        meta, cubin = open_entry(artifact, arch)
        assert (meta.launches, meta.scratch, meta.steps) == (rendered.launches, rendered.scratch, rendered.steps)
        assert meta.inputs == tuple((n, plan.buffers[n].index, plan.buffers[n].dtype.name) for n in plan.inputs)
        assert meta.outputs == tuple(plan.outputs)
        assert {b[0]: (b[1], b[2], b[3]) for b in meta.buffers} == {
            b.name: (b.dims, b.dtype.name, b.role) for b in plan.buffers.values() if b.role != "input"}
        info = inspect_cubin(cubin)
        assert info.arch == arch and {x.kernel for x in rendered.launches} <= set(info.kernels)
    source = (artifact.directory / "kernels.cu").read_text()
    assert source.endswith(rendered.source) and source == CUDABackend().render(plan)
    assert [x.check is not None for x in rendered.launches].count(True) == 2  # the test covers both checks


def test_launch_metadata_round_trips_for_seeded_random_graphs() -> None:
    from yirage.testing.random_graphs import seeded_graph

    plans = [build_plan(seeded_graph(seed)) for seed in range(4)] + [build_plan(w1_graph(16, 256, 256))]
    for seed, plan in enumerate(plans):
        rendered = render(plan, DIALECT)
        meta = read_meta(CUDABackend().render(plan), f"seed{seed}")
        assert (meta.launches, meta.scratch, meta.outputs, meta.steps) == (
            rendered.launches, rendered.scratch, tuple(plan.outputs), rendered.steps), seed
    assert any(type(x).__name__ == "Gemm" for x in meta.steps)  # the last plan's GEMM step round-trips too


def test_an_entry_without_metadata_or_without_the_device_arch_is_refused(entry, tmp_path: Path) -> None:
    _, artifact = entry
    with pytest.raises(LaunchError, match=r"not kernels.cu and kernels.sm_86.cubin.*delete it"):
        open_entry(artifact, "sm_86")
    with pytest.raises(LaunchHeaderError, match="x.cu does not start with a launch header line.*delete"):
        read_meta('extern "C" __global__ void k() {}\n', "x.cu")
    with pytest.raises(LaunchHeaderError, match="x.cu is damaged.*KeyError"):
        read_meta("// yirage-launch: " + json.dumps({"inputs": []}) + "\n", "x.cu")


# -- marshalling ------------------------------------------------------------------------------------------------------
def test_every_launch_gets_the_plan_buffers_in_order_on_the_current_stream(entry) -> None:
    plan, _ = entry
    rendered = render(plan, DIALECT)
    source = CUDABackend().render(plan)
    driver = FakeDriver()
    inputs = mixed_inputs()
    outputs = launcher_for(entry, driver)(inputs)
    assert [(o.shape, o.dtype) for o in outputs] == [
        (torch.Size(plan.buffers[n].dims), getattr(torch, plan.buffers[n].dtype.name)) for n in plan.outputs]
    launches = driver.of("cuLaunchKernel")
    assert [x[0] for x in launches] == [x.kernel for x in rendered.launches]
    known = {n: inputs[plan.buffers[n].index].data_ptr() for n in plan.inputs}
    known.update({n: o.data_ptr() for n, o in zip(plan.outputs, outputs, strict=True)})
    internal: dict[str, int] = {}
    for (name, grid, block, shared, stream, pointers, extra), want in zip(launches, rendered.launches, strict=True):
        assert (grid, block, shared, stream, extra) == ((want.groups, 1, 1), (want.local, 1, 1), 0, 77, 0)
        assert len(pointers) == len(want.args) == signature_arity(source, name)
        for arg, ptr in zip(want.args, pointers, strict=True):
            if arg in known:
                assert ptr == known[arg], (name, arg)
            else:  # a temporary or scratch: one buffer per name for the whole call
                assert internal.setdefault(arg, ptr) == ptr and ptr not in known.values(), (name, arg)
    assert len(set(internal.values())) == len(internal)
    memsets = {ptr: (value, count, stream) for ptr, value, count, stream in driver.of("cuMemsetD8Async")}
    first_launch = driver.names().index("cuLaunchKernel")
    assert all(n != "cuMemsetD8Async" for n in driver.names()[first_launch:])  # zeroed before any kernel runs
    assert memsets == {internal[s.name]: (0, s.count * getattr(torch, s.dtype).itemsize, 77) for s in rendered.scratch}
    statuses = [internal[x.check.status] for x in rendered.launches if x.check]
    assert [src for _, src, count, _ in driver.of("cuMemcpyDtoHAsync")] == statuses
    assert driver.names()[-len(statuses) - 1:] == ["cuMemcpyDtoHAsync"] * len(statuses) + ["cuStreamSynchronize"]
    assert driver.depth == 0


def test_a_plan_without_checks_never_waits() -> None:
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    g = yr.new_kernel_graph()
    x = g.new_input((5, 7), dtype=yr.float64)
    g.mark_output(g.exp(g.add(x, x)))
    driver = FakeDriver()
    (out,) = launcher_for_plan(build_plan(g), driver)([torch.zeros(5, 7, dtype=torch.float64)])
    assert (out.shape, out.dtype) == ((5, 7), torch.float64)
    assert driver.names().count("cuLaunchKernel") == 1 and not WAITS_AND_READS & set(driver.names())


# -- large plain matmuls through torch's cuBLAS ---------------------------------------------------------------------
def gemm_graph() -> yr.KernelGraph:
    """Batched products with a transposed, batch-broadcast weight (plain GEMMs) in float32 and float64,
    beside a product too small for cuBLAS."""
    g = yr.new_kernel_graph()
    for dtype in (yr.float32, yr.float64):
        a, w = g.new_input((3, 64, 32), dtype=dtype), g.new_input((32, 48), strides=(1, 32), dtype=dtype)
        g.mark_output(g.matmul(a, w))
    g.mark_output(g.matmul(g.new_input((4, 8)), g.new_input((8, 4))))
    return g


def test_large_plain_matmuls_run_through_torch_matmul_on_the_stream() -> None:
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    plan = build_plan(gemm_graph())
    kernels = [x.kernel for x in render(plan, DIALECT).launches]
    gen = torch.Generator().manual_seed(3)
    inputs = []
    for t in (torch.float32, torch.float64):
        inputs += [torch.randn(3, 64, 32, generator=gen, dtype=t), torch.randn(48, 32, generator=gen, dtype=t).t()]
    inputs += [torch.randn(4, 8, generator=gen), torch.randn(8, 4, generator=gen)]
    driver = FakeDriver()
    outputs = launcher_for_plan(plan, driver)(inputs)
    small = plan.kernels[2].name  # the small product stays a kernel (or kernels), the big ones do not run
    launched = [x[0] for x in driver.of("cuLaunchKernel")]
    assert launched and all(x == small or x.startswith(f"{small}_") for x in launched), launched
    for out, a, w, tol in ((outputs[0], inputs[0], inputs[1], 1e-5), (outputs[1], inputs[2], inputs[3], 1e-12)):
        torch.testing.assert_close(out.double(), a.double() @ w.double(), rtol=tol, atol=tol * 32)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # (a module property: monkeypatch cannot restore it)
    try:
        driver = FakeDriver()
        launcher_for_plan(plan, driver)(inputs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    f64 = plan.kernels[1].name  # float32 under TF32: the IEEE kernels run; float64 still goes to torch
    assert [x[0] for x in driver.of("cuLaunchKernel")] == [x for x in kernels if x != f64 and
                                                           not x.startswith(f"{f64}_")]


def _steps(plan: Any) -> list[Any]:
    """The steps of ``plan`` as the CUDA backend's cache entry records them (launch metadata, round-tripped)."""
    return list(read_meta(CUDABackend().render(plan), "plan").steps)


def test_only_large_float_products_with_a_plain_weight_become_gemm_steps(entry) -> None:
    from yirage.codegen.cstyle import Gemm

    plan, _ = entry
    assert not any(isinstance(x, Gemm) for x in _steps(plan))  # 8 x 8 x 4, float16
    g = yr.new_kernel_graph()
    g.mark_output(g.matmul(g.new_input((64, 64), dtype=yr.float16), g.new_input((64, 128), dtype=yr.float16)))
    assert not any(isinstance(x, Gemm) for x in _steps(build_plan(g)))  # float16 weight: no float32 GEMM of it
    g = yr.new_kernel_graph()
    g.mark_output(g.relu(g.matmul(g.new_input((64, 64)), g.new_input((64, 128)))))  # 2**19 multiply-adds
    gemm, epilogue = _steps(build_plan(g))
    assert isinstance(gemm, Gemm) and (gemm.a, gemm.b, gemm.a_dims, gemm.b_dims, gemm.out_dims, gemm.dtype) == (
        "in0", "in1", (64, 64), (64, 128), (64, 128), "float32")
    assert epilogue.args == ("out0", gemm.out) and (gemm.epilogue, gemm.fallback) == (epilogue.kernel, "k0_full")
    g = yr.new_kernel_graph()
    g.mark_output(g.matmul(g.new_input((64, 64)), g.new_input((64, 128))))
    (gemm,) = _steps(build_plan(g))  # a bare product: the GEMM writes the output, its fallback is the kernel
    assert (gemm.out, gemm.epilogue, gemm.fallback) == ("out0", "", "k0")


def w1_graph(m: int = 64, k: int = 4096, n: int = 4096) -> yr.KernelGraph:
    """W1 of docs/benchmarks.md: rms_norm(x) * gain @ W + residual, W stored like an nn.Linear weight (N, K)."""
    g = yr.new_kernel_graph()
    x, gain, r = g.new_input((m, k)), g.new_input((k,)), g.new_input((m, n))
    w = g.new_input((k, n), strides=(1, k))
    g.mark_output(g.add(g.matmul(g.mul(g.rms_norm(x, (k,)), gain), w), r))
    return g


def record_matmul(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.matmul records its arguments among the driver's calls (so their order shows) and computes nothing."""
    def matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        driver.calls.append(("torch.matmul", (a, b, out)))
        return out

    monkeypatch.setattr(torch, "matmul", matmul)


def test_a_fused_large_matmul_runs_prologue_then_torch_matmul_then_epilogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """W1 at full size: the views torch.matmul gets are checked against the graph (A: the (64, 4096) rows the
    prologue wrote; B: the caller's weight tensor with its own strides; out: the (64, 4096) buffer the epilogue
    reads), in the capturable path too; with TF32 allowed the IEEE fallback kernel runs and torch.matmul does not."""
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    plan = build_plan(w1_graph())
    x, gain, r = torch.empty(64, 4096), torch.empty(4096), torch.empty(64, 4096)
    w = torch.empty(4096, 4096).t()  # (K, N) with strides (1, K)
    driver = FakeDriver()
    launcher = launcher_for_plan(plan, driver)
    record_matmul(driver, monkeypatch)
    (out,) = launcher([x, gain, r, w])
    names = [n if n == "torch.matmul" else a[0] for n, a in driver.calls if n in ("cuLaunchKernel", "torch.matmul")]
    assert names == ["k0_pro", "torch.matmul", "k0"]
    (pro, epi), ((a, b, acc),) = driver.of("cuLaunchKernel"), driver.of("torch.matmul")
    pro_ptrs, epi_ptrs = pro[5], epi[5]
    assert pro_ptrs[1:] == (x.data_ptr(), gain.data_ptr())  # the prologue reads x and the gain ...
    assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (pro_ptrs[0], (64, 4096), (4096, 1), torch.float32)
    assert (b.data_ptr(), b.shape, b.stride()) == (w.data_ptr(), w.shape, w.stride())  # ... torch reads W as given
    assert (acc.shape, acc.stride(), acc.dtype) == ((64, 4096), (4096, 1), torch.float32)
    assert epi_ptrs == (out.data_ptr(), acc.data_ptr(), r.data_ptr())  # out = epilogue(acc, residual)
    assert acc.data_ptr() not in (x.data_ptr(), r.data_ptr(), w.data_ptr(), out.data_ptr(), a.data_ptr())

    run = launcher.capturable()
    driver.calls.clear()
    with monkeypatch.context() as m:
        _no_host_reads(m)
        run([x, gain, r, w])
    assert not WAITS_AND_READS & set(driver.names())
    assert [n if n == "torch.matmul" else a[0] for n, a in driver.calls
            if n in ("cuLaunchKernel", "torch.matmul")] == ["k0_pro", "torch.matmul", "k0"]

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # (a module property: monkeypatch cannot restore it)
    try:
        driver.calls.clear()
        (out,) = launcher([x, gain, r, w])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert "torch.matmul" not in driver.names()
    pro, full = driver.of("cuLaunchKernel")
    assert (pro[0], full[0]) == ("k0_pro", "k0_full")  # the whole fused kernel, reading the prologue's rows
    assert full[5] == (out.data_ptr(), pro[5][0], w.data_ptr(), r.data_ptr())


def test_steps_that_do_not_match_the_kernels_and_buffers_are_refused_at_load() -> None:
    from dataclasses import replace

    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    plan = build_plan(w1_graph(16, 256, 256))
    meta = read_meta(CUDABackend().render(plan), "plan")
    stubs = "".join(f'extern "C" __global__ void {x.kernel}() {{}}\n' for x in meta.launches)
    module = CudaModule(compile_cuda(stubs, "sm_80", ptxas="never").cubin, 0, driver=FakeDriver(), capability=(8, 0))
    pro, gemm, epi = meta.steps
    for steps, message in (((pro, replace(gemm, b="in9"), epi), "buffer in9 is not a buffer of the plan"),
                           ((pro, replace(gemm, dtype="float64"), epi), "buffer s_k0_a is torch.float32, not float64"),
                           ((pro, replace(gemm, fallback="k7"), epi), "step kernel k7 is not in the module"),
                           ((pro, gemm), "kernel k0 is neither a step"),
                           ((pro, epi), "kernel k0_full is neither a step")):
        with pytest.raises(LaunchError, match=f"steps do not match.*{message}.*delete the cache entry"):
            PlanLauncher(replace(meta, steps=steps), module, torch.device("cpu"), lambda: 77)


def split_cases() -> list[tuple[yr.KernelGraph, dict[str, tuple[str, ...]], Any, Any]]:
    """(graph, the kernels' argument names, the torch expressions of its prologue and epilogue, float64 oracle).

    The prologue and epilogue are the plan's expressions written in torch by hand (rms_norm(x) * gain rows;
    acc + residual / exp(a); silu(acc)); the oracle is the graph in float64 torch.
    """
    def w1_pro(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return x * gain * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    def w1_oracle(x: torch.Tensor, gain: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w1_pro(x.double(), gain.double()) @ w.double() + r.double()

    g = yr.new_kernel_graph()
    a, b = g.new_input((4, 64, 64), dtype=yr.float64), g.new_input((64, 64), dtype=yr.float64)
    g.mark_output(g.silu(g.matmul(g.exp(a), b)))
    return [(w1_graph(16, 256, 256), {"k0_pro": ("s_k0_a", "in0", "in1"), "k0": ("out0", "s_k0_acc", "in2")},
             (w1_pro, lambda acc, r: acc + r), w1_oracle),
            (g, {"k0_pro": ("s_k0_a", "in0"), "k0": ("out0", "s_k0_acc")},
             (torch.exp, torch.nn.functional.silu), lambda a, b: torch.nn.functional.silu(a.exp() @ b))]


def at(ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The memory at a raw address as a tensor of ``shape`` (shared, not copied): what a fake kernel acts on."""
    ctype = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}[dtype]
    n = 1
    for d in shape:
        n *= d
    return torch.frombuffer((ctype * n).from_address(ptr), dtype=dtype).view(shape)


def fake_kernels(plan: Any, args: dict[str, tuple[str, ...]], pro: Any, epi: Any, dtype: torch.dtype) -> dict:
    """k0_pro writes pro(inputs) as A's (batch, M, K) rows; k0 writes epi(acc, inputs) as the (batch, M, N) output."""
    (k,) = plan.kernels

    def ins(pointers: tuple[int, ...], names: tuple[str, ...]) -> list[torch.Tensor]:
        return [at(p, tuple(plan.buffers[n].dims), dtype) for p, n in zip(pointers, names, strict=True)]

    def fake_pro(dst: int, *srcs: int) -> None:
        at(dst, k.a_space, dtype).copy_(pro(*ins(srcs, args["k0_pro"][1:])))

    def fake_epi(dst: int, acc: int, *srcs: int) -> None:
        at(dst, k.space, dtype).copy_(epi(at(acc, k.space, dtype), *ins(srcs, args["k0"][2:])))

    return {"k0_pro": fake_pro, "k0": fake_epi}


def run_split_on_cpu() -> None:
    """Child process: each split case on CPU tensors through the launcher, fake kernels acting on raw memory."""
    for seed, (graph, args, (pro, epi), oracle) in enumerate(split_cases()):
        plan = build_plan(graph)
        assert {x.kernel: x.args for x in render(plan, DIALECT).steps if hasattr(x, "args")} == args
        inputs = [plan.buffers[n] for n in sorted(plan.inputs, key=lambda n: plan.buffers[n].index)]
        gen = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(*reversed(b.dims), generator=gen, dtype=getattr(torch, b.dtype.name)).t()
                   if b.strides[0] == 1 and len(b.dims) == 2 else
                   torch.randn(*b.dims, generator=gen, dtype=getattr(torch, b.dtype.name)) for b in inputs]
        assert [t.stride() for t in tensors] == [b.strides for b in inputs]
        dtype = tensors[0].dtype
        driver = FakeDriver(memory=True, kernels=fake_kernels(plan, args, pro, epi, dtype))
        (out,) = launcher_for_plan(plan, driver)(tensors)
        assert [a[0] for a in driver.of("cuLaunchKernel")] == ["k0_pro", "k0"]  # torch.matmul did the product
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(out.double(), oracle(*tensors).double(), rtol=tol, atol=tol)
    print("ok")


def test_prologue_torch_matmul_epilogue_on_cpu_equals_the_float64_oracle() -> None:
    """The split's math and wiring, without a GPU: the launcher runs the steps on CPU tensors with the real
    torch.matmul, and the fake driver runs the prologue and epilogue kernels as the torch expressions of the plan's
    prologue/epilogue, on the very memory the launcher passes. Proven: the step order, which buffer each kernel and
    the GEMM read and write, the GEMM's views (transposed weight, batch broadcast, float64), and that prologue ->
    GEMM -> epilogue computes the graph (vs float64 torch). Not proven: the CUDA code of the prologue and epilogue
    kernels (NVRTC compiles it in test_cuda_build; it runs only where a GPU exists)."""
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           "from test_cuda_launch import run_split_on_cpu; run_split_on_cpu()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr


# -- refusals ---------------------------------------------------------------------------------------------------------
def test_inputs_on_another_device_or_of_another_dtype_are_refused_before_any_launch(entry) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    driver = FakeDriver()
    launcher = launcher_for(entry, driver, device=torch.device("cuda", 0))
    # fake tensors say they live on cuda:1/cuda:0 and hold no data (refused before any address); a host with one real
    # GPU refuses even a fake cuda:1, so there the tensors from elsewhere are meta tensors
    away = "meta" if torch.cuda.is_available() and torch.cuda.device_count() < 2 else "cuda:1"
    with FakeTensorMode():
        elsewhere = [t.to(away) if away != "meta" else None for t in mixed_inputs()]
        on0 = [t.to("cuda:0") for t in mixed_inputs()]
    if away == "meta":
        elsewhere = [torch.empty_like(t, device="meta") for t in mixed_inputs()]
    with pytest.raises(LaunchError, match=rf"input 0 \(in0\) is on {away}, but this graph's kernels are loaded on "
                                          r"cuda:0: move it with t.to\('cuda:0'\)"):
        launcher(elsewhere)
    with pytest.raises(LaunchError, match=r"input 2 \(in2\) is on cpu, but .* cuda:0"):
        launcher(on0[:2] + [torch.zeros(8, 4, dtype=torch.float16)] + on0[3:])
    on0[1] = on0[1].float()
    with pytest.raises(LaunchError, match=r"input 1 \(in1\) has dtype torch.float32; its kernels were compiled for "
                                          r"torch.float16: pass t.to\(torch.float16\)"):
        launcher(on0)
    with pytest.raises(LaunchError, match="takes 7 input"):
        launcher(on0[:3])
    assert "cuLaunchKernel" not in driver.names() and "cuMemsetD8Async" not in driver.names()


# -- the capturable path --------------------------------------------------------------------------------------------
def _no_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a host sync or a host read of a tensor in a capturable call")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)


def test_capturable_calls_never_wait_or_read_device_memory(entry, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, _ = entry
    rendered = render(plan, DIALECT)
    driver = FakeDriver()
    launcher = launcher_for(entry, driver)
    run = launcher.capturable()  # arming: zeroes the status flags and waits, outside any capture
    assert driver.names()[-1] == "cuStreamSynchronize" and driver.of("cuStreamIsCapturing") == [(77,)]
    armed = [ptr for ptr, *_ in driver.of("cuMemsetD8Async")]
    driver.calls.clear()
    inputs = mixed_inputs(ids=[1, 2, 30, 4, 5, 9])  # a bad id: must not be noticed inside the call
    with monkeypatch.context() as m:
        _no_host_reads(m)
        first = run(inputs)
        second = run(inputs)
    assert not WAITS_AND_READS & set(driver.names()), driver.names()
    assert set(driver.names()) == {"cuMemsetD8Async", "cuLaunchKernel"}
    checked = [i for i, x in enumerate(rendered.launches) if x.check]
    calls = driver.of("cuLaunchKernel")
    for i in checked:  # both calls write the same, persistent, armed flags; no call re-zeroes them
        status_at = rendered.launches[i].args.index(rendered.launches[i].check.status)
        a, b = calls[i][5][status_at], calls[i + len(rendered.launches)][5][status_at]
        assert a == b and a in armed and a not in [ptr for ptr, *_ in driver.of("cuMemsetD8Async")]
    assert [o.shape for o in first] == [o.shape for o in second]


def test_capturable_must_be_armed_before_capture(entry) -> None:
    with pytest.raises(LaunchError, match=r"before `with torch.cuda.graph\(...\)`"):
        launcher_for(entry, FakeDriver(capturing=True)).capturable()


def test_the_capturable_path_of_an_executable_keeps_the_core_input_checks(entry) -> None:
    from yirage.backend.selection import registry
    from yirage.runtime.executable import Executable, InputError

    plan, _ = entry
    g = mixed_graph()
    exe = Executable(g, plan, registry().get("cpu"), launcher_for(entry, FakeDriver()), 0.0)
    run = capturable(exe)
    assert [o.dtype for o in run(mixed_inputs())] == [torch.float16, torch.bfloat16]
    bad = mixed_inputs()
    bad[2] = bad[2].contiguous()  # the plan reads in2 transposed
    with pytest.raises(InputError, match="strides"):
        run(bad)
    with pytest.raises(TypeError, match="backend='cuda'"):
        capturable(Executable(g, plan, registry().get("cpu"), lambda inputs: [], 0.0))
    core = exe.capturable()  # the same path through the core's public API
    assert isinstance(core, Executable) and [o.dtype for o in core(mixed_inputs())] == [torch.float16, torch.bfloat16]
    with pytest.raises(InputError, match="strides"):
        core(bad)
    core.check_status()  # nothing recorded
    with pytest.raises(yr.NotSupportedError, match="'cpu' has no capturable call path"):
        Executable(g, plan, registry().get("cpu"), lambda inputs: [], 0.0).capturable()


# -- status checks, with a fake that acts on memory (raw addresses: in a child process) ---------------------------
STATUS_SCRIPT = """
import sys, ctypes, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_cuda_launch import FakeDriver, launcher_for, mixed_inputs
from yirage.compiler.stages import Artifact

def embedding(out, ids, table, status):  # ids: 6 int64 in [0, 10), else status = position + 1
    for t, v in enumerate((ctypes.c_int64 * 6).from_address(ids)):
        if not 0 <= v < 10:
            ctypes.c_int32.from_address(status).value = t + 1

def attention(out, q, k, v, lengths, status, scores):  # lengths: 2 int32 in [1, 12]
    for b, n in enumerate((ctypes.c_int32 * 2).from_address(lengths)):
        if not 1 <= n <= 12:
            ctypes.c_int32.from_address(status).value = b + 1

entry = (None, Artifact(Path({directory!r}), {files!r}, "k", False))
launcher = launcher_for(entry, FakeDriver(memory=True, kernels={{"k0": embedding, "k3": attention}}))
def expect(error, pattern, fn):
    try:
        fn()
    except error as exc:
        assert __import__("re").search(pattern, str(exc)), str(exc)
    else:
        raise AssertionError(f"no {{error.__name__}} matching {{pattern!r}}")

launcher(mixed_inputs())  # good input: no error
expect(IndexError, r"ids must lie in \\[0, 10\\); the id at flat position 2 of input in0",
       lambda: launcher(mixed_inputs(ids=[1, 2, 10, 3, 4, 5])))
expect(ValueError, r"lengths must lie in \\[1, 12\\]; batch 1 has length 13",
       lambda: launcher(mixed_inputs(lengths=[3, 13])))
run = launcher.capturable()
run(mixed_inputs(ids=[1, 2, 3, -1, 4, 5]))  # recorded, not raised
run(mixed_inputs())
expect(IndexError, r"a capturable call had bad input: .*flat position 3", run.check_status)
run.check_status()  # re-armed: nothing pending
run(mixed_inputs(lengths=[0, 4]))
expect(ValueError, r"a capturable call had bad input: .*batch 0 has length unknown", lambda: launcher(mixed_inputs()))
launcher(mixed_inputs())
run.check_status()
print("ok")
"""


def test_bad_input_raises_after_a_default_call_and_at_the_next_check_after_capturable_ones(entry) -> None:
    _, artifact = entry
    code = STATUS_SCRIPT.format(tests=str(Path(__file__).parent), directory=str(artifact.directory),
                                files=artifact.files)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr


# -- where an NVIDIA GPU exists ------------------------------------------------------------------------------------
GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.version.cuda and not torch.version.hip),
    reason="needs an NVIDIA GPU and a CUDA build of torch: the driver-API launch path cannot run without one "
           "(this machine checks the launch path with a recording driver)")


def test_cuda_stays_unavailable_here_with_its_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert "cuda" not in [b.value for b in yr.get_available_backends()]
    g = yr.new_kernel_graph()
    g.mark_output(g.exp(g.new_input((4,))))
    with pytest.raises(yr.YirageError, match="unavailable: torch .* (CPU-only build|sees no CUDA device)"):
        g.compile("cuda")


@GPU
def test_where_a_gpu_exists_the_conformance_kit_runs_on_cuda() -> None:
    """tests/test_conformance.py runs the whole kit on every available backend that declares kernel dtypes."""
    from yirage.backend.selection import registry

    assert "cuda" in [b.value for b in yr.get_available_backends()]
    assert registry().get("cuda").kernel_dtypes >= {"float32", "float16", "bfloat16", "int64"}


@GPU
def test_a_captured_cuda_graph_replays_and_reports_bad_ids_at_check() -> None:
    code = textwrap.dedent("""
        import torch, yirage as yr
        from yirage_backend_cuda import capturable
        g = yr.new_kernel_graph()
        ids, table = g.new_input((8,), dtype=yr.int64), g.new_input((100, 32))
        g.mark_output(g.embedding(ids, table))
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randint(0, 100, (8,), device="cuda", generator=gen)
        w = torch.randn(100, 32, device="cuda", generator=gen)
        run = capturable(g.compile("cuda"))
        run([x, w])  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (out,) = run([x, w])
        for seed in range(3):
            x.copy_(torch.randint(0, 100, (8,), device="cuda", generator=gen))
            graph.replay()
            torch.testing.assert_close(out, torch.nn.functional.embedding(x, w), rtol=0, atol=0)
        run.check_status()
        x[5] = 100
        graph.replay()
        try:
            run.check_status()
        except IndexError as exc:
            assert "position 5" in str(exc), exc
        else:
            raise AssertionError("a bad id in a replay was not reported")
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr
