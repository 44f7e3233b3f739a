"""The selection API: auto policy, explicit choice, errors, BackendType, info."""

from __future__ import annotations

import logging

import psutil
import pytest

import yirage as yr
from tests.conftest import auto_candidates, auto_pick, expected_auto, fake_backends_source, unavailable_backend
from yirage.backend.registry import Registry


@pytest.fixture
def fake_world(tmp_path, monkeypatch, isolated_selection):
    """A registry of fake backends only (plus the core's torch and reference)."""

    def make(*specs: str) -> Registry:
        (tmp_path / "world_plugin.py").write_text(fake_backends_source(*specs))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(__import__("sys").modules, "world_plugin", raising=False)
        reg = Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1", "YIRAGE_PLUGINS": "world_plugin"})
        isolated_selection(reg)
        return reg

    return make


def test_auto_takes_the_highest_priority_available_backend(fake_world, caplog) -> None:
    fake_world(
        '_make("big", 100, ok=False, reason="no driver for big")',
        '_make("mid", 60)',
        '_make("low", 30)',
    )
    with caplog.at_level(logging.INFO, logger="yirage"):
        assert yr.set_backend("auto") == "mid"
    assert yr.get_backend().value == "mid"
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("'mid'" in m and "no driver for big" in m for m in info)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    report = {d.name: d for d in yr.last_auto_report()}
    assert report["mid"].chosen and not report["low"].chosen
    assert report["big"].reason == "no driver for big"
    assert set(report) == {"big", "mid", "low", "torch", "reference"}


def test_auto_passes_over_backends_that_decline_auto(fake_world) -> None:
    fake_world('_make("hostcl", 60, auto=False, kind="cpu")', '_make("hostcpu", 20, kind="cpu")')
    assert yr.set_backend("auto") == "hostcpu"
    assert yr.is_backend_available("hostcl")  # still selectable by name
    assert yr.set_backend("hostcl") == "hostcl"


def test_auto_warns_when_it_ends_on_the_host_cpu(fake_world, caplog) -> None:
    fake_world('_make("gpu", 100, ok=False)', '_make("hostcpu", 20, kind="cpu")')
    with caplog.at_level(logging.INFO, logger="yirage"):
        yr.set_backend("auto")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("host CPU" in m and "hostcpu" in m for m in warnings)


def test_ties_in_priority_are_broken_by_name(fake_world) -> None:
    fake_world('_make("zeta", 50)', '_make("alpha", 50)')
    assert yr.set_backend("auto") == "alpha"


def test_selecting_an_unavailable_backend_names_it_the_reason_and_the_alternatives(fake_world) -> None:
    fake_world('_make("big", 100, ok=False, reason="the big driver is not loaded")', '_make("low", 30)')
    with pytest.raises(yr.BackendUnavailableError) as err:
        yr.set_backend("big")
    message = str(err.value)
    assert "'big'" in message and "the big driver is not loaded" in message
    assert "low" in message and "reference" in message


def test_selecting_an_unknown_backend_lists_the_known_ones(fake_world) -> None:
    fake_world('_make("low", 30)')
    with pytest.raises(yr.UnknownBackendError) as err:
        yr.set_backend("warp-drive")
    assert "'warp-drive'" in str(err.value) and "low" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_set_backend_rejects_non_strings(fake_world) -> None:
    fake_world('_make("low", 30)')
    with pytest.raises(TypeError, match="must be a str"):
        yr.set_backend(3)  # type: ignore[arg-type]


def test_names_are_case_and_space_insensitive(fake_world) -> None:
    fake_world('_make("low", 30)')
    assert yr.set_backend("  LOW ") == "low"


def test_is_backend_available_never_raises(fake_world) -> None:
    fake_world('_make("big", 100, ok=False)', '_make("low", 30)')
    assert yr.is_backend_available("low") is True
    assert yr.is_backend_available("big") is False
    assert yr.is_backend_available("no-such-backend") is False
    assert yr.is_backend_available(None) is False
    assert yr.is_backend_available(42) is False


def test_available_backends_are_enum_like_and_best_first(fake_world) -> None:
    fake_world('_make("big", 100, ok=False)', '_make("mid", 60)', '_make("low", 30)')
    found = yr.get_available_backends()
    assert [b.value for b in found] == ["mid", "low", "torch", "reference"]
    assert found[0] is yr.BackendType("mid") is yr.BackendType.MID
    assert found[0].name == "MID" and found[0] == "mid" and found[0] != "low"
    assert {found[0]: 1}["mid"] == 1
    with pytest.raises(AttributeError, match="unknown backend 'nope'"):
        _ = yr.BackendType.NOPE
    assert [b.value for b in yr.BackendType] == ["big", "mid", "low", "torch", "reference"]


def test_the_probe_is_memoized_until_reset(fake_world, tmp_path) -> None:
    counter = tmp_path / "calls"
    counter.write_text("")
    reg = fake_world('_make("low", 30)')
    backend = reg.get("low")
    original = type(backend).probe

    def counting_probe(self):
        counter.write_text(counter.read_text() + "x")
        return original(self)

    type(backend).probe = counting_probe
    for _ in range(3):
        assert yr.is_backend_available("low")
    assert counter.read_text() == "x"
    yr.reset_backend()
    assert yr.is_backend_available("low")
    assert counter.read_text() == "xx"


def test_a_probe_that_raises_makes_the_backend_unavailable_with_the_cause(fake_world) -> None:
    reg = fake_world('_make("flaky", 70)', '_make("low", 30)')

    def broken(self):
        raise OSError("libdriver.so: undefined symbol")

    type(reg.get("flaky")).probe = broken
    assert yr.set_backend("auto") == "low"
    assert "OSError" in yr.get_backend_info("flaky")["reason"]
    assert "undefined symbol" in yr.get_backend_info("flaky")["reason"]


