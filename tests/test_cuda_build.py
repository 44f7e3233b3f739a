"""The CUDA backend's build stage: NVRTC compiles CUDA C to cubins for sm_80/sm_90 without a GPU.

Oracles: ``readelf`` (binutils) reads the cubins' ELF header and symbols
independently of ``yirage_backend_cuda.cubin``; the compiler's own verdict on
sources written to be right or wrong on a known line; torch for the GPU launch
(runs only where an NVIDIA GPU exists). Skips with the reason when NVRTC
(``pip install 'yirage-backend-cuda[nvrtc]'``) is not installed.
"""

from __future__ import annotations

import random
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from yirage_backend_cuda import BUILD_OPTIONS, CUDABackend, compile_check, nvrtc
from yirage_backend_cuda.check import conformance_sources
from yirage_backend_cuda.cubin import CubinError, inspect_cubin
from yirage_backend_cuda.driver import LaunchError, ScalarParam, TensorParam, pack_args
from yirage_backend_cuda.nvrtc import CompileError, ToolchainError, compile_cuda, toolchain, verify_ptx

ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module", autouse=True)
def _nvrtc_installed() -> None:
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")


POINTWISE = """\
extern "C" __global__ void scale_add(const float* __restrict__ x, float* __restrict__ y, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

SHARED = """\
extern "C" __global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[256];
    int t = threadIdx.x;
    int i = blockIdx.x * blockDim.x + t;
    partial[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) partial[t] += partial[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = partial[0];
}
"""

HALVES = """\
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void mixed(const __half* __restrict__ h, const __nv_bfloat16* __restrict__ b,
                                 float* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __half2float(__hmul(h[i], h[i])) + __bfloat162float(b[i]);
}
"""

KERNELS = {"pointwise": (POINTWISE, "scale_add"), "shared": (SHARED, "block_sum"), "halves": (HALVES, "mixed")}


def readelf(cubin: bytes, tmp_path: Path) -> tuple[int, int, set[str]]:
    """(e_machine, SM from e_flags, global FUNC symbols) as binutils' readelf reads them."""
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed: it is this test's independent reader of cubins")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    header = subprocess.run(["readelf", "-h", str(path)], capture_output=True, text=True, check=True).stdout
    symbols = subprocess.run(["readelf", "-sW", str(path)], capture_output=True, text=True, check=True).stdout
    assert "NVIDIA CUDA architecture" in header, header
    flags = int(re.search(r"Flags:\s+(0x[0-9a-f]+)", header)[1], 16)
    abi = int(re.search(r"ABI Version:\s+(\d+)", header)[1])
    sm = (flags >> 8) & 0xFF if abi >= 8 else flags & 0xFF
    funcs = {line.split()[-1] for line in symbols.splitlines() if " FUNC " in line and " GLOBAL " in line}
    return 190, sm, funcs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", sorted(KERNELS))
def test_hand_written_kernels_compile_to_a_cubin_for_the_arch(kind: str, arch: str, tmp_path: Path) -> None:
    source, entry = KERNELS[kind]
    result = compile_cuda(source, arch, name=f"{kind}.cu")
    machine, sm, funcs = readelf(result.cubin, tmp_path)
    assert (machine, f"sm_{sm}") == (190, arch)
    assert entry in funcs
    info = inspect_cubin(result.cubin)
    assert (info.arch, info.kernels) == (arch, (entry,))
    assert f".target {arch}" in result.ptx and f".entry {entry}" in result.ptx


def test_half_and_bfloat16_headers_come_from_the_installed_wheels() -> None:
    include = Path(toolchain().include_dir)
    assert (include / "cuda_fp16.h").is_file() and (include / "cuda_bf16.h").is_file()
    compile_cuda(HALVES, "sm_80")  # the headers are found by NVRTC: no CompileError


