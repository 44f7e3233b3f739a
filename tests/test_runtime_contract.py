"""The PersistentKernel runtime contract (issue 25, items 3 and 4): task bodies per LayerSpec kind, runtime kinds.

Expectations are written out here, apart from the registry: which kinds each runtime runs (every runtime
runs the single-device kinds; only the cpu runtime runs the collectives, through its communication
thread; the cpu runtime and the oracle run the screened LM head), how each backend's runtime runs a step,
and the control buffer's slot numbers as the C sources printed them before the layout moved into
``yirage.persistent.control``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import yirage as yr
from yirage import cli
from yirage.backend import selection
from yirage.backend.registry import Registry
from yirage.backend.runtime_contract import LAUNCHED, PERSISTENT, SERIAL
from yirage.persistent import control, runtime, specs
from yirage.persistent.runtime import RuntimeContractError, TaskBodies

COLLECTIVES = {"allreduce", "allgather"}  # the tensor-parallel layers
SCREEN = {"screened_logits"}  # the greedy LM head's second pass: the cpu runtime and the oracle
SINGLE_DEVICE_KINDS = {"embed", "rmsnorm_linear", "attention", "linear_with_residual",
                       "silu_mul_linear_with_residual", "argmax", "sample"}
#: runtime -> (the module that registers its task bodies, the kinds it runs, its kind)
RUNTIMES = {
    "cpu": ("yirage_backend_cpu.pk_runtime", SINGLE_DEVICE_KINDS | COLLECTIVES | SCREEN, PERSISTENT),
    "opencl": ("yirage_backend_opencl.pk_runtime", SINGLE_DEVICE_KINDS, LAUNCHED),
    "launched": ("yirage.persistent.launched", SINGLE_DEVICE_KINDS, LAUNCHED),
    "reference": ("yirage.reference.persistent", SINGLE_DEVICE_KINDS | SCREEN, SERIAL),
    "cuda": ("yirage_backend_cuda.pk_runtime", SINGLE_DEVICE_KINDS, LAUNCHED),
}


def registered() -> dict[str, TaskBodies]:
    """Every runtime's task table, after importing the modules that register them (those installed here)."""
    for name, (module, _, _) in RUNTIMES.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:  # a backend plugin not installed: its column is absent, and said so
            print(f"runtime {name}: not installed ({exc})")
    return dict(runtime.TASK_BODIES)


def test_every_layer_kind_has_a_body_or_a_reason_on_every_runtime() -> None:
    tables = registered()
    assert {"launched", "reference"} <= set(tables)  # the core's runtimes are always there
    kinds = list(specs.LAYER_SPECS)
    names = sorted(tables)
    rows = [["kind", *names]] + [[kind, *(tables[n].cell(kind) for n in names)] for kind in kinds]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n" + "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows))
    assert set(kinds) == SINGLE_DEVICE_KINDS | COLLECTIVES | SCREEN, \
        "a new LayerSpec kind: say here which runtimes run it"
    for name in names:
        missing = [kind for kind in kinds if tables[name].cell(kind) == "MISSING"]
        assert not missing, f"runtime {name} has no task body for {missing}"
        if name in RUNTIMES:  # a runtime added later (cuda) only has to cover every kind
            runs = RUNTIMES[name][1]
            for kind in kinds:
                assert tables[name].cell(kind) == ("body" if kind in runs else "declined"), (name, kind)


