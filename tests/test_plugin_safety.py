"""Hang-proof discovery and untrusted plugin answers (issue 7, items 7 and 10).

Anything that could hang runs in a subprocess with a generous timeout, so a
regression fails the test instead of hanging pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import yirage as yr
from tests.conftest import fake_backends_source, numba_installed
from yirage import config
from yirage.backend import selection
from yirage.backend.registry import Registry
from yirage.errors import PluginError

ROOT = Path(__file__).resolve().parents[1]
KEEP = {"YIRAGE_CONFIG_DIR", "YIRAGE_CACHE_DIR"}
HANG_LIMIT = 240  # seconds before a subprocess counts as hung; generous for a loaded 2-core machine

HUNG_IMPORT = "import time\ntime.sleep(3600)\n"
HUNG_HOOK = """
    import time
    import yirage
    YIRAGE_PLUGIN_API = 1
    @yirage.hookimpl
    def yirage_backends():
        time.sleep(3600)
"""


def run_python(code: str, site: Path, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter that sees the fake plugins in ``site``; its last stdout line is JSON."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("YIRAGE_") or k in KEEP}
    full["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), full.get("PYTHONPATH", "")])
    full.update(env)
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                             env=full, cwd=ROOT, timeout=HANG_LIMIT, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"yirage hung behind a slow plugin (no answer in {HANG_LIMIT} s): {exc.stderr!r}")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def stuck_probe_source(*specs: str) -> str:
    """A plugin whose backend named 'stuck' has a probe that never returns."""
    return fake_backends_source(*specs).replace(
        "    return Fake\n",
        "    if name == 'stuck':\n        import time\n        Fake.probe = lambda self: time.sleep(3600)\n"
        "    return Fake\n",
    )


SELECTION_TOUR = """
    import json, threading
    import yirage as yr
    from yirage.backend import selection
    from yirage.errors import UnknownBackendError
    out = {}
    out["fast"] = yr.is_backend_available("fast")
    out["available"] = sorted(b.value for b in yr.get_available_backends())
    out["auto"] = yr.set_backend("auto").value
    out["report"] = {d.name: d.reason for d in yr.last_auto_report()}
    try:
        yr.set_backend("nosuch")
        out["nosuch"] = None
    except UnknownBackendError as exc:
        out["nosuch"] = str(exc)
    out["records"] = {r.name: r.__dict__ for r in selection.registry().plugins.records}
