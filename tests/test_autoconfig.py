"""Auto-configuration (issue 12 item 1, item 4's ``optimize``): derived, measured, saved, applied, explicit.

Oracles: psutil's core count and the backend's documented rule for the derived values, MPK's published split
for GPUs, the JSON a run wrote for the saved values, and the runtime's own worker/scheduler counts for what a
PersistentKernel runs with; transformers' greedy decode checks that a saved configuration still decodes right.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

import yirage as yr
from yirage import autoconfig, cli
from yirage import autoconfig_sweep as sweep_mod
from yirage.autoconfig import ConfigMismatchError, SavedConfigError
from yirage.backend.selection import registry

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # a cold numba compile of the decode loop can take a minute or two on a busy machine
needs_cpu = pytest.mark.skipif(not yr.is_backend_available("cpu"), reason="the cpu backend (numba) is unavailable")


@pytest.fixture
def quick(monkeypatch):
    """The defaults the spec snippets use, shrunk so a sweep takes a fraction of a second."""
    monkeypatch.setattr(sweep_mod, "DEFAULT_DURATION", 0.3)
    monkeypatch.setattr(sweep_mod, "DEFAULT_MODEL", sweep_mod.TINY)


def run_python(code: str, config_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YIRAGE_")}
    env["YIRAGE_CONFIG_DIR"] = str(config_dir)
    cmd = [sys.executable, *args] if args else [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env, check=False)


def cpu_rule() -> tuple[int, int]:
    """The cpu backend's documented rule (one thread per physical core, dedicated schedulers from 8 cores)."""
    cores = psutil.cpu_count(logical=False) or 1
    return cores - cores // 8, cores // 8


# -- the spec's snippets --------------------------------------------------------------------------------------
@needs_cpu
def test_the_spec_snippets_run_and_an_unavailable_backend_fails_naming_why(quick, tmp_path, monkeypatch,
                                                                          capsys) -> None:
    from conftest import unavailable_backend

    missing = unavailable_backend(registry())  # cuda where there is no GPU, else another one (mps on Linux...)
    monkeypatch.chdir(tmp_path)
    config = yr.auto_configure_backend()
    print("Optimal config:", config)
    optimizer = yr.BackendOptimizer()
    optimizer.print_system_info()
    optimizer = yr.BackendOptimizer()
    with pytest.raises(yr.BackendUnavailableError, match=f"'{missing}'.*unavailable"):
        optimizer.save_config('optimal_config.json', backend=missing)
    optimizer.save_config('optimal_config.json', backend='cpu')
    config = optimizer.load_config('optimal_config.json')
    out = capsys.readouterr().out
    assert "Optimal config: cpu on" in out and "(measured)" in out
    assert "cuda" in out and "cpu" in out  # print_system_info lists every backend
    saved = json.loads((tmp_path / "optimal_config.json").read_text())
    assert config.values() == {name: s["value"] for name, s in saved["settings"].items()}
    assert set(config.sources().values()) == {"saved"}
    assert saved["schema"] == 1 and saved["backend"] == "cpu" and saved["fingerprint"]


# -- derivation -----------------------------------------------------------------------------------------------
@needs_cpu
def test_the_derived_cpu_config_is_what_the_cores_imply() -> None:
    cfg = yr.auto_configure_backend("cpu", sweep=False)
    workers, schedulers = cpu_rule()
    assert (cfg.num_workers, cfg.num_local_schedulers) == (workers, schedulers)
    assert cfg.settings["threads"].value == workers + schedulers
    assert set(cfg.sources().values()) == {"derived"}
    assert 0 < cfg.settings["memory_budget"].value <= psutil.virtual_memory().total
    assert cfg.sweep == []


