"""What the cpu backend derives from a weight tensor once per process and shares: Q4_0 / Q8_0 matrices repacked in
8-row groups (quant_group), and their address-table code (pk_quant.dtype_code, a scan of every block scale).

The decode runtime reads a quantized matrix as 8-row groups, and so do the prompt's projections (prompt_linear).
One copy per source serves both: a second decoder of the same model, or the prefill, finds the groups already
made. A source changed in place (its torch ``_version`` moved on) is derived again, a tensor into the same
buffer, so every holder sees the new weights. Entries go with their source tensor.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from yirage_backend_cpu.pk_quant import dtype_code
from yirage_backend_cpu.quant_group import repack_q4_0, repack_q8_0

_LOCK = threading.Lock()
_DERIVED: dict[tuple[int, Hashable], list[Any]] = {}  # (id(source), what) -> [weakref to source, _version, value]


def derived(source: Any, what: Hashable, make: Callable[[Any], Any]) -> Any:
    """``make(source)``, made once per ``what`` and kept while ``source`` lives; remade after an in-place change
    of ``source`` (a tensor result is copied into the first one, so its address stays)."""
    key = (id(source), what)
    with _LOCK:
        entry = _DERIVED.get(key)
        if entry is not None and entry[0]() is not source:  # a dead source's id, reused
            entry = None
        if entry is None:
            entry = [weakref.ref(source), source._version, make(source)]
            _DERIVED[key] = entry
            weakref.finalize(source, _forget, key, entry)
        elif entry[1] != source._version:
            fresh = make(source)
            if hasattr(entry[2], "copy_"):
                if fresh.shape != entry[2].shape:
                    raise ValueError(f"tensor {tuple(source.shape)} changed shape in place; attach the new tensor")
                entry[2].copy_(fresh)
            else:
                entry[2] = fresh
            entry[1] = source._version
        return entry[2]


def grouped(source: Any, rows: int, q8: bool) -> Any:
    """``source`` (the uint8 blocks of a Q8_0 / Q4_0 matrix of ``rows`` rows, ``rows`` % 8 == 0) as 8-row groups."""
    make = repack_q8_0 if q8 else repack_q4_0
    return derived(source, ("groups", rows, q8), lambda s: make(s.reshape(rows, -1)))


def block_code(source: Any, fmt: str) -> int:
    """pk_quant.dtype_code of ``source`` (``fmt`` blocks): whether every scale is finite, scanned once."""
    return derived(source, ("code", fmt), lambda s: dtype_code(fmt, s))


def _forget(key: tuple[int, Hashable], entry: list[Any]) -> None:
    with _LOCK:
        if _DERIVED.get(key) is entry:
            del _DERIVED[key]