"""


def test_a_plugin_that_hangs_on_import_is_skipped_and_the_rest_still_load(plugin_dir, tmp_path) -> None:
    hung = plugin_dir(HUNG_IMPORT, dist="sleepy-backend", version="6.6")
    plugin_dir(fake_backends_source('_make("fast", 1000)'), ep_name="fast")
    out = run_python(SELECTION_TOUR + """
    yr.reset_backend(rediscover=True)  # a second discovery must not wait on the abandoned import
    out["again"] = {r.name: r.__dict__ for r in selection.registry().plugins.records}
    print(json.dumps(out))
    """, tmp_path, YIRAGE_PROBE_TIMEOUT="1")
    assert out["fast"] is True
    assert "fast" in out["available"] and "reference" in out["available"]
    assert out["auto"] == "fast"
    assert out["nosuch"] and "unknown backend 'nosuch'" in out["nosuch"]
    record = out["records"][hung]
    assert record["status"] == "failed" and record["distribution"] == "sleepy-backend"
    assert "import did not finish within 1 s" in record["error"] and hung in record["error"]
    assert "YIRAGE_PROBE_TIMEOUT" in record["error"]
    again = out["again"][hung]
    assert again["status"] == "failed" and "still running" in again["error"]
    assert out["again"]["fast"]["status"] == "loaded"


def test_a_probe_that_never_returns_times_out_once_and_is_memoized(plugin_dir, tmp_path) -> None:
    plugin_dir(stuck_probe_source('_make("stuck", 1001)', '_make("fast", 1000)'), dist="stuck-backend",
               ep_name="stuck")
    out = run_python("""
    import json, threading
    import yirage as yr
    from yirage.backend import selection
    from yirage.errors import UnknownBackendError
    out = {"stuck": yr.is_backend_available("stuck")}
    backend = selection.registry().get("stuck")
    first = backend.availability()
    out["memoized"] = backend.availability() is first
    out["reason"] = first.reason
    yr.reset_backend()  # forgets probes: the hanging one is waited on again, not started twice
    out["again"] = backend.availability().reason
    out["probe_threads"] = sum(t.name == "yirage-probe-stuck" for t in threading.enumerate())
    """ + SELECTION_TOUR.split("out = {}", 1)[1] + "    print(json.dumps(out))\n", tmp_path, YIRAGE_PROBE_TIMEOUT="1")
    assert out["stuck"] is False and out["memoized"]
    assert out["reason"].startswith("probe timed out after 1 s")
    assert "stuck-backend" in out["reason"] and "YIRAGE_PROBE_TIMEOUT" in out["reason"]
    assert out["again"].startswith("probe timed out after 1 s") and out["probe_threads"] == 1
    assert "stuck" not in out["available"] and "fast" in out["available"]
    assert out["auto"] == "fast" and out["report"]["stuck"].startswith("probe timed out after 1 s")
    assert out["nosuch"] and "unknown backend 'nosuch'" in out["nosuch"]


def test_a_hook_that_never_returns_fails_only_its_plugin(plugin_dir, tmp_path) -> None:
    hung = plugin_dir(HUNG_HOOK, dist="hooky-backend")
    plugin_dir(fake_backends_source('_make("fast", 1000)'), ep_name="fast")
    out = run_python(SELECTION_TOUR + "    print(json.dumps(out))\n", tmp_path, YIRAGE_PROBE_TIMEOUT="1")
    assert out["auto"] == "fast"
    record = out["records"][hung]
    assert record["status"] == "failed" and "did not return within 1 s" in record["error"]


def test_selecting_by_name_does_not_import_unrelated_plugins(plugin_dir, tmp_path) -> None:
    hung = plugin_dir(HUNG_IMPORT, dist="sleepy-backend")
    plugin_dir(fake_backends_source('_make("fast", 1000)'), ep_name="fast")
    plugin_dir(fake_backends_source('_make("zed", 5)'), dist="yirage-backend-zed")
    # a limit longer than the subprocess may run: touching the hung plugin would fail the test
    out = run_python(f"""
    import json, sys
    import yirage as yr
    from yirage.backend import selection
    out = {{"env": yr.get_backend().value}}  # YIRAGE_BACKEND=fast
    out["cpu"] = yr.is_backend_available("cpu")
    out["set"] = yr.set_backend("fast").value
    out["zed"] = selection.resolve("zed").name  # found through its distribution name
    out["origin"] = selection.registry().origin("cpu").distribution
    out["imported"] = {hung!r} in sys.modules
    print(json.dumps(out))
    """, tmp_path, YIRAGE_PROBE_TIMEOUT="3600", YIRAGE_BACKEND="fast")
    assert out == {"env": "fast", "cpu": numba_installed(), "set": "fast", "zed": "zed",
                   "origin": "yirage-backend-cpu", "imported": False}


def test_a_name_lookup_keeps_builtins_winning_clashes(plugin_dir) -> None:
    plugin_dir(fake_backends_source('_make("cpu", 1000)'), dist="impostor", ep_name="cpu")
    plugin_dir(fake_backends_source('_make("evil", 5)', '_make("opencl", 1000)'), dist="evil", ep_name="evil")
    reg = Registry(environ={})
    assert reg.origin("cpu").distribution == "yirage-backend-cpu"
    assert reg.origin("evil").distribution == "evil"
    assert reg.origin("opencl").distribution == "yirage-backend-opencl"
    assert any("'opencl'" in c and "evil" in c for c in reg.conflicts)


def test_a_name_lookup_respects_the_switches() -> None:
    assert "cpu" not in Registry(environ={"YIRAGE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert "cpu" not in Registry(environ={"YIRAGE_PLUGINS": "opencl"})
    assert "cpu" in Registry(environ={"YIRAGE_PLUGINS": "yirage-backend-cpu"})
    assert "ascend" in Registry(environ={})
    assert "ascend" not in Registry(environ={"YIRAGE_PLUGINS": "cuda"})


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "1e999"])
def test_a_bad_probe_timeout_is_refused_clearly(value: str) -> None:
    with pytest.raises(config.ConfigError, match=r"YIRAGE_PROBE_TIMEOUT=.*positive number of seconds"):
        Registry(environ={"YIRAGE_PROBE_TIMEOUT": value}).names()


def test_the_probe_timeout_default_and_override() -> None:
    assert config.probe_timeout({}) == config.DEFAULT_PROBE_TIMEOUT == 20
    assert config.probe_timeout({"YIRAGE_PROBE_TIMEOUT": " 2.5 "}) == 2.5


# -- item 10: plugin answers are checked at the boundary -------------------------


def _junk_probe_plugin(plugin_dir, answer: str) -> str:
    source = fake_backends_source('_make("sloppy", 1000)', '_make("honest", 999)').replace(
        "    return Fake\n",
        f"    if name == 'sloppy':\n        Fake.probe = lambda self: {answer}\n    return Fake\n",
    )
    return plugin_dir(source, dist="sloppy-dist")


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        ("yirage.Availability(ok='no', reason='fine')", "ok='no'"),
        ("yirage.Availability(1, 'fine')", "ok=1"),
        ("yirage.Availability(None, 'fine')", "ok=None"),
        ("yirage.Availability(True, 42)", "reason=42"),
        ("yirage.Availability(True, 'fine', auto='yes')", "auto='yes'"),
        ("'yes'", "'yes' instead of an Availability"),
    ],
)
def test_a_malformed_availability_makes_the_backend_unavailable(
    plugin_dir, isolated_selection, answer: str, shown: str
) -> None:
    module = _junk_probe_plugin(plugin_dir, answer)
    reg = Registry(environ={})
    isolated_selection(reg)
    avail = reg.get("sloppy").availability()
    assert avail.ok is False
    assert shown in avail.reason and "sloppy-dist" in avail.reason and module in avail.reason
    assert not yr.is_backend_available("sloppy")
    assert yr.set_backend("auto") == "honest"


@pytest.mark.parametrize(
    ("patch", "shown"),
    [
        ("Fake.priority = True", "priority must be an int"),
        ("Fake.priority = '50'", "priority must be an int"),
        ("Fake.vendor = 5", "vendor must be a str"),
        ("Fake.torch_device = None", "torch_device must be a str"),
        ("Fake.kernel_dtypes = ['float32']", "kernel_dtypes must be a frozenset"),
    ],
)
def test_malformed_backend_attributes_are_refused(plugin_dir, patch: str, shown: str) -> None:
    source = fake_backends_source('_make("odd", 5)').replace("    return Fake\n", f"    {patch}\n    return Fake\n")
    module = plugin_dir(source)
    reg = Registry(environ={})
    record = next(r for r in reg.plugins.records if r.name == module)
    assert record.status == "failed" and shown in record.error and module in record.error
    assert "odd" not in reg.names() and "cpu" in reg.names()


@pytest.mark.parametrize(
    ("method", "value", "shown"),
    [
        ("device_info", "{'name': 'gpu'}", "instead of a DeviceInfo"),
        ("device_info", "yirage.DeviceInfo('d', 'v', 'gpu', compute_units='many')", "compute_units='many'"),
        ("memory_info", "(1, 2, 3)", "instead of a MemoryInfo"),
        ("memory_info", "yirage.MemoryInfo('lots', 0, 0)", "total='lots'"),
    ],
)
def test_malformed_device_and_memory_info_name_the_plugin(
    plugin_dir, isolated_selection, method: str, value: str, shown: str
) -> None:
    source = fake_backends_source('_make("liar", 5)').replace(
        "    return Fake\n", f"    Fake.{method} = lambda self, index=0: {value}\n    return Fake\n"
    )
    module = plugin_dir(source, dist="liar-dist")
    reg = Registry(environ={})
    isolated_selection(reg)
    info = yr.get_backend_info("liar")
    assert shown in info["error"] and "liar-dist" in info["error"] and module in info["error"]
    if method == "memory_info":
        with pytest.raises(PluginError, match="liar-dist"):
            selection.get_memory_info("liar")