class _FakeGPU(yr.Backend):
    name, device_kind = "fakegpu", "gpu"
    units = 132

    def probe(self) -> yr.Availability:
        return yr.Availability(True, "fake")

    def device_info(self, index: int = 0) -> yr.DeviceInfo:
        return yr.DeviceInfo("Fake GPU", "Fake Inc", self.device_kind, self.units, 1 << 34,
                             extra={"max_work_group_size": 1024})

    def memory_info(self, index: int = 0) -> yr.MemoryInfo:
        return yr.MemoryInfo(1 << 34, 1 << 30, (1 << 34) - (1 << 30), "fake")


# MPK (mirage-project/mirage python/mirage/utils.py get_configurations_from_gpu): workers by SM count,
# schedulers = 4 * (SMs - workers)
@pytest.mark.parametrize(("sms", "workers", "schedulers"), [(132, 128, 16), (108, 96, 48), (82, 64, 72),
                                                             (170, 144, 104), (10, 9, 4)])
def test_a_gpu_without_default_config_gets_mpks_split(sms, workers, schedulers) -> None:
    backend = _FakeGPU()
    backend.units = sms
    cfg = autoconfig.derive(backend)
    assert (cfg.num_workers, cfg.num_local_schedulers) == (workers, schedulers)
    assert cfg.settings["work_group_size"].value == 256 and not cfg.settings["work_group_size"].tunable
    assert cfg.settings["memory_budget"].value == (1 << 34) - (1 << 30)


def test_a_backend_without_default_config_says_it_cannot_be_configured() -> None:
    backend = _FakeGPU()
    backend.device_kind = "accelerator"
    with pytest.raises(yr.NotSupportedError, match="no default_config.*pass num_workers/num_local_schedulers"):
        autoconfig.derive(backend)


class _Undescribed(yr.Backend):
    name = "undescribed"

    def probe(self) -> yr.Availability:
        return yr.Availability(True, "fake")


def test_a_backend_that_describes_nothing_still_gets_one_worker_and_one_scheduler() -> None:
    """As before auto-configuration: no device_info and no default_config mean (1, 1), marked "default"."""
    cfg = autoconfig.resolve_pk_config(_Undescribed())
    assert cfg.values() == {"num_workers": 1, "num_local_schedulers": 1}
    assert set(cfg.sources().values()) == {"default"}
    assert autoconfig.resolve_pk_config(_Undescribed(), 3, 0).values() == {"num_workers": 3,
                                                                          "num_local_schedulers": 0}


# -- the sweep ------------------------------------------------------------------------------------------------
@needs_cpu
def test_the_sweep_times_candidates_around_the_derived_pair() -> None:
    cfg = yr.auto_configure_backend("cpu", duration=0.3, max_candidates=3, model=sweep_mod.TINY)
    derived = cpu_rule()
    pairs = [(r["num_workers"], r["num_local_schedulers"]) for r in cfg.sweep]
    assert derived in pairs and 2 <= len(pairs) <= 3 and len(set(pairs)) == len(pairs)
    for r in cfg.sweep:
        assert r["error"] is None and r["samples"] >= sweep_mod.MIN_ROUNDS
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    chosen = next(r for r in cfg.sweep if (r["num_workers"], r["num_local_schedulers"]) == (cfg.num_workers,
                                                                                             cfg.num_local_schedulers))
    fastest = min(r["median_ms"] for r in cfg.sweep)
    assert chosen["median_ms"] <= fastest / (1 - sweep_mod.KEEP_MARGIN)
    assert cfg.settings["num_workers"].source == "measured"
    assert "median ms/step" in cfg.report() and "chosen" in cfg.report()


def test_bad_durations_are_refused_with_the_fix() -> None:
    for bad in (-1, 0, float("nan"), "5", True):
        with pytest.raises(ValueError, match="duration"):
            yr.auto_configure_backend("cpu", duration=bad)


# -- saved files ----------------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict]:
    path = yr.BackendOptimizer(sweep=False).save_config(tmp_path / "c.json", backend="cpu")
    return path, json.loads(path.read_text())