def test_reset_backend_re_reads_the_environment(fake_world, monkeypatch) -> None:
    fake_world('_make("mid", 60)', '_make("low", 30)')
    assert yr.get_backend() == "mid"
    monkeypatch.setenv("YIRAGE_BACKEND", "low")
    assert yr.get_backend() == "mid"  # read at import, not on every call
    yr.reset_backend()
    assert yr.get_backend() == "low"


def test_an_unknown_name_in_the_environment_says_where_it_came_from(fake_world, monkeypatch) -> None:
    fake_world('_make("low", 30)')
    monkeypatch.setenv("YIRAGE_BACKEND", "bogus")
    yr.reset_backend()
    with pytest.raises(yr.UnknownBackendError, match="from YIRAGE_BACKEND"):
        yr.get_backend()


def test_backend_info_of_an_unavailable_backend_gives_the_reason_only(fake_world) -> None:
    fake_world('_make("big", 100, ok=False, reason="no big device")')
    info = yr.get_backend_info("big")
    assert info["available"] is False and info["reason"] == "no big device"
    assert info["device"] is None and info["memory"] is None
    with pytest.raises(yr.UnknownBackendError, match="'nothing'"):
        yr.get_backend_info("nothing")


def test_real_backend_info_reports_measured_host_facts(isolated_selection) -> None:
    isolated_selection(Registry(environ={}))
    if not yr.is_backend_available("cpu"):
        pytest.skip(f"the cpu backend is unavailable here: {yr.get_backend_info('cpu')['reason']}")
    info = yr.get_backend_info("cpu")
    assert info["available"] and info["plugin"]["distribution"] == "yirage-backend-cpu"
    assert info["device"]["compute_units"] == psutil.cpu_count(logical=False)
    assert info["memory"]["total"] == psutil.virtual_memory().total
    assert 0 < info["memory"]["free"] <= info["memory"]["total"]
    assert yr.get_memory_info("cpu")["total"] == psutil.virtual_memory().total


def test_get_memory_info_of_an_unavailable_backend_raises(isolated_selection) -> None:
    reg = Registry(environ={})
    isolated_selection(reg)
    name = unavailable_backend(reg, prefer="mps")
    with pytest.raises(yr.BackendUnavailableError, match=f"backend {name!r} is unavailable"):
        yr.get_memory_info(name)


def test_auto_on_the_real_backends_picks_what_the_probes_say(isolated_selection) -> None:
    reg = Registry(environ={})
    isolated_selection(reg)
    assert yr.set_backend("auto") == expected_auto(reg)


@pytest.mark.parametrize(("specs", "want"), [
    (['_make("big", 100, ok=False)', '_make("mid", 60)', '_make("low", 30)'], "mid"),
    (['_make("hostcl", 60, auto=False, kind="cpu")', '_make("hostcpu", 20, kind="cpu")'], "hostcpu"),
    (['_make("zeta", 50)', '_make("alpha", 50)'], "alpha"),
])
def test_the_tests_auto_oracle_follows_the_documented_policy(fake_world, specs, want) -> None:
    """The machine-neutral tests compute auto's pick with tests.conftest.auto_pick: it must agree with set_backend."""
    reg = fake_world(*specs)
    assert auto_pick(auto_candidates(reg)) == want == yr.set_backend("auto")


def test_unknown_names_list_the_available_alternatives_first(fake_world) -> None:
    fake_world('_make("big", 100, ok=False)', '_make("low", 30)')
    with pytest.raises(yr.UnknownBackendError) as err:
        yr.set_backend("nope")
    assert "available here: low, torch, reference" in str(err.value)


def test_a_backend_excluded_by_the_allow_list_says_so(isolated_selection) -> None:
    isolated_selection(Registry(environ={"YIRAGE_PLUGINS": "opencl"}))
    with pytest.raises(yr.UnknownBackendError) as err:
        yr.set_backend("cpu")
    assert "yirage-backend-cpu" in str(err.value) and "not named in YIRAGE_PLUGINS" in str(err.value)


def test_backend_info_of_auto_describes_the_backend_auto_picks(fake_world) -> None:
    fake_world('_make("mid", 60)', '_make("low", 30)')
    assert yr.get_backend_info("auto")["name"] == "mid"


def test_backend_type_pickles_and_refuses_unknown_names(fake_world) -> None:
    import copy
    import pickle

    fake_world('_make("low", 30)')
    member = yr.BackendType("low")
    assert pickle.loads(pickle.dumps(member)) is member
    assert copy.deepcopy(member) is member
    with pytest.raises(yr.UnknownBackendError, match="'bogus'"):
        yr.BackendType("bogus")


def test_a_failing_device_query_is_reported_not_raised(fake_world) -> None:
    reg = fake_world('_make("flaky", 70)')

    def broken(self, index=0):
        raise RuntimeError("driver query failed")

    type(reg.get("flaky")).device_info = broken
    info = yr.get_backend_info("flaky")
    assert info["available"] and "driver query failed" in info["error"]


def test_auto_warning_names_plugins_the_switches_kept_out(isolated_selection, caplog) -> None:
    reg = Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1", "YIRAGE_PLUGINS": "cpu"})
    isolated_selection(reg)
    with caplog.at_level(logging.WARNING, logger="yirage"):
        assert yr.set_backend("auto") == expected_auto(reg)  # cpu, or reference where numba is missing
    message = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "not loaded" in message and "cuda" in message
