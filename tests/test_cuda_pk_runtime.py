"""The cuda backend's PersistentKernel runtime (backends/cuda/yirage_backend_cuda/pk_runtime.py).

Without a GPU: the runtime is built over a real cubin of the rendered kernels (NVRTC, sm_90) and a recording
stand-in for the CUDA driver (test_cuda_launch.FakeDriver), and what it launches is checked against the
renderer's own launch list, parsed independently from the CUDA source: every kernel exists, launches run in
the step's order (layers, commit, begin) with the rendered grid and block, each argument is the address of the
buffer the kernel's parameter names, and ``pick`` launches the picker layer alone. Where an NVIDIA GPU exists,
a decode on ``cuda`` must equal transformers' greedy tokens and logits (tests/test_persistent.py runs its
whole LLM suite on every available PersistentKernel backend; the test below is the cuda one in isolation).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import yirage as yr

pytest.importorskip("cuda.bindings", reason="the CUDA backend's tests need cuda-bindings: pip install "
                                            "'yirage-backend-cuda[nvrtc]'")

from test_cuda_launch import FakeDriver  # noqa: E402 - the recording driver of the launch tests
from yirage_backend_cuda.driver import CudaModule  # noqa: E402
from yirage_backend_cuda.nvrtc import BUILD_OPTIONS, ToolchainError, compile_cuda, toolchain  # noqa: E402
from yirage_backend_cuda.pk_runtime import TASKS, CudaPersistentRuntime, render_cuda  # noqa: E402

from yirage.models.config import LlamaConfig  # noqa: E402
from yirage.models.llama import LlamaModel  # noqa: E402
from yirage.persistent.control import Ctl  # noqa: E402
from yirage.persistent.cstyle import CTL, STEP  # noqa: E402

STREAM = 7  # the stand-in stream handle every launch must name


def _program(sampling: bool = False, dtype: str = "float32"):
    config = LlamaConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "vocab_size": 96})
    gen = torch.Generator().manual_seed(0)
    model = LlamaModel(config, {n: torch.randn(s, generator=gen) * 0.2 for n, s in config.weight_shapes().items()},
                       dtype)
    model.reset_cache(2, 16)
    tokens, step = torch.zeros(2, 16, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    picking = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3} if sampling else None
    return model.build_decoder(step, tokens, backend="reference", sampling=picking).program


@pytest.fixture(scope="module")
def built():
    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    program = _program(sampling=True, dtype="bfloat16")
    rendered = render_cuda(program)
    cubin = compile_cuda(rendered.source, "sm_90", name="persistent.cu", options=BUILD_OPTIONS).cubin
    return program, rendered, cubin


def _runtime(built) -> tuple[CudaPersistentRuntime, FakeDriver]:
    program, rendered, cubin = built
    driver = FakeDriver()
    module = CudaModule(cubin, 0, driver=driver, capability=(9, 0))
    return CudaPersistentRuntime(program, {"num_workers": 1, "num_local_schedulers": 0}, module, lambda: STREAM,
                                 rendered), driver


def _parameters(source: str) -> dict[str, list[str]]:
    """kernel name -> its parameter names, read from the CUDA source (independently of the renderer's tables)."""
    found = {}
    for m in re.finditer(r'^extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\((.*)\) \{$', source,
                         re.M):
        found[m.group(1)] = [p.split()[-1] for p in m.group(2).split(", ")]
    return found


def test_a_step_launches_the_rendered_kernels_in_order_on_the_buffers_they_name(built) -> None:
    runtime, driver = _runtime(built)
    _, rendered, _ = built
    params = _parameters(rendered.source)
    driver.calls.clear()
    runtime._step()
    launches = driver.of("cuLaunchKernel")
    expected = [*rendered.layers, rendered.commit, rendered.begin]
    assert [name for name, *_ in launches] == [x.kernel for x in expected]
    for (name, grid, block, shared, stream, values, _), x in zip(launches, expected, strict=True):
        assert grid == (x.groups, 1, 1) and block == (x.local, 1, 1) and shared == 0 and stream == STREAM
        assert len(params[name]) == len(values) == len(x.args), name
        assert list(values) == [runtime.buffers[a].data_ptr() for a in x.args], name
    assert {STEP, CTL} <= {a for x in expected for a in x.args}
    assert runtime.buffers[STEP] is runtime.program.step and runtime.buffers[CTL] is runtime.ctl
    assert runtime.ctl.numel() >= int(Ctl.ACTIVE) + runtime.program.batch


def test_pick_launches_the_picker_layer_alone(built) -> None:
    runtime, driver = _runtime(built)
    program, rendered, _ = built
    driver.calls.clear()
    logits = torch.randn(program.batch, program.picker.inputs["input"].dims[1])
    picked = runtime.pick(logits)
    names = [name for name, *_ in driver.of("cuLaunchKernel")]
    assert names == [x.kernel for x in rendered.layers if x.layer == program.picker.index]
    assert names and picked.shape == (program.batch,)
    assert torch.equal(runtime.values[program.picker.inputs["input"].name], logits)  # what the kernels read


def test_the_runtime_registers_the_c_family_bodies_and_runs_launched() -> None:
    from yirage.backend.runtime_contract import LAUNCHED
    from yirage.backend.selection import registry

    assert CudaPersistentRuntime.kind is LAUNCHED and registry().get("cuda").persistent_kind is LAUNCHED
    assert set(TASKS.bodies) >= {"embed", "rmsnorm_linear", "attention", "argmax", "sample"}
    assert registry().get("cuda").capabilities().persistent


def test_every_persistent_source_compiles_for_sm80_and_sm90() -> None:
    from yirage_backend_cuda.check import check_persistent

    try:
        toolchain()
    except ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    report = check_persistent()
    print(report.summary())
    # 4 models: launched kernels, megakernel; the first model's megakernel also with the tree and events syncs
    assert report.ok and report.compiled == 2 * (8 + 2), report.summary()


GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.version.cuda and not torch.version.hip),
    reason="needs an NVIDIA GPU and a CUDA build of torch (this machine checks the launches with a recording driver)")


