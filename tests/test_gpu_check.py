"""scripts/gpu_check.py: how a part's outcome becomes a row of the summary, and what makes the check fail.

The check itself runs at the end of ``make test`` (its compile-only part here, the whole of it on a GPU); these
tests hold its bookkeeping to account: a failing, a hanging and a passing command are told apart, the table
names each, the JSON holds every part, and only a part that is not ``ok`` makes the exit status 1.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_parts_are_told_apart_and_the_summary_names_each(gpu_check, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    py = sys.executable
    parts = [gpu_check.Part("passes", [py, "-c", "print('3 passed in 0.1s')"], 30).run(logs),
             gpu_check.Part("fails", [py, "-c", "print('FAILED t.py::a - boom'); print('1 failed, 2 passed'); "
                                                "raise SystemExit(1)"], 30).run(logs),
             gpu_check.Part("hangs", [py, "-c", "import time; time.sleep(30)"], 1).run(logs)]
    assert [p.status for p in parts] == ["ok", "FAILED (exit 1)", "TIMEOUT after 1 s"]
    assert parts[0].summary == "3 passed in 0.1s" and parts[1].summary == "1 failed, 2 passed"
    assert (logs / "fails.log").read_text().startswith("$ ") and parts[1].log == "logs/fails.log"
    text = gpu_check.write_summary(tmp_path, "header", parts, "a note")
    assert "| passes " in text and "| FAILED (exit 1) |" in text and "TIMEOUT after 1 s" in text
    assert parts[1].failures == ["FAILED t.py::a - boom"] and "    FAILED t.py::a - boom" in text
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert [p["name"] for p in saved["parts"]] == ["passes", "fails", "hangs"] and saved["note"] == "a note"
    assert (tmp_path / "summary.md").read_text().strip() == text.strip()


def test_only_a_part_that_is_not_ok_fails_the_check(gpu_check, tmp_path: Path, monkeypatch) -> None:
    py = sys.executable
    monkeypatch.setenv("YIRAGE_GPU_CHECK_DIR", str(tmp_path / "out"))
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: (False, "no GPU in this test"))
    monkeypatch.setattr(gpu_check, "compile_only_parts", lambda: [gpu_check.Part("ok", [py, "-c", "pass"], 30)])
    assert gpu_check.main() == 0
    assert "NO GPU HERE (no GPU in this test)" in (tmp_path / "out" / "summary.md").read_text()
    monkeypatch.setattr(gpu_check, "compile_only_parts", lambda: [gpu_check.Part("bad", [py, "-c", "1/0"], 30)])
    assert gpu_check.main() == 1


def test_an_optional_part_may_be_cut_by_the_budget_but_not_fail(gpu_check, tmp_path: Path) -> None:
    """The sanitizers and the Llama-1B decode are optional: skipped or out of time they pass, a failure fails."""
    py, logs = sys.executable, tmp_path / "logs"
    logs.mkdir()
    cut = gpu_check.Part("slow", [py, "-c", "import time; time.sleep(30)"], 1, optional=True).run(logs)
    assert cut.status.startswith("TIMEOUT") and gpu_check.passed(cut)
    broken = gpu_check.Part("wrong", [py, "-c", "1/0"], 30, optional=True).run(logs)
    assert broken.status.startswith("FAILED") and not gpu_check.passed(broken)
    required = gpu_check.Part("slow2", [py, "-c", "import time; time.sleep(30)"], 1).run(logs)
    assert not gpu_check.passed(required)
    timed = {p.name: p for p in gpu_check.timed_parts(tmp_path)}
    assert timed["decode-llama1b"].optional and timed["grid-barrier"].optional and not timed["decode-vs-hf"].optional
    assert all(p.optional for p in gpu_check.sanitizer_parts())


def test_a_part_past_the_checks_budget_is_killed_with_its_children_or_not_started(gpu_check, tmp_path: Path) -> None:
    import time

    logs = tmp_path / "logs"
    logs.mkdir()
    py = sys.executable
    child = tmp_path / "child.pid"
    # a part whose own child (as an xdist worker would be) outlives it unless the whole group is killed
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(child)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    hung = gpu_check.Part("hangs", [py, "-c", code], 60).run(logs, deadline=time.monotonic() + 6)
    assert hung.status == "TIMEOUT after 6 s" and hung.seconds < 30
    pid = int(child.read_text())
    status = Path(f"/proc/{pid}/status")
    for _ in range(50):  # killed: gone, or a zombie until whoever inherited it reaps it
        if not status.exists() or "\tZ" in status.read_text().split("State:")[1].splitlines()[0]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the part's child {pid} outlived the part's timeout")
    late = gpu_check.Part("late", [py, "-c", "pass"], 60).run(logs, deadline=time.monotonic() + 1)
    assert late.status.startswith("skipped: the check's time budget was spent")
