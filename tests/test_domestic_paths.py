"""Which compiler path each domestic backend takes (its vendor's Triton, or the torch-device lowering), and why.

Devices are faked as in test_vendor.py (torch_npu / torch_mlu / torch_musa adapters registering
torch.npu / .mlu / .musa; MetaX, Iluvatar and Hygon devices under a faked torch.cuda). The vendor's
Triton is faked by injecting modules (``triton``, ``triton.backends.<name>``, ``triton.runtime.driver``
with an active driver reporting the vendor's GPUTarget) and the ``triton.backends`` entry points; the
expectations (backend names, targets, float64 support) come from FlagTree's backends and FlagGems'
vendor descriptors, written out here. Plans compiled on the torch path run on a faked device whose
torch device is pointed at "cpu", and are compared with torch in float64.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import os
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import yirage as yr
from yirage import cli
from yirage.backend.registry import Registry
from yirage.compiler.lower import build_plan

ALL_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64"})
NO_FP64 = ALL_DTYPES - {"float64"}

# name -> (adapter module, torch attribute, device name, triton.backends name, GPUTarget backend)
ADAPTERS = {
    "ascend": ("torch_npu", "npu", "Ascend910B3", "ascend", "npu"),
    "cambricon": ("torch_mlu", "mlu", "MLU370-X8", "mlu", "mlu"),
    "moore": ("torch_musa", "musa", "MTT S4000", "mthreads", "musa"),
}
# name -> (torch.cuda device names, torch.version.cuda, torch.version.hip, triton.backends name, GPUTarget backend)
CUDA_LIKE = {
    "metax": (["MetaX C500"], "11.6", None, "metax", "maca"),
    "iluvatar": (["Iluvatar BI-V150"], "10.2", None, "iluvatar", "cuda"),
    "hygon": (["DCU K100_AI"], None, "5.7.24", "hcu", "hip"),
}
DOMESTIC = [*ADAPTERS, *CUDA_LIKE]
# what the probe's fallback reason must name: the device side found, and the missing vendor Triton
MISSING = {
    "ascend": "torch_npu is present but triton-ascend is not installed",
    "cambricon": "torch_mlu is present but Cambricon's Triton is not installed",
    "moore": "torch_musa is present but Moore Threads' Triton is not installed",
    "metax": "MetaX's torch build sees the device but MetaX's Triton is not installed",
    "iluvatar": "Iluvatar CoreX's torch build sees the device but Iluvatar's Triton is not installed",
    "hygon": "Hygon's torch build sees the device but a ROCm Triton is not installed",
}
# FlagGems' vendor descriptors: fp64_enabled=False for ascend, cambricon, mthreads and iluvatar
TRITON_DTYPES_OF = {"ascend": NO_FP64, "cambricon": NO_FP64, "moore": NO_FP64, "iluvatar": NO_FP64,
                    "metax": ALL_DTYPES, "hygon": ALL_DTYPES}


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Triton at all: imported triton modules hidden, ``import triton`` failing, no triton.backends entry points."""
    for key in [k for k in sys.modules if k == "triton" or k.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.setitem(sys.modules, "triton", None)
    real = importlib.metadata.entry_points

    def entry_points(**kw):
        return [] if kw.get("group") == "triton.backends" else real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def fake_triton(monkeypatch: pytest.MonkeyPatch, backends: list[str], target: str | Exception,
                version: str = "3.2.0") -> None:
    """A vendor Triton: ``triton`` at ``version`` with ``triton.backends.<b>`` and a driver reporting ``target``."""
    triton = types.ModuleType("triton")
    triton.__version__ = version
    triton.__path__ = []
    monkeypatch.setitem(sys.modules, "triton", triton)
    for name in ("triton.backends", "triton.runtime", *(f"triton.backends.{b}" for b in backends)):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    def get_current_target():
        if isinstance(target, Exception):
            raise target
        return SimpleNamespace(backend=target, arch="arch0", warp_size=32)

    driver = types.ModuleType("triton.runtime.driver")
    driver.driver = SimpleNamespace(active=SimpleNamespace(get_current_target=get_current_target))
    monkeypatch.setitem(sys.modules, "triton.runtime.driver", driver)


def fake_device(monkeypatch: pytest.MonkeyPatch, name: str) -> Registry:
    """The vendor's device as its torch build shows it; a fresh registry."""
    if name in ADAPTERS:
        adapter, attr, device, _, _ = ADAPTERS[name]
        module = SimpleNamespace(
            is_available=lambda: True, device_count=lambda: 2, get_device_name=lambda i: device,
            get_device_properties=lambda i: SimpleNamespace(name=device, total_memory=32 << 30),
            mem_get_info=lambda i: (30 << 30, 32 << 30))
        monkeypatch.setitem(sys.modules, adapter, types.ModuleType(adapter))
        monkeypatch.setattr(torch, attr, module, raising=False)
    else:
        names, cuda, hip, _, _ = CUDA_LIKE[name]
        props = [SimpleNamespace(name=n, total_memory=16 << 30, multi_processor_count=80, major=8, minor=0)
                 for n in names]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.version, "hip", hip)
    return Registry(environ={})


