"""Capability-aware auto (issue 12, item 7): auto picks the best backend that can run what is asked.

The fake plugins here declare their abilities the way a third party would (class attributes and methods);
what auto must pick is worked out from facts stated in this file (cpu compiles graphs and runs
PersistentKernels when numba is installed, reference always does, torch is never chosen by auto), not
asked of the selection code. Results are compared with torch.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

import yirage as yr
from tests.conftest import numba_installed
from yirage import cli
from yirage.backend import selection
from yirage.backend.registry import Registry
from yirage.errors import NotSupportedError, PluginError

ALL_DTYPES = ["bfloat16", "float16", "float32", "float64", "int32", "int64"]

PLUGIN = '''
import torch
import yirage

YIRAGE_PLUGIN_API = 1

def _fake(name, priority, dtypes=(), runtime=False, caps=None):
    class Fake(yirage.Backend):
        pass
    Fake.name, Fake.priority, Fake.device_kind, Fake.vendor = name, priority, "gpu", "Fake Inc"
    Fake.probe = lambda self: yirage.Availability(True, f"{name} probe says ok")
    Fake.device_info = lambda self, index=0: yirage.DeviceInfo(f"{name}-device", "Fake Inc", "gpu", 7, 1 << 30)
    Fake.memory_info = lambda self, index=0: yirage.MemoryInfo(1 << 30, 0, 1 << 30, "fake")
    if dtypes:
        Fake.kernel_dtypes = frozenset(dtypes)
        Fake.compile = lambda self, plan, graph: (lambda inputs: [torch.relu(inputs[0]) + 1000])  # marked: +1000
    if runtime:
        Fake.persistent_runtime = lambda self, program, config: None
    if caps is not None:
        Fake.capabilities = caps
    return Fake

def _raise(self):
    raise RuntimeError("vendor SDK not initialised")

@yirage.hookimpl
def yirage_backends():
    return [
        _fake("probeonly", 1000),                                   # only probes: the case of the issue
        _fake("f32only", 500, dtypes={"float32"}),                  # compiles float32 graphs, no PK runtime
        _fake("liar", 400, dtypes={"float32"}, caps=lambda self: "everything"),
        _fake("crashy", 300, dtypes={"float32"}, caps=_raise),
    ]
'''


def best_capable() -> str:
    """The backend auto must land on once the fakes are passed over: cpu with numba, else reference."""
    return "cpu" if numba_installed() else "reference"


@pytest.fixture
def world(tmp_path, monkeypatch, isolated_selection) -> Registry:
    """The fake plugin, the built-in cpu backend and the core's torch and reference, nothing else."""
    (tmp_path / "capability_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "capability_plugin", raising=False)
    reg = Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1", "YIRAGE_PLUGINS": "capability_plugin,cpu"})
    isolated_selection(reg)
    return reg


def relu_graph(dtype=yr.float32, backend=None) -> yr.KernelGraph:
    g = yr.new_kernel_graph(backend=backend)
    g.mark_output(g.relu(g.new_input((4, 8), dtype=dtype)))
    return g


def test_a_probe_only_plugin_does_not_capture_unqualified_graphs(world) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g = relu_graph(yr.float64)  # float64: f32only cannot, and the liar/crashy backends do not count
    assert torch.equal(g(inputs=[x])[0], torch.relu(x))
    assert g.compile().backend.name == best_capable()
    report = {d.name: d for d in yr.last_auto_report()}
    assert report[best_capable()].chosen
    assert not report["probeonly"].chosen and not report["probeonly"].capable
    assert report["probeonly"].reason.startswith("cannot compile kernel graphs")
    assert "cannot compile kernel graphs in float64" in report["f32only"].reason
    assert "capabilities" in report["liar"].reason and "vendor SDK not initialised" in report["crashy"].reason
    assert report["torch"].capable and not report["torch"].auto  # passed over for its probe's auto=False


def test_auto_takes_a_capable_plugin_for_the_dtypes_it_declares(world) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    g = relu_graph(yr.float32)
    assert torch.equal(g(inputs=[x])[0], torch.relu(x) + 1000)  # the fake's marked result: it ran there
    assert g.compile().backend.name == "f32only"


def test_persistent_kernels_go_to_the_best_backend_with_a_runtime(world, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="yirage"):
        assert selection.current_backend(need="persistent").name == best_capable()
    report = {d.name: d for d in yr.last_auto_report()}
    assert "no PersistentKernel runtime" in report["probeonly"].reason
    assert "no PersistentKernel runtime" in report["f32only"].reason
    assert report[best_capable()].chosen and report[best_capable()].need == "persistent"
    assert any("run PersistentKernels" in r.getMessage() and "probeonly" in r.getMessage() for r in caplog.records)
    assert selection.current_backend(need="persistent") is selection.current_backend(need="persistent")


def test_set_backend_auto_stays_capability_aware(world) -> None:
    yr.set_backend("auto")
    assert selection.current_backend(need="kernel_graphs", dtypes=["float64"]).name == best_capable()
    assert selection.current_backend(need="kernel_graphs", dtypes=[torch.float32]).name == "f32only"


def test_a_named_backend_that_cannot_compile_graphs_is_refused_with_what_and_who(world) -> None:
    with pytest.raises(NotSupportedError) as err:
        yr.new_kernel_graph(backend="probeonly")
    message = str(err.value)
    assert "'probeonly'" in message and "cannot compile kernel graphs" in message
    assert best_capable() in message and "reference" in message and "f32only" in message
    yr.set_backend("probeonly")
    with pytest.raises(NotSupportedError, match=r"'probeonly' \(from set_backend\('probeonly'\)\) cannot compile"):
        relu_graph()(inputs=[torch.ones(4, 8)])


def test_a_named_backend_without_the_graph_dtype_is_refused(world) -> None:
    g = relu_graph(yr.float64, backend="f32only")  # it compiles kernel graphs: accepted here
    with pytest.raises(NotSupportedError) as err:
        g(inputs=[torch.ones(4, 8, dtype=torch.float64)])
    message = str(err.value)
    assert "cannot compile kernel graphs in float64" in message and "float32" in message
    assert best_capable() in message and "f32only, " not in message


def test_a_named_backend_without_a_persistent_runtime_is_refused(world, monkeypatch) -> None:
    with pytest.raises(NotSupportedError) as err:
        selection.resolve("torch", "PersistentKernel(backend=...)", need="persistent")
    message = str(err.value)
    assert "'torch' (from PersistentKernel(backend=...))" in message and "no PersistentKernel runtime" in message
    assert "reference" in message and "torch," not in message
    monkeypatch.setenv("YIRAGE_BACKEND", "f32only")
    yr.reset_backend()
    with pytest.raises(NotSupportedError, match=r"'f32only' \(from YIRAGE_BACKEND\) has no PersistentKernel"):
        selection.current_backend(need="persistent")


def test_malformed_capabilities_are_the_plugins_fault(world) -> None:
    with pytest.raises(PluginError, match=r"'liar'.*capabilities\(\) returned 'everything'.*bug in the plugin"):
        selection.resolve("liar", need="kernel_graphs")
    with pytest.raises(PluginError, match=r"'crashy'.*RuntimeError: vendor SDK not initialised"):
        selection.resolve("crashy", need="kernel_graphs")


def test_requests_are_checked() -> None:
    with pytest.raises(ValueError, match=r"'kernel_graphs', 'persistent'"):
        selection.current_backend(need="gpu")
    with pytest.raises(ValueError, match="only applies to need='kernel_graphs'"):
        selection.current_backend(dtypes=["float32"])
    with pytest.raises(TypeError, match="collection of dtype names"):
        selection.current_backend(need="kernel_graphs", dtypes="float32")


def test_info_shows_the_capabilities_as_columns(world, capsys) -> None:
    assert cli.main(["info", "--json"]) == 0
    rows = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    assert rows["probeonly"]["capabilities"] == {
        "kernel_graphs": False, "kernel_dtypes": [], "persistent": False, "weight_formats": [], "persistent_kind": ""}
    assert rows["f32only"]["capabilities"]["kernel_dtypes"] == ["float32"]
    reference = rows["reference"]["capabilities"]
    assert reference["kernel_graphs"] and reference["kernel_dtypes"] == ALL_DTYPES and reference["persistent"]
    assert rows["torch"]["capabilities"]["kernel_graphs"] and not rows["torch"]["capabilities"]["persistent"]
    assert "capabilities" in rows["liar"]["capabilities_error"]
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend "))
    assert lines[start].split()[3:5] == ["graphs", "PK"]
    table = lines[start + 2:lines.index("", start)]
    cells = {line.split()[0]: line.split()[3:5] for line in table}
    assert cells["probeonly"] == ["no", "no"]
    assert cells["f32only"] == ["float32", "no"]
    assert cells["torch"] == ["all", "no"]
    assert cells["reference"] == ["all", "serial+q4_0,q8_0"]  # its runtime's kind, then the quantized weights


def test_the_contract_documents_a_working_backend(tmp_path, monkeypatch, isolated_selection) -> None:
    """The complete backend in docs/plugin_contract.md loads, declares both capabilities and computes."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "plugin_contract.md").read_text(encoding="utf-8")
    source = doc.split("## 7.")[1].split("```python\n")[1].split("```")[0]
    (tmp_path / "documented_backend.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "documented_backend", raising=False)
    only = {"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1", "YIRAGE_PLUGINS": "documented_backend"}
    isolated_selection(Registry(environ=only))
    caps = selection.capabilities(selection.registry().get("mybackend"))
    assert caps.kernel_graphs and caps.persistent and caps.kernel_dtypes == frozenset(ALL_DTYPES)
    ids, table = torch.tensor([3, 0, 9]), torch.randn(10, 4, generator=torch.Generator().manual_seed(2))
    g = yr.new_kernel_graph(backend="mybackend")
    g.mark_output(g.embedding(g.new_input((3,), dtype=yr.int64), g.new_input((10, 4))))
    assert torch.equal(g(inputs=[ids, table])[0], table[ids])
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        g(inputs=[torch.tensor([3, 10, 0]), table])
    assert selection.current_backend(need="persistent").name == "mybackend"  # priority 15 beats reference
