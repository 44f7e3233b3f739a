"""OpenCL on a host CPU device: large matmuls through the host BLAS, small plans on PoCL's in-thread device.

Both are choices of the opencl backend for CPU devices (``yirage_backend_opencl.devices``); the results must
not depend on them. Every path is compared with float64 torch: the ``Gemm`` step (prologue kernel ->
torch.matmul on the mapped buffers -> epilogue kernel) against the same plan with
``YIRAGE_OPENCL_HOST_GEMM=0`` (kernels only) and the oracle; the in-thread device runs in a subprocess,
since PoCL reads ``POCL_DEVICES`` once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import yirage as yr
from yirage.backend.selection import registry
from yirage.compiler.lower import build_plan

opencl = pytest.mark.skipif(not registry().get("opencl").availability().ok,
                            reason="no OpenCL device (pip install 'yirage-backend-opencl[pocl]')")
GEN = torch.Generator().manual_seed(11)


def _cpu_device() -> bool:
    from yirage_backend_opencl.devices import device, is_host_cpu

    return is_host_cpu(device()) and bool(device().host_unified_memory)


def _w1_with_residual(batch: int, k: int, n: int) -> yr.KernelGraph:
    g = yr.new_kernel_graph()
    x, gamma = g.new_input((batch, k)), g.new_input((k,))
    w = g.new_input((k, n), strides=(1, k))  # nn.Linear's (N, K) weight viewed as (K, N)
    r = g.new_input((batch, n))
    g.mark_output(g.add(g.matmul(g.mul(g.rms_norm(x, (k,), eps=1e-6), gamma), w), r))
    return g


def _oracle(x: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.double()
    return x64 @ w.double() + r.double()


@opencl
@pytest.mark.parametrize("host_gemm", ["1", "0"], ids=["host BLAS", "kernels only"])
@pytest.mark.parametrize("batch", [4, 16])
def test_large_matmul_with_prologue_and_epilogue_matches_float64(monkeypatch: pytest.MonkeyPatch, batch: int,
                                                                  host_gemm: str) -> None:
    if not _cpu_device():
        pytest.skip("the host-BLAS path is for OpenCL CPU devices that share host memory")
    monkeypatch.setenv("YIRAGE_OPENCL_HOST_GEMM", host_gemm)
    k, n = 384, 200
    x, gamma = torch.randn(batch, k, generator=GEN), torch.randn(k, generator=GEN)
    w, r = torch.randn(n, k, generator=GEN).t() / k**0.5, torch.randn(batch, n, generator=GEN)
    exe = _w1_with_residual(batch, k, n).compile(backend="opencl")
    steps = [type(s).__name__ for s in exe._run.steps]
    assert ("Gemm" in steps) == (host_gemm == "1"), steps
    for _ in range(2):  # the second call reuses the program's scratch and mapped buffers
        (out,) = exe([x, gamma, w, r])
        torch.testing.assert_close(out.double(), _oracle(x, gamma, w, r), rtol=2e-5, atol=2e-5)


@opencl
def test_gemv_stays_in_kernels_and_bad_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GEMV is bandwidth-bound: the kernels stream it; only products of HOST_GEMM_MIN_M rows go to the BLAS."""
    from yirage_backend_opencl.devices import DeviceSelectionError

    exe = _w1_with_residual(1, 1024, 512).compile(backend="opencl")
    assert not any(type(s).__name__ == "Gemm" for s in exe._run.steps)
    monkeypatch.setenv("YIRAGE_OPENCL_HOST_GEMM", "yes")
    with pytest.raises(DeviceSelectionError, match="YIRAGE_OPENCL_HOST_GEMM='yes'.*0 \\(OpenCL kernels only\\)"):
        _w1_with_residual(8, 1024, 512).compile(backend="opencl")


def test_plan_work_counts_elements_and_multiply_adds() -> None:
    pytest.importorskip("yirage_backend_opencl")
    from yirage_backend_opencl.devices import plan_work

    g = yr.new_kernel_graph()
    a, b = g.new_input((3, 5, 40)), g.new_input((40, 8))
    g.mark_output(g.exp(g.matmul(a, b)))  # one Matmul kernel with the exp fused as its epilogue
    assert plan_work(build_plan(g)) == 3 * 5 * 8 * 40
    g = yr.new_kernel_graph()
    g.mark_output(g.softmax(g.new_input((6, 7)), -1))
    assert plan_work(build_plan(g)) >= 6 * 7


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})


SMALL_AND_LARGE = """
    import torch, yirage as yr
    def swiglu(shape):
        g = yr.new_kernel_graph()
        a, b, r = (g.new_input(shape) for _ in range(3))
        g.mark_output(g.add(g.mul(g.silu(a), b), r))
        return g.compile(backend="opencl")
    gen = torch.Generator().manual_seed(3)
    for shape in ((16,), (1, 4096), (64, 4096)):
        exe = swiglu(shape)
        a, b, r = (torch.randn(shape, generator=gen) for _ in range(3))
        for _ in range(2):
            (out,) = exe([a, b, r])
            want = (a.double() * torch.sigmoid(a.double()) * b.double() + r.double()).float()
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        print(shape[-1], exe._run.device.name.split("-")[0])
"""


@opencl
def test_small_plans_run_on_pocls_in_thread_device_when_it_is_listed() -> None:
    from yirage_backend_opencl.devices import device

    if not device().name.startswith("pthread-"):
        pytest.skip("PoCL's basic device is a PoCL choice; this device is " + device().name)
    proc = _run(SMALL_AND_LARGE, {"POCL_DEVICES": "pthread basic"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["16", "basic", "4096", "basic", "4096", "pthread"], proc.stdout
    proc = _run(SMALL_AND_LARGE, {"POCL_DEVICES": "pthread basic", "YIRAGE_OPENCL_SMALL_WORK": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(proc.stdout.split()[1::2]) == {"pthread"}, proc.stdout
    proc = _run(SMALL_AND_LARGE, {"POCL_DEVICES": "pthread basic", "YIRAGE_OPENCL_SMALL_WORK": "lots"})
    assert proc.returncode != 0 and "YIRAGE_OPENCL_SMALL_WORK='lots' is not an integer" in proc.stderr