@needs_cpu
def test_save_and_load_round_trip(saved) -> None:
    path, data = saved
    cfg = yr.BackendOptimizer().load_config(path, backend="cpu")
    assert cfg.values() == {name: s["value"] for name, s in data["settings"].items()}
    assert (cfg.num_workers, cfg.num_local_schedulers) == cpu_rule()


def _edit(data: dict, what: str) -> object:
    data = json.loads(json.dumps(data))
    if what == "list":
        return [data]
    if what == "schema":
        data["schema"] = 99
    elif what in ("zero", "negative", "string"):
        data["settings"]["num_workers"]["value"] = {"zero": 0, "negative": -2, "string": "2"}[what]
    elif what == "schedulers":
        data["settings"]["num_local_schedulers"]["value"] = -1
    elif what == "missing":
        del data["settings"]["num_local_schedulers"]
    elif what == "threads":
        data["settings"]["threads"]["value"] = 1.5
    return data


@needs_cpu
@pytest.mark.parametrize(("what", "cause"), [
    ("list", "must hold a JSON object"), ("schema", "schema 99"), ("zero", "num_workers must be an int >= 1 .*got 0;"),
    ("negative", "num_workers must be an int >= 1 .*got -2;"), ("string", "num_workers must be an int >= 1 .*got '2';"),
    ("schedulers", "num_local_schedulers must be an int >= 0 .*got -1;"),
    ("missing", "num_local_schedulers are missing"), ("threads", "threads must be an int"),
])
def test_malformed_files_are_refused_naming_the_cause(saved, what, cause) -> None:
    path, data = saved
    path.write_text(json.dumps(_edit(data, what)))
    with pytest.raises(SavedConfigError, match=cause) as info:
        yr.BackendOptimizer().load_config(path)
    message = str(info.value)
    assert str(path) in message and ("optimize --backend" in message or "save_config" in message), message
    assert isinstance(info.value, yr.YirageError)


@needs_cpu
def test_broken_json_and_mismatched_files_are_refused(saved) -> None:
    path, data = saved
    path.write_text("{not json")
    with pytest.raises(SavedConfigError, match="not valid JSON"):
        yr.BackendOptimizer().load_config(path)
    path.write_text(json.dumps({**data, "fingerprint": "cpu|Other|Another CPU|cpu|64"}))
    with pytest.raises(ConfigMismatchError, match="mismatched device"):
        yr.BackendOptimizer().load_config(path)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigMismatchError, match="for backend 'cpu', not 'reference'"):
        yr.BackendOptimizer().load_config(path, backend="reference")
    from conftest import unavailable_backend

    missing = unavailable_backend(registry())
    path.write_text(json.dumps({**data, "backend": missing}))
    with pytest.raises(ConfigMismatchError, match=f"'{missing}', which is unavailable here"):
        yr.BackendOptimizer().load_config(path)


# -- applied configurations -------------------------------------------------------------------------------------
def _apply(num_workers: int, schedulers: int, fingerprint: str | None = None) -> autoconfig.BackendConfig:
    cfg = yr.auto_configure_backend("cpu", sweep=False)
    cfg.settings["num_workers"] = autoconfig.Setting(num_workers, "measured", "test")
    cfg.settings["num_local_schedulers"] = autoconfig.Setting(schedulers, "measured", "test")
    if fingerprint:
        cfg.fingerprint = fingerprint
    autoconfig.apply(cfg)
    return cfg


def _tiny_pk(**counts):
    import torch

    model = sweep_mod.TINY.build()
    model.reset_cache(1, 12)
    tokens = torch.zeros(1, 12, dtype=torch.int64)
    return model.build_decoder(torch.tensor([0]), tokens, backend="cpu", tasks=4, **counts)


