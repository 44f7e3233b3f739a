"""Kernel graphs on the OpenCL backend (PoCL here): what the conformance kit does not cover.

Zero-copy buffers over torch's CPU memory (views with storage offsets,
unaligned and strided ones), programs and kernels built once per process,
device selection by ``YIRAGE_OPENCL_DEVICE``, and the compile cache entry.
Oracles are torch expressions. Anything that hands raw host memory to the
device runs in a subprocess, so a crash fails the test instead of the run.
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

pytestmark = pytest.mark.skipif(not registry().get("opencl").availability().ok,
                                reason="no OpenCL device (pip install 'yirage-backend-opencl[pocl]')")


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_views_with_offsets_unaligned_and_strided_inputs_read_the_right_memory() -> None:
    proc = _run("""
        import torch, yirage as yr
        g = yr.new_kernel_graph()
        x = g.new_input((5, 7))
        w = g.new_input((7, 5), strides=(1, 7))
        b = g.new_input((5,))
        g.mark_output(g.add(g.matmul(g.exp(x), w), b))
        gen = torch.Generator().manual_seed(0)
        big = torch.randn(200, generator=gen)
        xs = big[3:38].view(5, 7)                          # storage offset 12 bytes: unaligned for the device
        ws = torch.randn(5, 7, generator=gen).t()          # transposed weight
        bs = big[191:196]                                   # ends 4 elements before the storage does
        (out,) = g(inputs=[xs, ws, bs], backend="opencl")
        want = (xs.double().exp() @ ws.double() + bs.double()).float()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert big.data_ptr() != out.data_ptr()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_program_and_kernels_are_built_once_per_process() -> None:
    from yirage_backend_opencl import compile as clc

    def graph() -> yr.KernelGraph:
        g = yr.new_kernel_graph()
        x = g.new_input((4, 9))
        g.mark_output(g.softmax(g.mul(x, x), -1))
        return g

    first = graph().compile(backend="opencl")
    second = graph().compile(backend="opencl")  # a new graph object, the same plan
    assert first._run is second._run and isinstance(first._run, clc.OpenCLProgram)
    kernels = list(first._run.kernels.values())
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        (out,) = second([x])
        torch.testing.assert_close(out, torch.softmax(x * x, -1))
    assert [id(k) for k in second._run.kernels.values()] == [id(k) for k in kernels]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_host_memory_is_shared_not_copied_on_a_host_device(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """No per-call host copy, float16/bfloat16 included: kernels widen and round them as they load and store."""
    import pyopencl as cl
    from yirage_backend_opencl import compile as clc

    if not clc.device().host_unified_memory:
        pytest.skip("the OpenCL device does not share host memory")
    g = yr.new_kernel_graph()
    x = g.new_input((8, 16), dtype=dtype)
    g.mark_output(g.relu(x))
    exe = g.compile(backend="opencl")
    made = []
    real = cl.Buffer

    def recording(ctx, flags, size=0, hostbuf=None):  # type: ignore[no-untyped-def]
        made.append((flags, hostbuf.ctypes.data if hostbuf is not None else None))
        return real(ctx, flags, size, hostbuf)

    monkeypatch.setattr(cl, "Buffer", recording)
    t = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)).to(getattr(torch, dtype))
    (out,) = exe([t])
    assert torch.equal(out, t.relu())
    assert made and all(f & cl.mem_flags.USE_HOST_PTR and not f & cl.mem_flags.COPY_HOST_PTR for f, _ in made)
    assert {t.data_ptr(), out.data_ptr()} <= {p for _, p in made}


