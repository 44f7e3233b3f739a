"""The cuda backend's resident megakernel (backends/cuda/yirage_backend_cuda/megakernel.py), checked without a GPU.

The kernel's source is read back independently of the renderer's tables: its parameters are the buffers the task
functions name, the step's tasks run in the launched runtime's order with a grid-wide barrier after each (a
missing barrier lets a layer read what the previous one has not written yet), the first ``begin`` runs before the
loop, and the loop leaves on an error, on no row left, on the host's stop request or at the step limit, all read
after one barrier. The host side runs over a real cubin and a recording driver: one cooperative launch per
decode, a grid no larger than the occupancy query allows, the mapped stop flag's device address as an argument,
Ctrl-C setting that flag. Where a GPU exists, the decode must equal transformers' (the GPU test at the end).
"""

from __future__ import annotations

import ctypes
import enum
import re
import shutil
import textwrap
from typing import Any

import pytest
import torch

pytest.importorskip("cuda.bindings", reason="the CUDA backend's tests need cuda-bindings")

from test_cuda_launch import FakeDriver  # noqa: E402
from test_cuda_pk_runtime import GPU, STREAM, _program, run_on_gpu  # noqa: E402
from yirage_backend_cuda import megakernel  # noqa: E402
from yirage_backend_cuda.driver import CudaModule  # noqa: E402
from yirage_backend_cuda.nvrtc import BUILD_OPTIONS, ToolchainError, compile_cuda, toolchain  # noqa: E402
from yirage_backend_cuda.pk_runtime import render_cuda  # noqa: E402

from yirage.persistent.control import Ctl  # noqa: E402
from yirage.persistent.cstyle import CTL  # noqa: E402

DEVICE_POINTER = 0xD0000  # the stand-in device address of the mapped stop flag


class MegaDriver(FakeDriver):
    """The recording driver plus what the resident runtime calls."""

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_NOT_READY = 600

    S = CUresult.CUDA_SUCCESS
    CU_MEMHOSTALLOC_DEVICEMAP = 2

    def __init__(self, per_sm: int = 4, busy_polls: int = 2, steps: int | None = None) -> None:
        super().__init__()
        self.per_sm, self.busy_polls, self.steps = per_sm, busy_polls, steps
        self.host = (ctypes.c_int32 * 1)()
        self.launch_args: tuple = ()

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, fn: Any, block: int, shared: int) -> tuple:
        self._ok("cuOccupancyMaxActiveBlocksPerMultiprocessor", fn[1], block, shared)
        return self.S, self.per_sm

    def cuMemHostAlloc(self, size: int, flags: int) -> tuple:
        self._ok("cuMemHostAlloc", size, flags)
        return self.S, ctypes.addressof(self.host)

    def cuMemHostGetDevicePointer(self, host: int, flags: int) -> tuple:
        assert host == ctypes.addressof(self.host)
        return self.S, DEVICE_POINTER

    def cuMemFreeHost(self, host: int) -> tuple:
        return (self.S,)

    def cuLaunchCooperativeKernel(self, fn: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                                  stream: int, params: Any) -> tuple:
        values, types = params
        assert len(values) == len(types)
        self._ok("cuLaunchCooperativeKernel", fn[1], (gx, gy, gz), (bx, by, bz), shared, stream)
        self.launch_args = (tuple(values), tuple(types))
        return (self.S,)

    def cuStreamQuery(self, stream: int) -> tuple:
        self._ok("cuStreamQuery", stream)
        if self.busy_polls:
            self.busy_polls -= 1
            return (self.CUresult.CUDA_ERROR_NOT_READY,)
        return (self.S,)


@pytest.fixture(scope="module")
def built():
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    program = _program(sampling=True, dtype="bfloat16")
    rendered, mega = render_cuda(program), megakernel.render_megakernel(program)
    cubins = [compile_cuda(source, "sm_90", name=name, options=BUILD_OPTIONS).cubin
              for source, name in ((rendered.source, "persistent.cu"), (mega.source, "megakernel.cu"))]
    return program, rendered, mega, cubins