def vendor_backend_and_target(name: str) -> tuple[str, str]:
    spec = ADAPTERS.get(name) or CUDA_LIKE[name]
    return spec[3], spec[4]


# -- the choice and its reasons -----------------------------------------------------------------


@pytest.mark.parametrize("name", DOMESTIC)
def test_without_the_vendors_triton_the_torch_lowering_is_chosen_and_explained(monkeypatch, no_triton, name) -> None:
    backend = fake_device(monkeypatch, name).get(name)
    avail = backend.availability()
    assert avail.ok, avail.reason
    assert "kernels: unfused torch ops (no vendor Triton:" in avail.reason
    path = backend.kernel_path()
    assert path.path == "torch" and path.settled
    assert MISSING[name] in path.reason and "unfused torch ops on the device" in path.reason
    assert path.summary().startswith("uses: torch lowering (")
    assert backend.kernel_dtypes == ALL_DTYPES
    assert backend.schedule_knobs(build_plan(_graph_and_oracle()[0])) == []  # the lowering has no schedule
    if name in ("metax", "iluvatar"):
        assert "CUDA dialect" in path.reason and "later step" in path.reason


@pytest.mark.parametrize("name", DOMESTIC)
def test_with_the_vendors_triton_the_triton_path_is_chosen(monkeypatch, no_triton, name) -> None:
    triton_backend, target = vendor_backend_and_target(name)
    fake_triton(monkeypatch, [triton_backend], target)
    backend = fake_device(monkeypatch, name).get(name)
    avail = backend.availability()
    assert avail.ok, avail.reason
    assert f"kernels: Triton (triton 3.2.0, target {target}:arch0:32)" in avail.reason
    path = backend.kernel_path()
    assert path.path == "triton" and path.settled and f"backend '{triton_backend}'" in path.reason
    assert backend.kernel_dtypes == TRITON_DTYPES_OF[name]
    wide = yr.new_kernel_graph()
    wide.mark_output(wide.softmax(wide.new_input((2, 3000)), -1))
    knobs = backend.schedule_knobs(build_plan(wide))  # the Triton renderer's: narrower row blocks
    assert [(k.name, k.values[0]) for k in knobs] == [("block", 4096)], knobs


def test_the_triton_backends_entry_points_count_as_installed(monkeypatch, no_triton) -> None:
    """Triton 3.4+ lists backends as entry points (group triton.backends) rather than directories."""
    fake_triton(monkeypatch, [], "musa")
    real = importlib.metadata.entry_points
    ep = importlib.metadata.EntryPoint("mthreads", "triton.backends.mthreads", "triton.backends")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [ep] if kw.get("group") == "triton.backends" else real(**kw))
    assert fake_device(monkeypatch, "moore").get("moore").kernel_path().path == "triton"


def test_an_upstream_nvidia_triton_is_not_metaxs(monkeypatch, no_triton) -> None:
    fake_triton(monkeypatch, ["nvidia"], "cuda")
    path = fake_device(monkeypatch, "metax").get("metax").kernel_path()
    assert path.path == "torch"
    assert "backends nvidia and none of this vendor's: triton.backends.metax" in path.reason


@pytest.mark.parametrize(("target", "expected"), [
    (RuntimeError("2 active drivers ([<NvidiaDriver>, <IluvatarDriver>]). There should only be one."),
     "its driver failed: RuntimeError: 2 active drivers"),
    ("maca", "Triton's active driver targets maca:arch0:32, not corex or cuda"),
])
def test_a_vendor_triton_whose_driver_does_not_report_the_device_falls_back(monkeypatch, no_triton, target,
                                                                             expected) -> None:
    fake_triton(monkeypatch, ["iluvatar"], target)
    backend = fake_device(monkeypatch, "iluvatar").get("iluvatar")
    path = backend.kernel_path()
    assert path.path == "torch" and expected in path.reason
    assert "Iluvatar CoreX's torch build sees the device" in path.reason
    assert backend.kernel_dtypes == ALL_DTYPES