def test_bad_device_selection_names_the_devices() -> None:
    proc = _run("""
        import torch, yirage as yr
        from yirage_backend_opencl.compile import DeviceSelectionError
        g = yr.new_kernel_graph()
        g.mark_output(g.exp(g.new_input((3,))))
        try:
            g(inputs=[torch.zeros(3)], backend="opencl")
        except DeviceSelectionError as exc:
            print(exc)
    """, {"YIRAGE_OPENCL_DEVICE": "7:3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "YIRAGE_OPENCL_DEVICE='7:3' names no OpenCL device" in proc.stdout and "0:0" in proc.stdout


def test_explicit_device_selection_runs() -> None:
    proc = _run("""
        import torch, yirage as yr
        g = yr.new_kernel_graph()
        g.mark_output(g.exp(g.new_input((3,))))
        (out,) = g(inputs=[torch.zeros(3)], backend="opencl")
        assert torch.equal(out, torch.ones(3)), out
        print("ok")
    """, {"YIRAGE_OPENCL_DEVICE": "0:0"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_compiles_through_the_core_cache_as_opencl_source(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from yirage.compiler.lower import build_plan
    from yirage.compiler.stages import compile_cached

    g = yr.new_kernel_graph()
    g.mark_output(g.sqrt(g.new_input((5,))))
    backend = registry().get("opencl")
    run = compile_cached(backend, build_plan(g), root=tmp_path)
    files = list(tmp_path.rglob("kernels.cl"))
    assert len(files) == 1 and "__kernel void" in files[0].read_text()
    x = torch.arange(5.0)
    assert torch.equal(run([x])[0], torch.sqrt(x))


def test_every_row_group_size_the_renderer_offers_computes_the_softmax_and_rms_norm() -> None:
    """The ``group`` knob (``yirage.codegen.cstyle.schedule_knobs``): each work-group size a search may pick gives
    torch's float64 answer on rows longer and shorter than the group (tree reductions over idle lanes)."""
    from yirage.compiler.lower import build_plan
    from yirage.compiler.schedule import check_knobs, with_schedule

    backend = registry().get("opencl")
    gen = torch.Generator().manual_seed(5)
    for length in (3001, 100):
        g = yr.new_kernel_graph()
        x, r = g.new_input((3, length)), g.new_input((3, length))
        g.mark_output(g.softmax(x, -1))
        g.mark_output(g.rms_norm(g.add(x, r), (length,)))
        plan = build_plan(g)
        knobs = [k for k in check_knobs(backend.schedule_knobs(plan), plan, "opencl") if k.name == "group"]
        assert len(knobs) == 2 and all(len(k.values) >= (5 if length > 1000 else 2) for k in knobs), knobs
        xs, rs = torch.randn(3, length, generator=gen) * 4, torch.randn(3, length, generator=gen)
        want = [xs.double().softmax(-1), torch.nn.functional.rms_norm((xs + rs).double(), (length,), eps=1e-6)]
        for column in range(max(len(k.values) for k in knobs)):
            schedule = {k.kernel: {"group": k.values[min(column, len(k.values) - 1)]} for k in knobs}
            run = backend.compile(with_schedule(plan, schedule), g)
            for got, ref in zip(run([xs, rs]), want, strict=True):
                torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=1e-6, msg=str(schedule))


def test_a_work_group_the_device_refuses_is_a_launch_error_the_search_rejects(monkeypatch) -> None:
    """A group size a kernel cannot take (a real GPU's per-kernel limit can be under the device's) raises
    OpenCLLaunchError, a YirageError: superoptimize rejects that candidate and keeps searching."""
    import pyopencl as cl
    from yirage_backend_opencl.compile import OpenCLLaunchError

    from yirage import superopt

    real = cl.enqueue_nd_range_kernel

    def refuse_wide(queue, kernel, global_size, local_size, *args, **kwargs):  # noqa: ANN001, ANN202
        if local_size[0] > 256:
            raise cl.LogicError("clEnqueueNDRangeKernel failed: INVALID_WORK_GROUP_SIZE")
        return real(queue, kernel, global_size, local_size, *args, **kwargs)

    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", refuse_wide)
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(__import__("tempfile").mkdtemp()))
    monkeypatch.delenv(superopt.ENV, raising=False)
    g = yr.new_kernel_graph()
    x = g.new_input((4, 3000))
    g.mark_output(g.softmax(x, -1))
    best = g.superoptimize(backend="opencl", profile_iters=1, rounds=1, warmup_iters=0)
    wide = [t for t in best.report.trials if "group=512" in t.policy or "group=1024" in t.policy]
    assert wide and all(not t.verified and "OpenCLLaunchError" in t.error for t in wide), str(best.report)
    assert "group=512" not in best.report.winner and "group=1024" not in best.report.winner
    xs = torch.randn(4, 3000)
    torch.testing.assert_close(best([xs])[0].double(), xs.double().softmax(-1), rtol=1e-5, atol=1e-7)
    with pytest.raises(OpenCLLaunchError, match="groups of 1024"):
        from yirage.compiler.lower import build_plan
        from yirage.compiler.schedule import with_schedule

        plan = build_plan(g)
        registry().get("opencl").compile(with_schedule(plan, {plan.kernels[0].name: {"group": 1024}}), g)([xs])
