"""Plugin discovery: entry points, switches, crashing and refused plugins."""

from __future__ import annotations

import pytest

from tests.conftest import fake_backends_source
from yirage.backend.registry import Registry

#: the core's own backends: registered by the core itself, even with autoload off or an allow-list
CORE = ["torch", "reference"]  # by priority
BUILTIN = {
    "reference": "yirage",
    "torch": "yirage",
    "cpu": "yirage-backend-cpu",
    "opencl": "yirage-backend-opencl",
    "cuda": "yirage-backend-cuda",
    "mps": "yirage-backend-mps",
    **{name: "yirage-backend-domestic" for name in ("ascend", "cambricon", "moore", "metax", "iluvatar", "hygon")},
}


def test_every_builtin_backend_is_discovered_from_its_own_distribution() -> None:
    reg = Registry(environ={})
    assert set(BUILTIN) <= set(reg.names())
    for name, dist in BUILTIN.items():
        assert reg.origin(name).distribution == dist
        assert reg.origin(name).status == "loaded"


def test_names_are_ordered_by_priority() -> None:
    reg = Registry(environ={})
    priorities = [reg.get(n).priority for n in reg.names()]
    assert priorities == sorted(priorities, reverse=True)
    assert reg.names()[-1] == "reference"


def test_disable_autoload_leaves_only_the_core_backends() -> None:
    reg = Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert reg.names() == CORE


@pytest.mark.parametrize("value", ["1", "0", "yes", "false"])
def test_any_non_empty_autoload_switch_disables_autoload_as_in_pytest(value: str) -> None:
    reg = Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": value})
    assert reg.names() == CORE
    excluded = {r.name for r in reg.plugins.records if r.status == "excluded"}
    assert {"cpu", "opencl", "cuda"} <= excluded


def test_an_empty_autoload_switch_keeps_autoload() -> None:
    assert "cpu" in Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": ""}).names()


@pytest.mark.parametrize("spelling", ["yirage_backend_domestic", "Yirage-Backend-Domestic", "yirage.backend.domestic"])
def test_allow_list_matches_distribution_names_as_pip_does(spelling: str) -> None:
    reg = Registry(environ={"YIRAGE_PLUGINS": spelling})
    assert set(reg.names()) == {*CORE, "ascend", "cambricon", "moore", "metax", "iluvatar", "hygon"}
    assert not [r for r in reg.plugins.records if r.status in {"failed", "refused"}]


def test_allow_list_is_case_blind_and_tolerates_duplicates() -> None:
    reg = Registry(environ={"YIRAGE_PLUGINS": "CPU,yirage_backend_cpu, cpu"})
    assert set(reg.names()) == {*CORE, "cpu"}
    assert not [r for r in reg.plugins.records if r.status in {"failed", "refused"}]


def test_an_allow_list_name_that_matches_nothing_lists_the_installed_plugins() -> None:
    reg = Registry(environ={"YIRAGE_PLUGINS": "no_such_plugin_anywhere"})
    record = next(r for r in reg.plugins.records if r.name == "no_such_plugin_anywhere")
    assert record.status == "failed"
    assert "matches no installed plugin" in record.error and "yirage-backend-cpu" in record.error


@pytest.mark.parametrize("name", CORE)
def test_allow_list_naming_a_core_backend_imports_no_module_of_that_name(name: str) -> None:
    """``YIRAGE_PLUGINS=torch`` names the core backend, not the ``torch`` package to load as a plugin."""
    reg = Registry(environ={"YIRAGE_PLUGINS": name})
    assert reg.names() == CORE
    assert not [r for r in reg.plugins.records if r.status in {"failed", "refused"}]


def test_allow_list_by_entry_point_name() -> None:
    reg = Registry(environ={"YIRAGE_PLUGINS": "cpu, opencl"})
    assert set(reg.names()) == {*CORE, "cpu", "opencl"}


def test_allow_list_by_distribution_name_loads_all_its_entry_points() -> None:
    reg = Registry(environ={"YIRAGE_PLUGINS": "yirage-backend-domestic"})
    assert set(reg.names()) == {*CORE, "ascend", "cambricon", "moore", "metax", "iluvatar", "hygon"}


def test_empty_allow_list_loads_no_plugin() -> None:
    assert Registry(environ={"YIRAGE_PLUGINS": ""}).names() == CORE


def test_allow_list_overrides_disabled_autoload() -> None:
    reg = Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1", "YIRAGE_PLUGINS": "cpu"})
    assert set(reg.names()) == {*CORE, "cpu"}


def test_allow_list_imports_a_module_path_without_an_entry_point(tmp_path, monkeypatch) -> None:
    (tmp_path / "loose_plugin.py").write_text(fake_backends_source('_make("loose", 5)'))
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1", "YIRAGE_PLUGINS": "loose_plugin"})
    assert set(reg.names()) == {*CORE, "loose"}
    assert reg.origin("loose").distribution == "(YIRAGE_PLUGINS)"


def test_a_plugin_that_exits_on_import_does_not_end_the_host(plugin_dir) -> None:
    module = plugin_dir("import sys\nsys.exit('no licence server')")
    reg = Registry(environ={})
    record = next(r for r in reg.plugins.records if r.name == module)
    assert record.status == "failed" and "SystemExit" in record.error and "no licence server" in record.error
    assert "cpu" in reg.names()


