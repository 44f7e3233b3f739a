"""CUDA graph capture of compiled plans (``CUDABackend.capture``, graphs.py) and their replay by FusedInferEngine.

No GPU here, so ``torch.cuda``'s stream and graph API is replaced by a stand-in
built from torch's documented contract: ``torch.cuda.graph`` captures on a
stream of its own, where launches are recorded and not run, and
``CUDAGraph.replay()`` runs the recorded launches again on the same addresses
without the host. Under it the driver is the recording ``FakeDriver`` of
test_cuda_launch.py, acting on host memory with a Python stand-in for the
embedding kernel; the oracle is ``torch.nn.functional.embedding``. Raw
addresses: the memory-acting part runs in a child process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import yirage as yr

pytest.importorskip("cuda.bindings", reason="the CUDA backend's tests need cuda-bindings: "
                    "pip install 'yirage-backend-cuda[nvrtc]'")

from test_cuda_launch import FakeDriver, launcher_for_plan  # noqa: E402
from yirage_backend_cuda.nvrtc import ToolchainError, toolchain  # noqa: E402

from yirage.compiler.lower import build_plan  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def nvrtc() -> None:
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")


CHILD = textwrap.dedent('''
    import contextlib, ctypes, itertools, sys, torch
    sys.path.insert(0, {tests!r})
    import yirage as yr
    from test_cuda_launch import FakeDriver, WAITS_AND_READS
    from yirage.compiler.lower import build_plan
    from yirage.replay.graph_plans import BufferedGraphPlan, GraphCall
    from yirage.runtime.executable import Executable
    from yirage_backend_cuda import CUDABackend
    from yirage_backend_cuda.driver import CudaModule
    from yirage_backend_cuda.launch import PlanLauncher, read_meta
    from yirage_backend_cuda.nvrtc import compile_cuda

    def embedding(out, ids, table, status):  # ids: 8 int64 in [0, 100), rows of 32 float32
        for t, v in enumerate((ctypes.c_int64 * 8).from_address(ids)):
            if 0 <= v < 100:
                ctypes.memmove(out + 128 * t, table + 128 * v, 128)
            else:
                ctypes.c_int32.from_address(status).value = t + 1

    driver = FakeDriver(memory=True, kernels={{"k0": embedding}})

    class Stream:
        handles = itertools.count(100)
        def __init__(self, handle=None):
            self.handle = next(Stream.handles) if handle is None else handle
        def wait_stream(self, other):
            driver.calls.append(("wait_stream", (self.handle, other.handle)))

    class Graph:
        def __init__(self):
            self.launches = None
        def replay(self):  # the device runs what was recorded, on the recorded addresses; the host launches nothing
            for name, args in self.launches:
                if name == "cuMemsetD8Async":
                    ctypes.memset(args[0], args[1], args[2])
                elif name == "cuLaunchKernel":
                    driver.kernels[args[0]](*args[5])

    class FakeCuda:  # torch.cuda's stream and graph API, as documented
        current = Stream(7)
        Stream = Stream
        CUDAGraph = Graph
        @staticmethod
        def current_stream():
            return FakeCuda.current
        @staticmethod
        @contextlib.contextmanager
        def stream(s):
            before, FakeCuda.current = FakeCuda.current, s
            try:
                yield
            finally:
                FakeCuda.current = before
        @staticmethod
        @contextlib.contextmanager
        def graph(g):
            before, FakeCuda.current = FakeCuda.current, Stream(999)  # capture runs on a stream of its own
            driver.capturing, driver.memory, start = True, False, len(driver.calls)
            try:
                yield
            finally:
                g.launches = driver.calls[start:]
                driver.capturing, driver.memory, FakeCuda.current = False, True, before

    for name in ("Stream", "CUDAGraph", "current_stream", "stream", "graph"):
        setattr(torch.cuda, name, getattr(FakeCuda, name))

    g = yr.new_kernel_graph()
    ids, table = g.new_input((8,), dtype=yr.int64), g.new_input((100, 32))
    g.mark_output(g.embedding(ids, table))
    plan = build_plan(g)
    meta = read_meta(CUDABackend().render(plan), "plan")
    stub = compile_cuda('extern "C" __global__ void k0() {{}}', "sm_80", ptxas="never").cubin
    module = CudaModule(stub, 0, driver=driver, capability=(8, 0))
    launcher = PlanLauncher(meta, module, torch.device("cpu"), lambda: FakeCuda.current.handle)

    class OnHost(CUDABackend):  # CUDABackend.capture as shipped; tensors on the host for the fake
        torch_device = "cpu"

    replay = BufferedGraphPlan("fusion", Executable(g, plan, OnHost(), launcher, 0.0), "cpu")
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(100, 32, generator=gen)
    def call(x):
        return GraphCall([x, weights], None)

    first = torch.randint(0, 100, (8,), generator=gen)
    assert replay.capture(call(first)), "CUDABackend.capture returned no graph"
    names = driver.names()
    begin = max(i for i, (n, _) in enumerate(driver.calls) if n == "cuStreamIsCapturing")
    launches = [a for n, a in driver.calls if n == "cuLaunchKernel"]
    assert len(launches) == 2 and launches[0][4] not in (7, 999), launches  # warm-up: side stream
    assert launches[1][4] == 999, launches  # the captured launch, on the capture stream
    assert names.index("cuStreamSynchronize", begin) < [i for i, (n, _) in enumerate(driver.calls)
                                                         if n == "cuLaunchKernel"][0]  # flags armed first
    captured = replay.device_graph._captured._graph.launches
    assert [n for n, _ in captured] == ["cuLaunchKernel"], captured  # nothing waits or reads inside the capture
    host_launches = len(launches)
    for seed in range(3):
        x = torch.randint(0, 100, (8,), generator=gen)
        out = replay.run(call(x))[0]
        assert torch.equal(out, torch.nn.functional.embedding(x, weights)), seed
    assert len([1 for n, _ in driver.calls if n == "cuLaunchKernel"]) == host_launches  # replays launch nothing
    bad = torch.randint(0, 100, (8,), generator=gen)
    bad[5] = 100
    try:
        replay.run(call(bad))
    except IndexError as exc:
        assert "a capturable call had bad input" in str(exc) and "position 5" in str(exc), exc
    else:
        raise AssertionError("a bad id in a replay was not reported")
    x = torch.randint(0, 100, (8,), generator=gen)
    assert torch.equal(replay.run(call(x))[0], torch.nn.functional.embedding(x, weights))  # re-armed
    print("ok")
''')


def test_a_captured_plan_replays_new_inputs_without_host_launches_and_reports_bad_ids() -> None:
    code = CHILD.format(tests=str(Path(__file__).parent))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr


def test_check_status_of_a_plan_without_checks_never_waits() -> None:
    g = yr.new_kernel_graph()
    g.mark_output(g.exp(g.new_input((16,))))
    driver = FakeDriver()
    run = launcher_for_plan(build_plan(g), driver).capturable()
    driver.calls.clear()
    run(  # noqa: F841 - the call itself is what is recorded
        [torch.zeros(16)])
    run.check_status()
    assert set(driver.names()) == {"cuLaunchKernel"}, driver.names()


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.version.cuda and not torch.version.hip),
                    reason="needs an NVIDIA GPU and a CUDA build of torch (this machine checks capture and replay "
                           "with the stand-ins above)")
def test_where_a_gpu_exists_the_engine_replays_real_cuda_graphs() -> None:
    from yirage.replay import FusedInferEngine

    g = yr.new_kernel_graph()
    ids, table = g.new_input((8,), dtype=yr.int64), g.new_input((100, 32))
    g.mark_output(g.rms_norm(g.embedding(ids, table), (32,)))
    engine = FusedInferEngine(g, backend="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.randn(100, 32, device="cuda", generator=gen)
    for _ in range(3):
        x = torch.randint(0, 100, (8,), device="cuda", generator=gen)
        ref = torch.nn.functional.rms_norm(torch.nn.functional.embedding(x, weights), (32,), eps=1e-6)
        torch.testing.assert_close(engine(x, weights)[0], ref)
    stats = engine.get_stats()
    assert stats["device_graphs"] == stats["cached_shapes"] and stats["capture_fallbacks"] == 0
