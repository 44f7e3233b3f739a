"""Two tiny C entry points for tests/test_compile_apart.py: compiled in a child process, loaded from numba's cache."""

from __future__ import annotations

from numba import types
from yirage_backend_cpu.pk_entry import task_entry
from yirage_backend_cpu.pk_tasks import i64s


def _write_answer(address):  # type: ignore[no-untyped-def]
    i64s(address, 1)[0] = 42


def _write_next(address):  # type: ignore[no-untyped-def]
    i64s(address, 1)[0] = 43


probe_entry = task_entry(_write_answer, types.void(types.int64))
second_probe = task_entry(_write_next, types.void(types.int64))
