"""yirage.log.working: the progress line shown on a terminal while a long step (a JIT compile) runs."""

from __future__ import annotations

import io
import time

from yirage.log import working


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_long_step_on_a_terminal_shows_its_elapsed_time_then_clears_the_line(monkeypatch) -> None:
    monkeypatch.delenv("YIRAGE_PROGRESS", raising=False)
    out = Terminal()
    with working("compiling", stream=out, every=0.05, after=0.05):
        time.sleep(0.4)
    text = out.getvalue()
    assert "\rcompiling ... 0 s" in text and text.endswith("\r")  # drawn, then blanked
    assert text.count("\rcompiling ...") >= 3


def test_nothing_is_shown_for_a_short_step_a_log_file_or_when_turned_off(monkeypatch) -> None:
    monkeypatch.delenv("YIRAGE_PROGRESS", raising=False)
    quick, log, off = Terminal(), io.StringIO(), Terminal()
    with working("compiling", stream=quick, after=5.0):
        pass
    with working("compiling", stream=log, every=0.05, after=0.05):
        time.sleep(0.2)
    monkeypatch.setenv("YIRAGE_PROGRESS", "0")
    with working("compiling", stream=off, every=0.05, after=0.05):
        time.sleep(0.2)
    assert quick.getvalue() == log.getvalue() == off.getvalue() == ""
    monkeypatch.setenv("YIRAGE_PROGRESS", "1")  # forced on a log file
    with working("compiling", stream=log, every=0.05, after=0.05):
        time.sleep(0.2)
    assert "compiling ..." in log.getvalue()


def test_an_error_in_the_step_propagates_and_stops_the_line(monkeypatch) -> None:
    monkeypatch.setenv("YIRAGE_PROGRESS", "1")
    out = io.StringIO()
    try:
        with working("compiling", stream=out, every=0.05, after=0.05):
            time.sleep(0.15)
            raise ValueError("the compile failed")
    except ValueError as exc:
        assert str(exc) == "the compile failed"
    size = len(out.getvalue())
    time.sleep(0.2)
    assert len(out.getvalue()) == size  # the drawing thread has stopped


def test_a_step_within_a_step_draws_no_line_of_its_own(monkeypatch) -> None:
    monkeypatch.setenv("YIRAGE_PROGRESS", "1")
    out = io.StringIO()
    with working("outer", stream=out, every=0.05, after=0.05):
        with working("inner", stream=out, every=0.05, after=0.05):
            time.sleep(0.3)
    assert "outer ..." in out.getvalue() and "inner" not in out.getvalue()
    after = io.StringIO()
    with working("again", stream=after, every=0.05, after=0.05):  # the outer step has ended: drawn again
        time.sleep(0.2)
    assert "again ..." in after.getvalue()