def load_copy(module: str) -> None:
    """Execute ``module``'s file again under another name: what importing it after a table change does."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    copy = importlib.util.spec_from_file_location(f"_contract_copy_of_{module.replace('.', '_')}", spec.origin)
    assert copy is not None and copy.loader is not None
    copy.loader.exec_module(importlib.util.module_from_spec(copy))


def test_a_new_layer_kind_without_a_body_fails_naming_the_runtime(monkeypatch) -> None:
    tables = registered()
    monkeypatch.setitem(specs.LAYER_SPECS, "rope_only", specs.LayerSpec("rope_only", "rope_only_layer", ("input",)))
    for name, table in tables.items():
        with pytest.raises(RuntimeContractError, match=rf"the {name} PersistentKernel runtime .*\['rope_only'\]"):
            runtime.check_task_bodies(table)
    for module, name in (("yirage.persistent.launched", "launched"), ("yirage.reference.persistent", "reference")):
        before = runtime.TASK_BODIES[name]
        with pytest.raises(RuntimeContractError, match=rf"the {name} PersistentKernel runtime .*rope_only"):
            load_copy(module)  # the import itself fails
        assert runtime.TASK_BODIES[name] is before


def test_a_deleted_body_fails_naming_the_runtime_and_the_kind() -> None:
    reference = registered()["reference"]
    bodies = {k: v for k, v in reference.bodies.items() if k != "sample"}
    with pytest.raises(RuntimeContractError, match=r"the reference PersistentKernel runtime .*\['sample'\]"):
        runtime.register_task_bodies("reference", bodies, declined=reference.declined, where=reference.where)
    assert runtime.TASK_BODIES["reference"] is reference
    with pytest.raises(RuntimeContractError, match="LAYER_SPECS does not have: \\['nope'\\]"):
        runtime.register_task_bodies("x", {**reference.bodies, "nope": None}, declined=reference.declined)
    assert "x" not in runtime.TASK_BODIES


def test_a_declined_kind_is_refused_with_the_reason() -> None:
    launched = registered()["launched"]
    with pytest.raises(yr.NotSupportedError, match="launched PersistentKernel runtime runs no 'allreduce'.*cpu"):
        launched.require(["embed", "allreduce"])


def test_backends_declare_the_kind_of_the_runtime_they_build() -> None:
    """Declared on the class (no device needed) and equal to the runtime class's own kind."""
    from yirage.persistent.launched import LaunchedRuntime
    from yirage.reference.backend import ReferenceBackend
    from yirage.reference.persistent import ReferenceRuntime

    pairs = [(ReferenceBackend, ReferenceRuntime, SERIAL)]
    try:
        from yirage_backend_triton import TritonBackend
        pairs.append((TritonBackend, LaunchedRuntime, LAUNCHED))
    except ImportError:
        pass
    try:
        from yirage_backend_opencl import OpenCLBackend
        from yirage_backend_opencl.pk_runtime import OpenCLPersistentRuntime
        pairs.append((OpenCLBackend, OpenCLPersistentRuntime, LAUNCHED))
    except ImportError:
        pass
    try:
        from yirage_backend_cpu import CPUBackend
        from yirage_backend_cpu.pk_runtime import CPUPersistentRuntime
        pairs.append((CPUBackend, CPUPersistentRuntime, PERSISTENT))
    except ImportError:
        pass
    for backend, runtime_cls, kind in pairs:
        assert backend.persistent_kind is kind and runtime_cls.kind is kind, backend.name
        assert all(callable(getattr(runtime_cls, m)) for m in ("run", "value", "stop")), runtime_cls
    assert PERSISTENT.honours == {"num_workers", "num_local_schedulers"}
    assert not LAUNCHED.honours and not SERIAL.honours


def test_the_control_slots_are_the_ones_the_kernels_always_used() -> None:
    """The C sources hard-coded ALIVE 0, STEPS 1, ERROR 2, ERR_ROW 3, ERR_VALUE 4, ACTIVE 8 before this module."""
    C = control.Ctl
    assert (C.ALIVE, C.STEPS, C.ERROR, C.ERR_ROW, C.ERR_VALUE, C.ACTIVE) == (0, 1, 2, 3, 4, 8)
    assert control.size(3) == 11 and control.CtlError.TOKEN == 1
    pytest.importorskip("triton")
    tasks = importlib.import_module("yirage.persistent.triton_tasks")
    for name in ("ALIVE", "STEPS", "ERROR", "ERR_ROW", "ERR_VALUE", "ACTIVE"):
        constexpr = getattr(tasks, name)
        assert type(constexpr.value) is int and constexpr.value == C[name], name


# -- num_workers / num_local_schedulers: honoured or said to be ignored ----------------------------------------


def spec_kernel(backend: str) -> yr.PersistentKernel:
    return yr.PersistentKernel(world_size=1, mpi_rank=0, num_workers=3, num_local_schedulers=2,
                               num_remote_schedulers=0, max_seq_length=16, eos_token_id=2,
                               meta_tensors=[torch.tensor([0]), torch.zeros(1, 16, dtype=torch.int64)],
                               profiler_tensor=None, spec_decode_config=None, backend=backend)


def test_the_config_says_which_fields_the_runtime_ignores() -> None:
    serial = spec_kernel("reference").config.settings
    for key in ("num_workers", "num_local_schedulers"):
        assert serial[key].source == "explicit" and not serial[key].tunable
        assert serial[key].detail.startswith("ignored by the serial runtime")
    assert (serial["num_workers"].value, serial["num_local_schedulers"].value) == (3, 2)  # still stored, and shown
    if yr.is_backend_available("cpu"):
        persistent = spec_kernel("cpu").config.settings
        assert persistent["num_workers"].detail == "passed by the caller" and persistent["num_workers"].tunable


PLUGIN = '''
import yirage
from yirage.backend.runtime_contract import LAUNCHED

YIRAGE_PLUGIN_API = 1

class Launching(yirage.Backend):
    name, priority, device_kind, vendor = "launching", 1000, "gpu", "Fake Inc"
    persistent_kind = LAUNCHED
    def probe(self):
        return yirage.Availability(True, "launching probe says ok")
    def device_info(self, index=0):
        return yirage.DeviceInfo("launching-device", "Fake Inc", "gpu", 7, 1 << 30)
    def memory_info(self, index=0):
        return yirage.MemoryInfo(1 << 30, 0, 1 << 30, "fake")
    def persistent_runtime(self, program, config):
        raise NotImplementedError
    def default_config(self, device):
        return {"num_workers": 4, "num_local_schedulers": 1}

@yirage.hookimpl
def yirage_backends():
    return [Launching]
'''


