"""pk_entry.compile_apart: on a cold cache a child process compiles an entry point while this one compiles the rest;
this process then loads the child's code from numba's cache (a cache hit, not a second compile)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("numba")
from entry_probe import probe_entry  # noqa: E402
from yirage_backend_cpu import pk_entry  # noqa: E402


@pytest.fixture
def cold(monkeypatch: pytest.MonkeyPatch):
    """The probe with no code in this process or in numba's cache (the child finds its module on this process's
    import path)."""
    monkeypatch.delenv(pk_entry.COMPILE_APART_ENV, raising=False)
    probe_entry._cache.flush()
    probe_entry._wrapper_address = None
    probe_entry._cache_hits = 0
    return probe_entry


def answer(entry) -> int:
    out = np.zeros(1, np.int64)
    ctypes.CFUNCTYPE(None, ctypes.c_int64)(entry.address)(out.ctypes.data)
    return int(out[0])


def test_a_cold_entry_is_compiled_by_a_child_and_loaded_here_from_the_cache(cold) -> None:
    child = pk_entry.compile_apart(cold)
    assert child is not None
    entry = pk_entry.finish(child, cold)
    assert child.returncode == 0 and entry._cache_hits == 1, "loaded from the child's cache, not compiled here"
    assert answer(entry) == 42
    assert pk_entry.compile_apart(cold) is None  # compiled now: nothing to start


def test_nothing_starts_when_turned_off_and_a_failed_child_leaves_the_compile_here(cold, monkeypatch, caplog) -> None:
    monkeypatch.setenv(pk_entry.COMPILE_APART_ENV, "0")
    assert pk_entry.compile_apart(cold) is None
    monkeypatch.delenv(pk_entry.COMPILE_APART_ENV)
    monkeypatch.setattr(pk_entry.sys, "executable", "false")  # a child that fails at once
    child = pk_entry.compile_apart(cold)
    assert child is not None
    entry = pk_entry.finish(child, cold)
    assert child.returncode != 0 and entry._cache_hits == 0 and answer(entry) == 42
    assert "compiling it here instead" in caplog.text
