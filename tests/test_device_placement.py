"""Every tensor lives where its backend computes: checked here, without a GPU, with a backend whose device is meta.

``MetaDevice`` is a test double for "a backend whose torch device is not the CPU": its device is ``meta``
(tensors with shapes and no data), so any tensor the LLM path or the conformance kit leaves on the CPU shows up
as a cpu tensor where a meta one was due, or as torch refusing to mix cpu and meta tensors in one op.

- The LLM path: ``InferEngine`` on it loads the weights, makes the KV caches, RoPE tables, tokens and step, runs
  the prefill and picks the first token, then builds the PersistentKernel; the double's runtime records the
  device of every tensor of the frozen program and stops there (a meta device cannot decode).
- The kit: the conformance cases run against it with ``KernelGraph.run`` replaced by a recorder of the devices
  of the inputs each case hands over (then the case stops: a meta device computes nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import yirage as yr
from yirage.backend.selection import registry

pytest_plugins = ["pytester"]

pytest.importorskip("transformers")

from llm_oracle import zoo_factory  # noqa: E402 - needs transformers


class Recorded(Exception):  # noqa: N818 - not an error: the double's way of stopping after it has looked
    """Raised by the double once it has recorded what it was given."""


class MetaDevice(yr.Backend):
    name = "metadev"
    priority = -1000  # never chosen by auto
    vendor = "test double"
    torch_device = "meta"
    device_kind = "gpu"
    kernel_dtypes = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64"})
    seen: dict[str, str] = {}

    def probe(self) -> yr.Availability:
        return yr.Availability(True, "a test double: tensors on the meta device, nothing computed", auto=False)

    def device_info(self, index: int = 0) -> yr.DeviceInfo:
        return yr.DeviceInfo("meta", "test double", "gpu", compute_units=4, memory_bytes=2**40)

    def memory_info(self, index: int = 0) -> yr.MemoryInfo:
        return yr.MemoryInfo(2**40, 0, 2**40, "test double")

    def default_config(self, device: yr.DeviceInfo) -> dict[str, int]:
        return {"num_workers": 1, "num_local_schedulers": 0}

    def persistent_runtime(self, program: Any, config: Any) -> Any:
        MetaDevice.seen = {name: str(t.device) for name, t in program.values.items()}
        MetaDevice.seen.update(step=str(program.step.device), tokens=str(program.tokens.device))
        raise Recorded

    def compile(self, plan: Any, graph: Any) -> Any:
        raise AssertionError("the kit's recorder stops every case before it compiles")


@pytest.fixture
def metadev(monkeypatch: pytest.MonkeyPatch) -> str:
    reg = registry()
    reg.names()  # every plugin loaded first, so the double is not dropped by a reload
    monkeypatch.setitem(reg._backends, MetaDevice.name, MetaDevice())
    return MetaDevice.name


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


@pytest.mark.parametrize(("kind", "dtype"), [("llama-gqa", None), ("qwen2-bias-tied", "bfloat16")])
def test_the_llm_path_puts_every_tensor_on_the_backends_device(zoo, metadev, kind, dtype) -> None:
    from yirage.engine import GenerationConfig, InferEngine

    engine = InferEngine(zoo(kind).path, backend=metadev, dtype=dtype)
    model = engine.model
    weights = [model.embed, model.norm, model.lm_head] + [t for blk in model.blocks for t in blk.values()]
    assert {str(t.device) for t in weights} == {"meta"}
    MetaDevice.seen = {}
    with pytest.raises(Recorded):  # prefill and the first pick ran on meta tensors (cpu ones would not mix)
        engine.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=4))
    assert MetaDevice.seen, "the runtime was never built"
    on_cpu = sorted(name for name, device in MetaDevice.seen.items() if device != "meta")
    assert not on_cpu, f"tensors of the decode step left off the backend's device: {on_cpu}"
    assert {"tokens", "step", "rope_cos", "k_cache0", "v_cache0", "embed"} <= set(MetaDevice.seen)
    caches = [*model.k_cache, *model.v_cache, model.cos, model.sin, engine._tokens, engine._step]
    assert {str(t.device) for t in caches} == {"meta"}


def test_a_quantized_dtype_the_backends_runtime_cannot_read_is_refused_before_loading(zoo, metadev) -> None:
    from yirage.engine import InferEngine
    from yirage.models.config import ModelError

    with pytest.raises(ModelError, match=r"'metadev'.* does not read q8_0 .*use a backend that does \(.*cpu"):
        InferEngine(zoo("llama-gqa").path, backend=metadev, dtype="q8_0")


RECORDER = """
import json, os
import pytest
import yirage as yr
from yirage.backend.selection import registry
from yirage.graph.kernel_graph import KernelGraph
from test_device_placement import MetaDevice

SEEN = []

def pytest_configure(config):
    reg = registry()
    reg.names()
    reg._backends[MetaDevice.name] = MetaDevice()

def _record(self, inputs, backend=None):
    values = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    SEEN.append([os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
                 [str(v.device) for v in values if hasattr(v, "device")]])
    pytest.skip("recorded")

KernelGraph.run = lambda self, inputs, backend=None: _record(self, inputs, backend)
KernelGraph.__call__ = lambda self, inputs=None, backend=None: _record(self, inputs, backend)

def pytest_unconfigure(config):
    with open(os.environ["YIRAGE_PLACEMENT_RECORD"], "w") as f:
        json.dump(SEEN, f)
"""


def test_the_kit_builds_every_input_on_the_backends_device(pytester: pytest.Pytester, monkeypatch) -> None:
    pytester.makeconftest(RECORDER)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the child imports MetaDevice from here
    record = pytester.path / "seen.json"
    monkeypatch.setenv("YIRAGE_PLACEMENT_RECORD", str(record))
    result = pytester.runpytest_subprocess("--pyargs", "yirage.testing.conformance", "--yirage-backend", "metadev",
                                           "-q", "-p", "no:cacheprovider")
    seen = json.loads(record.read_text())
    assert len(seen) > 300, result.stdout.str()[-3000:]  # every case that runs a graph reached the recorder
    allowed_elsewhere = ("test_inputs_on_another_device_are_refused",)  # hands over a cpu tensor on purpose
    wrong = [(case, devices) for case, devices in seen
             if not case.split("::")[-1].startswith(allowed_elsewhere) and any(d != "meta" for d in devices)]
    assert not wrong, f"{len(wrong)} kit cases hand the backend tensors off its device, e.g. {wrong[:5]}"