def test_a_triton_older_than_the_renderers_language_falls_back(monkeypatch, no_triton) -> None:
    fake_triton(monkeypatch, ["hcu"], "hip", version="2.1.0")
    path = fake_device(monkeypatch, "hygon").get("hygon").kernel_path()
    assert path.path == "torch" and "older than Triton 3.0" in path.reason


def test_the_path_is_memoized_with_the_probe_and_forget_probe_decides_again(monkeypatch, no_triton) -> None:
    backend = fake_device(monkeypatch, "ascend").get("ascend")
    assert backend.kernel_path().path == "torch"
    fake_triton(monkeypatch, ["ascend"], "npu")
    assert backend.kernel_path().path == "torch"  # decided with the probe
    backend.forget_probe()
    assert backend.kernel_path().path == "triton" and "Triton" in backend.availability().reason


@pytest.mark.parametrize("name", ["cambricon", "hygon"])
def test_an_absent_device_still_says_which_path_it_would_use(no_triton, monkeypatch, name) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend = Registry(environ={}).get(name)
    if backend.availability().ok:
        pytest.skip(f"a real {name} device is present")
    path = backend.kernel_path()
    assert path.path == "torch" and not path.settled
    assert path.summary() == f"would use: torch lowering ({backend.triton_name} not installed)"
    fake_triton(monkeypatch, [vendor_backend_and_target(name)[0]], "unused")
    backend.forget_probe()
    assert backend.kernel_path().summary().startswith("would use: Triton (triton 3.2.0, backend ")


# -- kernel graphs on the torch path ------------------------------------------------------------------


def _graph_and_oracle():
    g = yr.new_kernel_graph()
    x, w = g.new_input((4, 16)), g.new_input((16, 8))
    g.mark_output(g.softmax(g.matmul(g.relu(x), w), dim=-1))
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 16, generator=gen), torch.randn(16, 8, generator=gen)]
    expected = torch.softmax(inputs[0].double().relu() @ inputs[1].double(), dim=-1).float()
    return g, inputs, expected


@pytest.mark.parametrize("name", ["ascend", "metax"])
def test_a_plan_compiled_on_the_torch_path_runs_and_logs_the_fallback_once(monkeypatch, no_triton, caplog,
                                                                          name) -> None:
    backend = fake_device(monkeypatch, name).get(name)
    assert backend.availability().ok  # probed on the faked device; then its tensors are pointed at the CPU,
    backend.torch_device = "cpu"  # so the lowering really runs
    g, inputs, expected = _graph_and_oracle()
    with caplog.at_level(logging.WARNING, logger="yirage.backend"):
        run = backend.compile(build_plan(g), g)
        (out,) = run(inputs)
        backend.compile(build_plan(g), g)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    logged = [r.getMessage() for r in caplog.records if r.name == "yirage.backend" and "unfused" in r.getMessage()]
    assert len(logged) == 1 and MISSING[name] in logged[0]


TRITON_PATH_CHILD = """
import sys, types
from types import SimpleNamespace
import torch
import triton.runtime.driver
import yirage as yr
from yirage.backend.registry import Registry
from yirage.compiler.lower import build_plan

npu = SimpleNamespace(is_available=lambda: True, device_count=lambda: 1, get_device_name=lambda i: "Ascend910B3")
sys.modules["torch_npu"] = types.ModuleType("torch_npu")
torch.npu = npu
sys.modules["triton.backends.ascend"] = types.ModuleType("triton.backends.ascend")  # triton-ascend's backend
target = SimpleNamespace(backend="npu", arch="Ascend910B3", warp_size=0)
sys.modules["triton.runtime.driver"].driver = SimpleNamespace(active=SimpleNamespace(get_current_target=lambda: target))
backend = Registry(environ={}).get("ascend")
assert backend.availability().ok, backend.availability().reason
backend.torch_device = "cpu"  # Triton's interpreter runs on CPU tensors
assert backend.kernel_path().path == "triton", backend.kernel_path().reason
g = yr.new_kernel_graph()
x, w = g.new_input((4, 16)), g.new_input((16, 8))
g.mark_output(g.softmax(g.matmul(g.relu(x), w), dim=-1))
gen = torch.Generator().manual_seed(0)
inputs = [torch.randn(4, 16, generator=gen), torch.randn(16, 8, generator=gen)]
run = backend.compile(build_plan(g), g)
(out,) = run(inputs)
expected = torch.softmax(inputs[0].double().relu() @ inputs[1].double(), dim=-1).float()
torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
print("RAN", type(run).__name__, backend.availability().reason)
"""