def test_compiling_leaves_the_interpreters_shared_bytes_alone() -> None:
    """NVRTC writes the log, cubin and PTX into the buffers it is handed. They were ``b" " * size``: an empty log has
    size 1, and ``b" " * 1`` is CPython's shared one-byte object, so NVRTC's NUL overwrote it and every later space
    written through a text stream came out as NUL (seen: a test's captured "Optimal config:\x00cpu"). In a child: a
    corrupted interpreter must not be this one."""
    code = textwrap.dedent("""
        import io
        from yirage_backend_cuda.nvrtc import compile_cuda
        result = compile_cuda('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }', "sm_80", ptxas="never")
        assert result.log == "" and result.cubin[:4] == b"\\x7fELF", (result.log, result.cubin[:4])
        shared = [bytes([i]) for i in range(256)]  # the interpreter's cached one-byte objects
        out = io.StringIO()
        print("a", "b", file=out)
        assert shared == [i.to_bytes(1, "little") for i in range(256)] and " ".encode() == b"\\x20", shared[32]
        assert out.getvalue() == "a b\\n", repr(out.getvalue())
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr


def test_a_syntax_error_names_its_line() -> None:
    source = 'extern "C" __global__ void k(float* x) {\n    x[0] = 1.0f;\n    x[1] = 2.0f\n}\n'
    with pytest.raises(CompileError) as info:
        compile_cuda(source, "sm_80", name="broken.cu")
    message = str(info.value)
    assert "broken.cu line 4" in message and "error" in message and "expected a \";\"" in message
    assert not info.value.warnings_only


def test_a_warning_fails_the_build_and_names_its_line() -> None:
    source = 'extern "C" __global__ void k(float* x) {\n    int unused;\n    x[0] = 1.0f;\n}\n'
    with pytest.raises(CompileError) as info:
        compile_cuda(source, "sm_90", name="warns.cu")
    message = str(info.value)
    assert "warns.cu line 2" in message and "int unused;" in message and "#177" in message
    assert info.value.warnings_only


def test_archs_are_checked_before_compiling() -> None:
    with pytest.raises(ValueError, match="sm_80"):
        compile_cuda(POINTWISE, "compute_80")
    with pytest.raises(ToolchainError, match="supports"):
        compile_cuda(POINTWISE, "sm_20")


def _ptxas_usable() -> str:
    path = shutil.which("ptxas")
    if path is None:
        return "no ptxas on PATH"
    version = nvrtc.ptxas_version(path)
    if version is None or version < toolchain().version:
        return f"ptxas {version} cannot read the PTX of {toolchain().describe()}"
    return ""


def test_ptxas_verifies_the_ptx_when_it_can() -> None:
    if why := _ptxas_usable():
        pytest.skip(why)
    assert compile_cuda(SHARED, "sm_90").ptxas.startswith("verified by ptxas")
    assert "not run" in compile_cuda(SHARED, "sm_90", ptxas="never").ptxas
    ptx = compile_cuda(POINTWISE, "sm_80").ptx.replace("ret;", "ret_nonsense;")
    with pytest.raises(CompileError, match="ptxas"):
        verify_ptx(ptx, "sm_80", "k.cu", toolchain())


def test_a_file_that_is_not_a_cubin_is_refused(tmp_path: Path) -> None:
    good = compile_cuda(POINTWISE, "sm_80").cubin
    with pytest.raises(CubinError, match="section table|symbol"):
        inspect_cubin(good[:200])
    with pytest.raises(CubinError, match="EM_CUDA"):
        inspect_cubin(Path(sys.executable).resolve().read_bytes()[:4096])
    with pytest.raises(CubinError, match="no ELF header"):
        inspect_cubin(b"// PTX, not a cubin\n" * 4)


def test_damaged_cubins_raise_cubin_error_and_nothing_else() -> None:
    good = compile_cuda(POINTWISE, "sm_80").cubin
    rng = random.Random(0)
    refused = 0
    for i in range(400):
        data = bytearray(good[:rng.randrange(len(good))] if i % 2 else good)
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            inspect_cubin(bytes(data))
        except CubinError:
            refused += 1
    assert refused > 100  # most damage is noticed; none of it escapes as another exception


def test_compile_check_counts_every_source_and_arch_and_lists_failures() -> None:
    sources = {"pointwise": POINTWISE, "shared": SHARED,
               "broken": 'extern "C" __global__ void k(float* x) {\n  x[0] = ;\n}\n'}
    report = compile_check(sources, ARCHS)
    assert (report.compiled, report.archs, report.ok) == (4, ARCHS, False)
    assert sorted((f.name, f.arch) for f in report.failures) == [("broken", "sm_80"), ("broken", "sm_90")]
    assert all("broken.cu line 2" in f.message and not f.warnings_only for f in report.failures)
    assert "4/6 compiled" in report.summary() and "FAIL broken [sm_80]" in report.summary()
    with pytest.raises(TypeError, match="sequence"):
        compile_check(sources, "sm_80")


SPILLS = """\
extern "C" __global__ void __launch_bounds__(1024, 2) spills(const float* __restrict__ x, float* __restrict__ y) {
    float v[40];
#pragma unroll
    for (int i = 0; i < 40; i++) v[i] = x[threadIdx.x + i * 1024];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 40; i++) s += v[i] * v[39 - i];
#pragma unroll
    for (int i = 0; i < 40; i++) y[threadIdx.x + i * 1024] = v[i] * s;
}
"""


def test_no_spills_fails_a_kernel_that_spills_and_reports_registers() -> None:
    """40 values live at once under a 32-register cap (1024 threads, 2 blocks per SM) must spill; the pointwise
    kernel must not. ptxas -v is the oracle; its log is parsed by ``resources.parse``."""
    from yirage_backend_cuda.resources import demangle, parse

    if why := _ptxas_usable():
        pytest.skip(why)
    report = compile_check({"pointwise": POINTWISE, "spills": SPILLS}, ("sm_90",), no_spills=True)
    assert [(f.name, f.kinds) for f in report.failures] == [("spills", ("spill",))]
    assert "spills" in report.failures[0].message and "bytes stored" in report.failures[0].message
    assert {r.function for _, _, r in report.resources} >= {"spills"}
    assert "registers" in report.summary() and "1 functions spill" in report.summary()
    assert compile_check({"spills": SPILLS}, ("sm_90",)).ok, "spills are checked only when asked"
    assert demangle("_ZN39_INTERNAL_00000000_9_kernel_cu_0062ca388y_gemv_3EPfPKfPK13__nv_bfloat16xx") == "y_gemv_3"
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\nptxas info    : Function properties for k\n"
           "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers\n")
    (k,) = parse(log)
    assert (k.function, k.registers, k.stack, k.spill_stores, k.spill_loads, k.spills) == ("k", 40, 8, 4, 4, True)


class _HandWritten(CUDABackend):
    """The CUDA backend with a fixed source, so the cache path is tested apart from the renderer."""

    def render(self, plan: object) -> str:
        return SHARED

    def load(self, artifact: object) -> object:
        return artifact

    def target(self) -> str:
        """The compile-check archs on every machine (on a GPU host target() would be its one arch)."""
        return ",".join(ARCHS)


def test_build_writes_one_private_cubin_per_target_arch_into_the_cache(tmp_path: Path) -> None:
    from yirage.compiler.stages import compile_cached

    backend = _HandWritten()
    assert backend.target() == "sm_80,sm_90"
    assert toolchain().fingerprint() in backend.fingerprint()
    artifact = compile_cached(backend, plan=None, root=tmp_path)
    assert artifact.rebuilt and artifact.files == ("kernels.cu", "kernels.sm_80.cubin", "kernels.sm_90.cubin")
    assert (artifact.directory / "kernels.cu").read_text() == SHARED  # the source, for load and for readers
    for name, arch in zip(artifact.files[1:], ARCHS, strict=True):
        path = artifact.directory / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        _, sm, funcs = readelf(path.read_bytes(), tmp_path)
        assert f"sm_{sm}" == arch and "block_sum" in funcs
    again = compile_cached(backend, plan=None, root=tmp_path)
    assert not again.rebuilt and again.directory == artifact.directory


def test_build_refuses_a_source_that_warns(tmp_path: Path) -> None:
    with pytest.raises(CompileError, match="line 2"):
        CUDABackend().build('extern "C" __global__ void k(float* x) {\n    int u;\n}\n', tmp_path)
    assert not list(tmp_path.iterdir())


def test_importing_the_plugin_loads_no_cuda_library() -> None:
    code = ("import sys, yirage, yirage_backend_cuda; "
            "bad = [m for m in ('cuda.bindings.nvrtc', 'cuda.bindings.driver') if m in sys.modules]; "
            "assert not bad, bad")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


# -- the launch path's argument checks (no GPU needed: they run before any driver call) -------------------
PARAMS = (ScalarParam("int32"), TensorParam("float32", 6))


@pytest.mark.parametrize(("args", "message"), [
    ((6, torch.zeros(6, dtype=torch.float64)), "dtype torch.float64"),
    ((6, torch.zeros(6, 2)[:, 0]), "not contiguous"),
    ((6, torch.zeros(7)), "7 elements"),
    ((6, torch.zeros(6)), "is on cpu"),
    ((2**31, torch.zeros(6)), "does not fit a int32"),
    ((1.5, torch.zeros(6)), "must be a Python int (int32), not float"),
    ((True, torch.zeros(6)), "must be a Python int"),
    ((6, [0.0] * 6), "torch tensor"),
    ((6,), "takes 2 arguments"),
])
def test_launch_arguments_are_checked_before_their_address_is_taken(args: tuple, message: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(message)):
        pack_args(PARAMS, args, device_index=0)


# -- where a GPU exists: load the cubin and launch it on torch tensors ---------------------------------------
GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.version.cuda and not torch.version.hip),
    reason="needs an NVIDIA GPU and a CUDA build of torch: the driver-API launch path cannot run without one "
           "(this machine compile-checks only)")


@GPU
def test_a_cubin_runs_on_the_gpu_and_matches_torch() -> None:
    code = textwrap.dedent(f"""
        import torch
        from yirage_backend_cuda.driver import CudaModule, ScalarParam, TensorParam
        from yirage_backend_cuda.nvrtc import compile_cuda
        major, minor = torch.cuda.get_device_capability(0)
        cubin = compile_cuda({POINTWISE!r}, f"sm_{{major}}{{minor}}").cubin
        kernel = CudaModule(cubin, 0).kernel("scale_add", (TensorParam("float32", 1000), TensorParam("float32", 1000),
                                                           ScalarParam("float32"), ScalarParam("int32")))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1000, device="cuda", generator=g)
        y = torch.randn(1000, device="cuda", generator=g)
        want = (3.0 * x.double() + y.double()).float()
        kernel(x, y, 3.0, 1000, grid=(4,), block=(256,))
        torch.cuda.synchronize()
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr


