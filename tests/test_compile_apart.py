"""pk_entry.compile_ahead: on a cold cache a child process compiles entry points, in order, while this one compiles
the rest; ``compiled`` then waits for the child's word on an entry it has started and loads the child's code from
numba's cache (a cache hit, not a second compile), and takes back an entry it has not reached."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

pytest.importorskip("numba")
from entry_probe import probe_entry, second_probe  # noqa: E402
from yirage_backend_cpu import pk_entry  # noqa: E402


def _flush(entry) -> None:
    entry._cache.flush()
    entry._wrapper_address = None
    entry._cache_hits = 0


@pytest.fixture
def cold(monkeypatch: pytest.MonkeyPatch):
    """The probes with no code in this process or in numba's cache (the child finds their module on this process's
    import path)."""
    monkeypatch.delenv(pk_entry.COMPILE_APART_ENV, raising=False)
    for entry in (probe_entry, second_probe):
        _flush(entry)
    return probe_entry, second_probe


def answer(entry) -> int:
    out = np.zeros(1, np.int64)
    ctypes.CFUNCTYPE(None, ctypes.c_int64)(entry.address)(out.ctypes.data)
    return int(out[0])


def until(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the child did not get there in time"
        time.sleep(0.01)


def test_entries_the_child_compiled_are_loaded_here_from_its_cache(cold) -> None:
    first, second = cold
    ahead = pk_entry.compile_ahead([first, second])
    assert ahead is not None
    assert pk_entry.pending(first) and pk_entry.pending(second)  # its interpreter is still starting
    assert pk_entry.compile_ahead([first, second]) is None  # both are on their way: nothing more to start
    until(lambda: len(ahead.started) == 1)
    entry = pk_entry.compiled(first)  # started by the child: waited for
    assert entry._cache_hits == 1, "loaded from the child's cache, not compiled here"
    assert answer(entry) == 42
    until(lambda: ahead.ended)
    assert not pk_entry.pending(second)  # done: a caller that must not wait may load it now
    assert ahead.process.returncode == 0 and pk_entry.compiled(second)._cache_hits == 1 and answer(second) == 43
    assert pk_entry.compile_ahead([first, second]) is None  # compiled now: nothing to start


def test_entries_the_child_has_not_reached_are_taken_back_and_it_is_stopped(cold, tmp_path, monkeypatch) -> None:
    slow = tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\nexec sleep 60\n")  # a child that never gets to its first job
    slow.chmod(0o755)
    monkeypatch.setattr(pk_entry.sys, "executable", str(slow))
    first, second = cold
    ahead = pk_entry.compile_ahead([first, second])
    assert answer(pk_entry.compiled(first)) == 42 and first._cache_hits == 0  # compiled here, not waited for
    assert ahead.process.poll() is None  # its second job is still its own
    assert answer(pk_entry.compiled(second)) == 43 and second._cache_hits == 0
    until(lambda: ahead.ended)  # nothing left for it: stopped
    assert ahead.process.returncode < 0


def test_a_forked_process_compiles_what_it_needs_instead_of_waiting_for_the_parents_child(cold, tmp_path,
                                                                                           monkeypatch) -> None:
    """The child is the parent's and its reader thread does not survive a fork: a forked process that waited for a
    job the child had started would wait forever."""
    import multiprocessing

    stuck = tmp_path / "stuck-python"
    stuck.write_text("#!/bin/sh\necho start:entry_probe:probe_entry\nexec sleep 60\n")  # starts, never finishes
    stuck.chmod(0o755)
    monkeypatch.setattr(pk_entry.sys, "executable", str(stuck))
    first, _ = cold
    ahead = pk_entry.compile_ahead([first])
    until(lambda: ahead.started)
    forked = multiprocessing.get_context("fork").Process(target=_answer_or_fail, args=(first,))
    forked.start()
    forked.join(timeout=60)
    alive = forked.is_alive()
    if alive:
        forked.kill()
    ahead.kill()
    assert not alive and forked.exitcode == 0, "the forked process waited for its parent's child"


def _answer_or_fail(entry) -> None:
    if answer(pk_entry.compiled(entry)) != 42:
        raise SystemExit(1)


def test_nothing_starts_when_turned_off_and_a_failed_child_leaves_the_compile_here(cold, monkeypatch, caplog) -> None:
    first, _ = cold
    monkeypatch.setenv(pk_entry.COMPILE_APART_ENV, "0")
    assert pk_entry.compile_ahead([first]) is None
    monkeypatch.delenv(pk_entry.COMPILE_APART_ENV)
    monkeypatch.setattr(pk_entry.sys, "executable", "false")  # a child that fails at once
    ahead = pk_entry.compile_ahead([first])
    assert ahead is not None
    until(lambda: ahead.ended)
    entry = pk_entry.compiled(first)
    assert ahead.process.returncode != 0 and entry._cache_hits == 0 and answer(entry) == 42
    assert "compiling it here instead" in caplog.text


def test_a_killed_child_forgets_its_entries(cold) -> None:
    first, second = cold
    ahead = pk_entry.compile_ahead([first, second])
    ahead.kill()
    assert id(first) not in pk_entry._ahead and id(second) not in pk_entry._ahead
    assert answer(pk_entry.compiled(first)) == 42


def test_a_real_decode_runs_the_loop_compiled_for_the_childs_signature() -> None:
    """The child compiles the decode loop for pk_runtime.decode_signature() before any runtime exists; a runtime's
    real arguments must have exactly those types, or the process compiles the loop a second time."""
    import torch
    from yirage_backend_cpu import pk_runtime

    from yirage.models.config import LlamaConfig
    from yirage.models.llama import LlamaModel

    config = LlamaConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "vocab_size": 96})
    gen = torch.Generator().manual_seed(0)
    model = LlamaModel(config, {n: torch.randn(s, generator=gen) * 0.2 for n, s in config.weight_shapes().items()})
    model.reset_cache(1, 8)
    tokens, step = torch.zeros(1, 8, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    model.build_decoder(step, tokens, backend="cpu")(2)
    assert pk_runtime.decode.signatures == [pk_runtime.decode_signature()]