def _runtime(built, driver: MegaDriver, config: dict | None = None, sm_count: int = 10):
    program, rendered, mega, (tasks, resident) = built
    module = CudaModule(tasks, 0, driver=driver, capability=(9, 0))
    mega_module = CudaModule(resident, 0, driver=driver, capability=(9, 0))
    return megakernel.CudaMegakernelRuntime(program, config or {"num_workers": 0}, module, lambda: STREAM, rendered,
                                            mega_module, mega, sm_count)


def _kernel_body(source: str) -> tuple[list[str], list[str]]:
    """The megakernel's parameter names and its body's statements, one per line."""
    m = re.search(r'extern "C" __global__ void __launch_bounds__\(\d+\) y_megakernel\((.*?)\) \{\n(.*?)\n\}\n',
                  source, re.S)
    assert m, "no y_megakernel in the source"
    return [p.split()[-1] for p in m.group(1).split(", ")], [line.strip() for line in m.group(2).splitlines()]


def test_the_kernel_runs_each_task_in_step_order_with_a_grid_barrier_after_each(built) -> None:
    program, rendered, mega, _ = built
    params, body = _kernel_body(mega.source)
    assert params == [*mega.buffers, "y_bar", "y_stop", "y_limit"]
    called = [(m.group(1), m.group(2).split(", ")) for line in body
              for m in [re.search(r"(y_\w+_\d+)\((.*), y_vg, (\d+)\);", line)] if m]
    tasks = [rendered.begin, *rendered.layers, rendered.commit, rendered.begin]
    assert [name[:name.rindex("_")] for name, _ in called] == [x.kernel[:x.kernel.rindex("_")] for x in tasks]
    assert [args for _, args in called] == [list(x.args) for x in tasks]
    loop = body.index(next(line for line in body if line.startswith("for (long long y_steps")))
    phases = [i for i, line in enumerate(body) if "y_vg = blockIdx.x" in line]
    for i, j in zip(phases, [*phases[1:], len(body)], strict=True):
        assert "y_grid_sync(y_bar);" in body[i + 1:j], f"no grid barrier after {body[i]}"
    assert phases[0] < loop < phases[1]  # the first begin runs once, before the loop
    leave = body[loop + 1]
    for slot in (Ctl.ERROR, Ctl.ALIVE, Ctl.STOP):
        assert f"[{int(slot)}]" in leave and leave.endswith("break;")
    assert sum(f"{CTL}[{int(Ctl.STOP)}] = *y_stop;" in line for line in body) == 2  # after each begin


def test_every_task_call_names_a_function_with_its_arguments_and_a_barrier_between_virtual_blocks(built) -> None:
    _, _, mega, _ = built
    functions = {m.group(1): m.group(2).split(", ") for m in
                 re.finditer(r"^static __device__ __noinline__ void (\w+)\((.*)\) \{$", mega.source, re.M)}
    _, body = _kernel_body(mega.source)
    for line in body:
        m = re.search(r"(y_\w+_\d+)\((.*)\);", line)
        if m and "y_vg" in line:
            assert len(functions[m.group(1)]) == len(m.group(2).split(", ")), line
            assert line.endswith("__syncthreads(); }"), line
    assert "__restrict__" not in mega.source  # a layer reads what other blocks wrote in this launch