@GPU
def test_where_a_gpu_exists_cuda_decodes_like_transformers() -> None:
    code = textwrap.dedent("""
        import sys, tempfile, torch
        from pathlib import Path
        sys.path.insert(0, "tests")
        from llm_oracle import assert_decode_matches, zoo_model
        from yirage.engine import GenerationConfig, InferEngine
        for kind, dtype in (("llama-gqa", torch.float32), ("qwen2-bias-tied", torch.bfloat16)):
            model = zoo_model(kind, dtype, Path(tempfile.mkdtemp()))
            engine = InferEngine(model.path, backend="cuda")
            assert engine.model.device.type == "cuda" and engine._tokens is None
            result = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=32, eos_token_id=(),
                                                                           output_logits=True))
            assert engine._tokens.device.type == "cuda" and engine.model.k_cache[0].device.type == "cuda"
            assert_decode_matches(model.reference, result.tokens, result.logits, label=model.label)
            again = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=32, eos_token_id=()))
            assert torch.equal(again.tokens, result.tokens)  # the replayed CUDA graph decodes the same
        print("ok")
    """)
    run_on_gpu(code)


def run_on_gpu(code: str) -> None:
    """``code`` in a fresh interpreter at the repository root (a GPU fault cannot take the test run with it); it
    must print "ok"."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_a_tensor_on_another_device_than_the_tokens_is_refused(built) -> None:
    program, rendered, cubin = built
    name = next(t.name for t in program.tensors if t.attached and t.name != "tokens")
    moved = {**program.values, name: program.values[name].to("meta")}  # as if on cuda:1 beside tokens on cuda:0
    stray = type(program)(**{**{f: getattr(program, f) for f in program.__dataclass_fields__}, "values": moved})
    module = CudaModule(cubin, 0, driver=FakeDriver(), capability=(9, 0))
    with pytest.raises(yr.NotSupportedError, match=rf"{name} \(meta\) live elsewhere"):
        CudaPersistentRuntime(stray, {}, module, lambda: STREAM, rendered)