@needs_cpu
def test_an_applied_config_for_another_device_is_ignored_with_a_warning(caplog) -> None:
    _apply(1, 1, fingerprint="cpu|Other|Another CPU|cpu|64")
    with caplog.at_level(logging.WARNING, logger="yirage.autoconfig"):
        pk = _tiny_pk()
    assert "ignoring the applied configuration" in caplog.text and "Another CPU" in caplog.text
    assert (pk.runtime.workers, pk.runtime.schedulers) == cpu_rule()
    sources = pk.config.sources()
    assert (sources["num_workers"], sources["num_local_schedulers"]) == ("derived", "derived")


@needs_cpu
def test_kernel_graphs_run_on_the_applied_thread_count(monkeypatch) -> None:
    """The applied ``threads`` reaches the cpu backend's kernel graphs: numba's count is set around each call
    (and restored); without an applied configuration a call starts on all of numba's threads. Results stay
    torch's."""
    import numba
    import torch

    def graph_and_inputs():
        g = yr.new_kernel_graph(backend="cpu")
        a, b = g.new_input((64, 512)), g.new_input((64, 512))
        g.mark_output(g.add(g.mul(a, b), a))
        gen = torch.Generator().manual_seed(5)
        return g, [torch.randn(64, 512, generator=gen), torch.randn(64, 512, generator=gen)]

    calls: list[int] = []
    real = numba.set_num_threads
    monkeypatch.setattr(numba, "set_num_threads", lambda n: (calls.append(n), real(n))[1])
    g, (a, b) = graph_and_inputs()
    before = numba.get_num_threads()
    torch.testing.assert_close(g([a, b])[0], a * b + a)
    assert calls == [numba.config.NUMBA_NUM_THREADS, before]  # nothing applied: all of numba's threads
    calls.clear()
    cfg = _apply(1, 0)
    cfg.settings["threads"] = autoconfig.Setting(1, "measured", "test")
    autoconfig.apply(cfg)
    before = numba.get_num_threads()
    g, (a, b) = graph_and_inputs()
    torch.testing.assert_close(g([a, b])[0], a * b + a)
    assert calls == [1, before] and numba.get_num_threads() == before


@needs_cpu
def test_a_corrupted_applied_file_stops_the_kernel_naming_path_and_fix(private_settings) -> None:
    path = private_settings / "autoconfig.json"
    path.write_text("{oops")
    with pytest.raises(SavedConfigError, match="autoconfig.json.*optimize --backend B --apply"):
        _tiny_pk()
    pk = _tiny_pk(num_workers=1, num_local_schedulers=0)  # both explicit: the file has no say, so is not read
    assert (pk.runtime.workers, pk.runtime.schedulers) == (1, 0)