def test_the_two_level_barrier_replaces_every_grid_barrier_and_gets_its_buffer(built, monkeypatch) -> None:
    """``YIRAGE_CUDA_GRID_SYNC=tree``: every ``y_grid_sync`` becomes ``y_grid_sync_tree`` (32 leaf counters on their
    own 128-byte lines, then a top counter), the source compiles, and the runtime zeroes and passes a barrier
    buffer holding every leaf's line; an unknown name is refused."""
    program, _, flat, _ = built
    monkeypatch.setenv(megakernel.GRID_SYNC_ENV, "tree")
    tree = megakernel.render_megakernel(program)
    _, flat_body = _kernel_body(flat.source)
    _, tree_body = _kernel_body(tree.source)
    assert [line.replace("y_grid_sync(", "y_grid_sync_tree(") for line in flat_body] == tree_body
    assert "y_grid_sync(y_bar)" not in tree.source and tree.bar_words == 32 * (megakernel.TREE_LEAVES + 1)
    cubin = compile_cuda(tree.source, "sm_90", name="megakernel.cu", options=BUILD_OPTIONS).cubin
    runtime = _runtime((program, built[1], tree, (built[3][0], cubin)), MegaDriver())
    assert runtime.bar.numel() == tree.bar_words and flat.bar_words == 2
    monkeypatch.setenv(megakernel.GRID_SYNC_ENV, "ring")
    with pytest.raises(Exception, match="YIRAGE_CUDA_GRID_SYNC=.ring. is not a megakernel synchronization"):
        megakernel.render_megakernel(program)


def test_one_cooperative_launch_decodes_with_a_grid_the_occupancy_allows(built) -> None:
    driver = MegaDriver(per_sm=4)
    runtime = _runtime(built, driver, sm_count=10)
    _, _, mega, _ = built
    assert runtime.grid == min(4 * 10, mega.widest, megakernel.BLOCKS_PER_SM * 10)
    runtime.ctl[Ctl.STEPS] = 0
    driver.calls.clear()

    def kernel_ran(*args: Any, **kwargs: Any) -> tuple:  # the kernel: commits 5 steps
        out = MegaDriver.cuLaunchCooperativeKernel(driver, *args, **kwargs)
        ctypes.c_int64.from_address(runtime.ctl.data_ptr() + 8 * int(Ctl.STEPS)).value = 5
        return out

    driver.cuLaunchCooperativeKernel = kernel_ran
    assert runtime.run(7) == 5
    (launch,) = driver.of("cuLaunchCooperativeKernel")
    assert launch == (megakernel.KERNEL, (runtime.grid, 1, 1), (mega.block, 1, 1), 0, STREAM)
    values, types = driver.launch_args
    assert list(values) == [*(runtime.buffers[b].data_ptr() for b in mega.buffers), runtime.bar.data_ptr(),
                            DEVICE_POINTER, 7]
    assert types[-1] is ctypes.c_longlong and all(t is ctypes.c_void_p for t in types[:-1])
    assert "cuLaunchKernel" not in driver.names() and len(driver.of("cuStreamQuery")) == 3


def test_num_workers_sets_the_grid_but_never_past_what_is_resident(built) -> None:
    assert _runtime(built, MegaDriver(per_sm=2), {"num_workers": 3}).grid == 3
    assert _runtime(built, MegaDriver(per_sm=1), {"num_workers": 10_000}, sm_count=2).grid == 2
    with pytest.raises(Exception, match="occupancy 0"):
        _runtime(built, MegaDriver(per_sm=0))