# -- every plan the conformance kit compiles, as the CUDA backend renders it ------------------------------------
def test_conformance_plans_compile_for_sm90_and_sm80() -> None:
    """The rendered source does not depend on the arch: two disjoint thirds of the plans (fixed samples) through
    NVRTC + ptxas, one for sm_90 and one for sm_80. ``make gpu-check``, which ``make test`` runs, compiles every
    plan for both (``check_conformance``)."""
    from yirage_backend_cuda.launch import read_meta

    from yirage.codegen.cstyle import Gemm

    sources = conformance_sources()
    assert len(sources) > 100  # the kit's cases, not an empty recording
    gemms = [x for name, src in sources.items() for x in read_meta(src, name).steps if isinstance(x, Gemm)]
    # large matmuls split around a cuBLAS GEMM: their prologue, epilogue and IEEE fallback kernels compile too
    assert any(g.epilogue for g in gemms) and any(not g.epilogue for g in gemms), gemms
    items = list(sources.items())
    samples = {"sm_90": dict(items[::3]), "sm_80": dict(items[1::3])}
    for report, expected in ((compile_check(sample, (arch,), options=BUILD_OPTIONS), len(sample))
                             for arch, sample in samples.items()):
        print(report.summary())
        errors = [f for f in report.failures if not f.warnings_only]
        assert not errors, "\n\n".join(f.message for f in errors[:3])
        assert not report.failures, "\n\n".join(f.message for f in report.failures[:3])  # warnings count as failures
        assert report.compiled == expected
