"""``tools/yirage_backend_manager.py test <backend> [--quick]``: runs the conformance kit and summarises it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fake_backends_source
from yirage.backend import selection
from yirage.backend.registry import Registry
from yirage.cli import QUICK_SELECTION, main
from yirage.errors import UnknownBackendError

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "yirage_backend_manager.py"


def _run_tool(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_quick_reference_passes_and_prints_counts(tmp_path: Path) -> None:
    run = _run_tool("test", "reference", "--quick")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # oracle: how many cases pytest itself collects for the same selection
    collect = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "yirage.testing.conformance", "-q",
                              "--collect-only", "--yirage-backend", "reference", "-k", QUICK_SELECTION,
                              "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    collected = int(re.search(r"(\d+)(?:/\d+)? tests? collected", collect.stdout).group(1))
    summary = re.search(r"conformance kit on 'reference' \(quick: [^)]*\): (\d+) passed, (\d+) failed, "
                        r"(\d+) errors, (\d+) skipped", run.stdout)
    assert summary, run.stdout[-3000:]
    passed, failed, errors, skipped = map(int, summary.groups())
    assert (failed, errors) == (0, 0)
    assert passed > 0 and passed + skipped == collected
    assert "PASS" in run.stdout


def test_unknown_backend_gives_the_registry_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UnknownBackendError) as expected:
        selection.registry().get("no_such_backend")
    assert main(["test", "no_such_backend"]) != 0
    assert str(expected.value) in capsys.readouterr().err


def test_unavailable_backend_exits_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    unusable = [b for b in selection.registry().backends()
                if not b.availability().ok and not callable(getattr(b, "compile_check", None))]
    if not unusable:
        pytest.skip("every backend here is available or has a compile-only check")
    backend = unusable[0]
    assert main(["test", backend.name]) != 0
    err = capsys.readouterr().err
    assert backend.availability().reason in err and "cannot be tested" in err


CHECK_SOURCE = '''
class Report:
    def __init__(self, ok):
        self.ok = ok
    def summary(self):
        return f"fake compile-only (FakeCC 1.0, arch_x): {'7/7' if self.ok else '6/7'} compiled"

def _with_check(cls, ok):
    cls.compile_check = lambda self: Report(ok)
    return cls
'''


@pytest.mark.parametrize("ok", [True, False])
def test_unavailable_backend_with_a_compile_check_runs_it(plugin_dir, isolated_selection, capsys, ok) -> None:
    module = plugin_dir(fake_backends_source(f'_with_check(_make("gpuless", 5, ok=False, reason="no device"), {ok})')
                        .replace("@yirage.hookimpl", CHECK_SOURCE + "\n@yirage.hookimpl"))
    isolated_selection(Registry(environ={"YIRAGE_PLUGINS": module}))
    assert main(["test", "gpuless"]) == (0 if ok else 1)
    out = capsys.readouterr().out
    assert "no device" in out and "COMPILE-ONLY" in out
    assert f"[compile-only] fake compile-only (FakeCC 1.0, arch_x): {'7/7' if ok else '6/7'} compiled" in out


def test_a_failing_kit_run_lists_the_failing_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from yirage.cli import parse_junit, print_kit_summary

    report = tmp_path / "junit.xml"
    report.write_text(
        '<?xml version="1.0"?><testsuites><testsuite>'
        '<testcase classname="" name="test_a[x]"/>'
        '<testcase classname="" name="test_b[x]"><failure message="AssertionError: off by 1&#10;more"/></testcase>'
        '<testcase classname="" name="test_c[x]"><skipped message="no bf16"/></testcase>'
        '<testcase classname="" name="test_d[x]"><skipped message="no bf16"/></testcase>'
        '</testsuite></testsuites>')
    result = parse_junit(report)
    assert (result.passed, result.failed, dict(result.skipped)) == (
        1, [("test_b[x]", "AssertionError: off by 1")], {"no bf16": 2})
    assert not result.ok
    print_kit_summary("fake", False, result)
    out = capsys.readouterr().out
    assert "1 passed, 1 failed, 0 errors, 2 skipped" in out
    assert "FAILED test_b[x]: AssertionError: off by 1" in out and "skipped 2x: no bf16" in out and "FAIL:" in out