def test_ctrl_c_while_the_kernel_runs_sets_the_mapped_stop_flag_and_propagates(built, monkeypatch) -> None:
    driver = MegaDriver(busy_polls=100)
    runtime = _runtime(built, driver)

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(megakernel.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runtime.run(50)
    assert driver.host[0] == 1
    monkeypatch.undo()
    driver.busy_polls = 0
    runtime.run(1)  # a new decode clears the request
    assert driver.host[0] == 0
    runtime.stop()  # the exit hook's request reaches the device the same way
    assert driver.host[0] == 1


def test_the_runtime_is_chosen_by_its_environment_variable(monkeypatch) -> None:
    from yirage.backend.runtime_contract import LAUNCHED, RESIDENT
    from yirage.backend.selection import registry

    cuda = registry().get("cuda")
    monkeypatch.delenv(megakernel.RUNTIME_ENV, raising=False)
    assert cuda.persistent_kind is LAUNCHED
    monkeypatch.setenv(megakernel.RUNTIME_ENV, "megakernel")
    assert cuda.persistent_kind is RESIDENT and RESIDENT.ignores("num_local_schedulers")
    assert not RESIDENT.ignores("num_workers")
    monkeypatch.setenv(megakernel.RUNTIME_ENV, "fast")
    with pytest.raises(Exception, match="launched, megakernel"):
        megakernel.selected_runtime()


@GPU
def test_where_a_gpu_exists_the_megakernel_decodes_like_transformers() -> None:
    """The default synchronization (the others' greedy tokens: gpu-check's decode-variants part)."""
    code = textwrap.dedent("""
        import os, sys, tempfile, torch
        os.environ["YIRAGE_CUDA_PK_RUNTIME"] = "megakernel"
        from pathlib import Path
        sys.path.insert(0, "tests")
        from llm_oracle import assert_decode_matches, zoo_model
        from yirage.engine import GenerationConfig, InferEngine
        for kind, dtype in (("llama-gqa", torch.float32), ("qwen2-bias-tied", torch.bfloat16)):
            model = zoo_model(kind, dtype, Path(tempfile.mkdtemp()))
            engine = InferEngine(model.path, backend="cuda")
            free = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=32, eos_token_id=()))
            stepped = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=32, eos_token_id=(),
                                                                            output_logits=True))
            assert_decode_matches(model.reference, stepped.tokens, stepped.logits, label=model.label)
            assert torch.equal(free.tokens, stepped.tokens), (free.tokens, stepped.tokens)
        print("ok")
    """)
    run_on_gpu(code)


def test_a_batch_whose_shared_arrays_exceed_48_kib_is_refused_before_ptxas(built, monkeypatch) -> None:
    """ptxas adds up every task function's __shared__ arrays (it refused 83 KB at batch 64); the renderer says
    so first, naming the launched runtime, and the cuda backend then uses that runtime with a warning. The GEMVs
    reduce by warp shuffles and declare no __shared__ array, so batch 64 now fits (and compiles without spills);
    with the local-memory tree GEMV (a dialect without shuffles) it does not, and is refused."""
    from dataclasses import replace

    from yirage_backend_cuda.resources import ptxas_resources

    from yirage.models.config import LlamaConfig
    from yirage.models.llama import LlamaModel

    def program(batch: int):
        config = LlamaConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                        "vocab_size": 96})
        gen = torch.Generator().manual_seed(0)
        model = LlamaModel(config, {n: torch.randn(s, generator=gen) for n, s in config.weight_shapes().items()})
        model.reset_cache(batch, 8)
        tokens, step = torch.zeros(batch, 8, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64)
        return model.build_decoder(step, tokens, backend="reference").program

    wide = program(64)
    fits = megakernel.render_megakernel(wide)
    assert "__shfl_xor_sync" in fits.source
    assert megakernel._static_shared_bytes(fits.source) <= megakernel.SHARED_LIMIT
    ptx = compile_cuda(fits.source, "sm_90", name="megakernel.cu", options=BUILD_OPTIONS).ptx  # ptxas agrees
    if shutil.which("ptxas"):
        assert not [r for r in ptxas_resources(ptx, "sm_90") if r.spills or "gemv" in r.function and r.stack], \
            "a GEMV's acc[64] must stay in registers"
    monkeypatch.setattr(megakernel, "TASK_DIALECT", replace(megakernel.TASK_DIALECT, shuffle_xor=""))
    with pytest.raises(Exception, match=r"bytes of __shared__ memory .* YIRAGE_CUDA_PK_RUNTIME=launched"):
        megakernel.render_megakernel(wide)
    tree = megakernel.render_megakernel(program(16))
    assert megakernel._static_shared_bytes(tree.source) <= megakernel.SHARED_LIMIT
    compile_cuda(tree.source, "sm_90", name="megakernel.cu", options=BUILD_OPTIONS)