def test_a_hookimpl_with_specname_is_called_through_pluggy(plugin_dir) -> None:
    source = fake_backends_source('_make("renamed", 5)').replace(
        "@yirage.hookimpl\ndef yirage_backends():", '@yirage.hookimpl(specname="yirage_backends")\ndef provide():'
    )
    assert "def provide" in source
    plugin_dir(source)
    assert "renamed" in Registry(environ={}).names()


def test_a_backend_whose_constructor_raises_is_reported_and_skipped(plugin_dir) -> None:
    source = fake_backends_source('_make("fragile", 5)').replace(
        "    return Fake\n", "    def boom(self):\n        raise RuntimeError('init exploded')\n"
        "    Fake.__init__ = boom\n    return Fake\n"
    )
    plugin_dir(source)
    reg = Registry(environ={})
    assert "fragile" not in reg.names() and "cpu" in reg.names()
    assert any("init exploded" in c and "'fragile'" in c for c in reg.conflicts)


def test_a_probe_that_returns_junk_makes_its_backend_unavailable(plugin_dir) -> None:
    source = fake_backends_source('_make("sloppy", 5)').replace(
        "    return Fake\n", "    Fake.probe = lambda self: True\n    return Fake\n"
    )
    plugin_dir(source)
    avail = Registry(environ={}).get("sloppy").availability()
    assert not avail.ok and "instead of an Availability" in avail.reason


def test_a_crashing_plugin_is_reported_and_the_rest_still_load(plugin_dir) -> None:
    crash = "raise ImportError('libfoo.so: cannot open shared object file')"
    module = plugin_dir(crash, dist="crashy-backend", version="0.3")
    reg = Registry(environ={})
    record = next(r for r in reg.plugins.records if r.name == module)
    assert record.status == "failed"
    assert record.distribution == "crashy-backend" and record.version == "0.3"
    assert "libfoo.so" in record.error and "ImportError" in record.error and module in record.error
    assert set(BUILTIN) <= set(reg.names())


def test_a_plugin_for_another_api_version_is_refused(plugin_dir) -> None:
    module = plugin_dir(fake_backends_source('_make("future", 5)', api=2), dist="future-backend")
    reg = Registry(environ={})
    record = next(r for r in reg.plugins.records if r.name == module)
    assert record.status == "refused"
    assert "API 2" in record.error and "speaks API 1" in record.error
    assert "future" not in reg.names()


def test_a_plugin_that_declares_no_api_version_is_refused(plugin_dir) -> None:
    source = fake_backends_source('_make("anon", 5)').replace("YIRAGE_PLUGIN_API = 1", "")
    module = plugin_dir(source)
    record = next(r for r in Registry(environ={}).plugins.records if r.name == module)
    assert record.status == "refused" and "YIRAGE_PLUGIN_API = 1" in record.error


def test_a_hookimpl_that_does_not_fit_the_hookspec_is_refused(plugin_dir) -> None:
    source = """
        import yirage
        YIRAGE_PLUGIN_API = 1
        @yirage.hookimpl
        def yirage_backends(unexpected_argument):
            return []
    """
    module = plugin_dir(source)
    record = next(r for r in Registry(environ={}).plugins.records if r.name == module)
    assert record.status == "refused" and "unexpected_argument" in record.error


def test_an_unknown_hook_is_refused(plugin_dir) -> None:
    source = """
        import yirage
        YIRAGE_PLUGIN_API = 1
        @yirage.hookimpl
        def yirage_no_such_hook():
            return []
    """
    module = plugin_dir(source)
    reg = Registry(environ={})
    record = next(r for r in reg.plugins.records if r.name == module)
    assert record.status == "refused" and "yirage_no_such_hook" in record.error
    assert "cpu" in reg.names()


def test_a_hook_that_raises_or_returns_junk_fails_that_plugin_only(plugin_dir) -> None:
    raising = plugin_dir("""
        import yirage
        YIRAGE_PLUGIN_API = 1
        @yirage.hookimpl
        def yirage_backends():
            raise RuntimeError("driver exploded")
    """)
    junk = plugin_dir("""
        import yirage
        YIRAGE_PLUGIN_API = 1
        @yirage.hookimpl
        def yirage_backends():
            return [object]
    """)
    reg = Registry(environ={})
    records = {r.name: r for r in reg.plugins.records}
    assert records[raising].status == "failed" and "driver exploded" in records[raising].error
    assert records[junk].status == "failed" and "not a yirage Backend subclass" in records[junk].error
    assert "cpu" in reg.names()


def test_a_second_plugin_cannot_take_over_a_builtin_name(plugin_dir) -> None:
    plugin_dir(fake_backends_source('_make("cpu", 1000)'), dist="impostor")
    reg = Registry(environ={})
    assert reg.origin("cpu").distribution == "yirage-backend-cpu"
    assert any("impostor" in c and "'cpu'" in c for c in reg.conflicts)


def test_invalid_backend_names_are_refused(plugin_dir) -> None:
    module = plugin_dir(fake_backends_source('_make("Bad Name", 1)', '_make("auto", 1)'))
    reg = Registry(environ={})
    record = next(r for r in reg.plugins.records if r.name == module)
    assert record.status == "failed" and "lower-case identifier" in record.error
    assert "auto" not in reg.names()