def test_info_shows_the_runtime_kind_and_the_ignored_fields(tmp_path, monkeypatch, isolated_selection,
                                                           capsys) -> None:
    (tmp_path / "launching_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "launching_plugin", raising=False)
    isolated_selection(Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1", "YIRAGE_PLUGINS": "launching_plugin"}))
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    rows = {b["name"]: b["capabilities"] for b in info["backends"]}
    assert rows["launching"]["persistent_kind"] == "launched" and rows["reference"]["persistent_kind"] == "serial"
    assert rows["torch"]["persistent_kind"] == ""  # no runtime, no kind
    active = info["pk_config"]
    assert active["backend"] == "launching"
    for key in ("num_workers", "num_local_schedulers"):
        assert active["settings"][key]["detail"].startswith("ignored by the launched runtime")
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend "))
    cells = {line.split()[0]: line.split()[4] for line in lines[start + 2:lines.index("", start)]}
    assert cells["launching"] == "launched" and cells["reference"] == "serial+q4_0,q8_0" and cells["torch"] == "no"
    workers = next(line for line in lines if line.strip().startswith("num_workers"))
    assert "4" in workers.split() and "ignored by the launched runtime" in workers


# -- the serial oracle keeps the stop() contract -----------------------------------------------------------------


def tiny_kernel(tokens: torch.Tensor, step: torch.Tensor) -> yr.PersistentKernel:
    pk = yr.PersistentKernel(world_size=1, mpi_rank=0, num_workers=1, num_local_schedulers=1,
                             num_remote_schedulers=0, max_seq_length=tokens.shape[1], eos_token_id=[],
                             meta_tensors=[step, tokens], profiler_tensor=None, spec_decode_config=None,
                             backend="reference")
    g = torch.Generator().manual_seed(0)
    x, logits = pk.new_tensor((1, 8), name="x"), pk.new_tensor((1, 16), name="logits")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(torch.randn(16, 8, generator=g), "embed"), x)
    pk.rmsnorm_linear_layer(x, pk.attach_input(torch.ones(8), "norm"),
                            pk.attach_input(torch.randn(16, 8, generator=g), "head"), logits)
    pk.argmax_layer(logits, pk.new_tensor((1, 1), dtype=torch.int64, name="next"))
    return pk.compile()


def test_stop_abandons_the_step_in_flight_on_the_serial_runtime(monkeypatch) -> None:
    tokens, step = torch.zeros(1, 8, dtype=torch.int64), torch.tensor([0])
    tokens[0, 0] = 3
    pk = tiny_kernel(tokens, step)
    assert pk(2) == 2 and int(step[0]) == 2  # runs when not stopped
    table = runtime.TASK_BODIES["reference"]
    argmax = table.bodies["argmax"]

    def stop_then_pick(rt, *args):  # the exit hook's stop() lands while the step's last task runs
        argmax(rt, *args)
        rt.stop()

    monkeypatch.setitem(table.bodies, "argmax", stop_then_pick)
    before = tokens.clone()
    assert pk(3) == 0
    assert int(step[0]) == 2 and torch.equal(tokens, before)  # nothing of the stopped step was committed


def test_a_runtime_breaking_the_protocol_is_refused_naming_the_backend() -> None:
    class NoStop:
        kind = LAUNCHED

        def run(self, max_new_tokens=None):
            return 0

        def value(self, name):
            return None

    backend = selection.registry().get("reference")
    with pytest.raises(yr.PluginError, match="'reference'.*NoStop, which lacks pick, stop"):
        runtime.check_runtime(backend, NoStop())
    NoStop.stop = NoStop.pick = lambda self, *args: None
    with pytest.raises(yr.PluginError, match="declares persistent_kind serial but its runtime NoStop is launched"):
        runtime.check_runtime(backend, NoStop())


def test_the_triton_task_file_takes_its_slots_from_control() -> None:
    """No hand-copied slot numbers left: each slot global is ``tl.constexpr(int(Ctl.<its name>))``."""
    source = (Path(specs.__file__).parent / "triton_tasks.py").read_text(encoding="utf-8")
    slots = {line.split(":")[0]: line for line in source.splitlines() if line.split(":")[0] in control.Ctl.__members__}
    assert set(slots) >= {"ALIVE", "STEPS", "ERROR", "ERR_ROW", "ERR_VALUE", "ACTIVE"}
    for name, line in slots.items():
        assert line == f"{name}: tl.constexpr = tl.constexpr(int(Ctl.{name}))", line