def test_a_plan_compiled_on_the_triton_path_goes_through_the_triton_stages(tmp_path) -> None:
    """The real Triton in its interpreter (a child process: TRITON_INTERPRET=1 must precede importing triton),
    its active driver reporting an Ascend NPU, a faked torch_npu."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "YIRAGE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", TRITON_PATH_CHILD], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RAN TritonProgram Ascend910B3 (1 device(s)) via torch_npu; kernels: Triton (triton " in done.stdout
    assert "target npu:Ascend910B3:0)" in done.stdout


# -- PersistentKernel ------------------------------------------------------------------------------------


def test_a_persistent_kernel_on_the_torch_path_runs_the_reference_runtime_like_transformers(
        monkeypatch, no_triton, isolated_selection, tmp_path_factory) -> None:
    pytest.importorskip("transformers")
    from llm_oracle import assert_decode_matches, zoo_factory

    from yirage.engine import GenerationConfig, InferEngine
    from yirage.reference.persistent import ReferenceRuntime

    reg = fake_device(monkeypatch, "metax")
    assert reg.get("metax").availability().ok
    reg.get("metax").torch_device = "cpu"  # its torch.cuda device is faked: its tensors live on the CPU
    isolated_selection(reg)
    model = zoo_factory(tmp_path_factory)("llama-gqa")
    engine = InferEngine(model.path, backend="metax")
    n = 6  # greedy: transformers' first 6 tokens are a prefix of its longer decode
    reference = dataclasses.replace(model.reference, tokens=model.reference.tokens[:, :n],
                                    logits=model.reference.logits[:, :n])
    result = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=n, eos_token_id=(),
                                                                   output_logits=True))
    assert_decode_matches(reference, result.tokens, result.logits, label="metax, torch path")
    assert result.backend == "metax"
    assert [type(d.runtime) for d in engine._decoders.values()] == [ReferenceRuntime]


def test_a_persistent_kernel_on_the_triton_path_gets_the_launched_runtime(monkeypatch, no_triton) -> None:
    """Which runtime ``persistent_runtime`` builds (its decode is tested in test_launched_runtime.py)."""
    from yirage.persistent import launched

    fake_triton(monkeypatch, ["metax"], "maca")
    backend = fake_device(monkeypatch, "metax").get("metax")
    made = []
    monkeypatch.setattr(launched, "LaunchedRuntime", lambda program, config: made.append((program, config)) or "ok")
    assert backend.persistent_runtime("program", {"num_workers": 1}) == "ok"
    assert made == [("program", {"num_workers": 1})]
    assert backend.default_config(backend.device_info()) == {"num_workers": 1, "num_local_schedulers": 1}


# -- yirage_backend_manager.py info ------------------------------------------------------------------------


def test_info_shows_each_domestic_backends_path(monkeypatch, no_triton, isolated_selection, capsys) -> None:
    isolated_selection(fake_device(monkeypatch, "ascend"))
    info = cli.collect_info()
    rows = {b["name"]: b for b in info["backends"]}
    assert set(DOMESTIC) <= {n for n, b in rows.items() if "kernel_path" in b}
    ascend = rows["ascend"]["kernel_path"]
    assert ascend["path"] == "torch" and MISSING["ascend"] in ascend["reason"]
    assert ascend["summary"] == "uses: torch lowering (triton-ascend not installed)"
    if not rows["cambricon"]["available"]:
        expected = "would use: torch lowering (Cambricon's Triton not installed)"
        assert rows["cambricon"]["kernel_path"]["summary"] == expected
    assert "kernel_path" not in rows["reference"]
    cli.print_info(info)
    out = capsys.readouterr().out
    assert "Compiler paths" in out
    assert "  ascend     uses: torch lowering (triton-ascend not installed)" in out
    assert "kernels: unfused torch ops (no vendor Triton: triton-ascend not installed)" in out