@needs_cpu
def test_optimize_apply_then_new_processes_use_the_saved_config(tmp_path, tmp_path_factory) -> None:
    """optimize --apply saves a configuration that new processes' kernels and engines then run with, and the engine
    so configured decodes llm_oracle's diverse llama-gqa like transformers (logits and tokens, 8 steps)."""
    pytest.importorskip("transformers")
    from llm_oracle import Reference, assert_decode_matches, zoo_factory

    conf = tmp_path / "conf"
    out = run_python("", conf, "tools/yirage_backend_manager.py", "optimize", "--backend", "cpu", "--apply", "--json",
                     "--duration", "0.3", "--candidates", "3", "--model", "tiny")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["applied"] == str(conf / "autoconfig.json") and len(result["sweep"]) == 3
    # pin a pair the derivation would not give, so "the saved values are used" is visible in what runs
    stored = json.loads((conf / "autoconfig.json").read_text())
    stored["configs"]["cpu"]["settings"]["num_workers"]["value"] = 1
    stored["configs"]["cpu"]["settings"]["num_local_schedulers"]["value"] = 1
    (conf / "autoconfig.json").write_text(json.dumps(stored))

    zoo, steps = zoo_factory(tmp_path_factory)("llama-gqa"), 8
    ref = zoo.reference
    want = Reference(ref.ids, ref.tokens[:, :steps], ref.logits[:, :steps])
    decoded = tmp_path / "decoded.pt"
    child = run_python(f"""
        import json, torch, yirage as yr
        from yirage.autoconfig_sweep import TINY
        model = TINY.build(); model.reset_cache(1, 12)
        pk = model.build_decoder(torch.tensor([0]), torch.zeros(1, 12, dtype=torch.int64), backend="cpu", tasks=4)
        pk_explicit = model.build_decoder(torch.tensor([0]), torch.zeros(1, 12, dtype=torch.int64), backend="cpu",
                                          tasks=4, num_workers=2, num_local_schedulers=0)
        engine = yr.InferEngine({str(zoo.path)!r}, backend="cpu")
        res = engine.generate(torch.tensor({ref.ids.tolist()!r}),
                              yr.GenerationConfig(max_new_tokens={steps}, eos_token_id=(), output_logits=True))
        torch.save((res.tokens, res.logits), {str(decoded)!r})
        (decoder,) = engine._decoders.values()
        print(json.dumps({{"pk": [pk.runtime.workers, pk.runtime.schedulers, pk.config.sources()],
                          "explicit": [pk_explicit.runtime.workers, pk_explicit.runtime.schedulers,
                                       pk_explicit.config.sources()],
                          "engine": [decoder.runtime.workers, decoder.runtime.schedulers, decoder.config.sources()]}}))
    """, conf)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    saved = {"num_workers": "saved", "num_local_schedulers": "saved", "tasks_per_layer": "derived"}
    assert got["pk"] == [1, 1, saved] and got["engine"] == [1, 1, saved]
    assert got["explicit"] == [2, 0, {"num_workers": "explicit", "num_local_schedulers": "explicit",
                                      "tasks_per_layer": "derived"}]
    tokens, logits = torch.load(decoded)  # the saved configuration decodes what transformers decodes
    assert_decode_matches(want, tokens, logits, label=f"{zoo.label}, saved config (1 worker, 1 scheduler)")


# -- the command line ------------------------------------------------------------------------------------------
@needs_cpu
def test_info_shows_the_active_config_and_where_each_value_came_from(capsys) -> None:
    assert cli.main(["info", "--json"]) == 0
    active = json.loads(capsys.readouterr().out)["pk_config"]
    assert active["backend"] == "cpu"
    assert {n: s["source"] for n, s in active["settings"].items()} == {
        "num_workers": "derived", "num_local_schedulers": "derived", "tasks_per_layer": "derived"}
    _apply(1, 0)
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "PersistentKernel configuration (backend cpu" in text
    assert re.search(r"num_workers\s+1\s+saved", text), text


@pytest.mark.parametrize("which", ["unknown", "unavailable"])
def test_optimize_refuses_unknown_and_unavailable_backends(capsys, which) -> None:
    from conftest import unavailable_backend

    name = "nosuch" if which == "unknown" else unavailable_backend(registry())
    cause = f"'{name}'" + (".*unavailable" if which == "unavailable" else "")
    assert cli.main(["optimize", "--backend", name, "--no-sweep"]) == 2
    err = capsys.readouterr().err
    assert "yirage: error:" in err
    assert re.search(cause, err), err


@pytest.mark.parametrize("duration", ["-1", "0", "nan", "soon"])
def test_optimize_refuses_bad_durations(capsys, duration) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["optimize", "--backend", "cpu", "--duration", duration])
    assert info.value.code == 2
    assert "--duration" in capsys.readouterr().err


@needs_cpu
def test_optimize_prints_the_choice_and_the_table(capsys) -> None:
    assert cli.main(["optimize", "--backend", "auto", "--duration", "0.3", "--candidates", "2", "--model",
                     "tiny"]) == 0
    out = capsys.readouterr().out
    assert "num_workers" in out and "measured" in out
    assert "candidate" in out and "median ms/step" in out and "chosen" in out
    assert not (Path(os.environ["YIRAGE_CONFIG_DIR"]) / "autoconfig.json").exists()  # no --apply: nothing saved
