"""A torch.profiler table of a few calls, for the device benchmarks' ``--profile DIR`` (device_decode, device_graphs).

Why: a ratio far from its bound says that a run is slow, not where; the table names each kernel with its device
time and count (and the host calls beside them), which is what the next change needs. Tables, not traces: they
come back from a lent GPU machine as a few kilobytes of text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def profile_table(run: Callable[[], Any], where: Path, device_type: str, title: str = "") -> None:
    """Profile ``run()`` (one call) and write its busiest kernels, then its busiest host calls, to ``where``."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if device_type != "cpu":
            torch.accelerator.synchronize()
    events = prof.key_averages()
    where.parent.mkdir(parents=True, exist_ok=True)
    tables = [events.table(sort_by=key, row_limit=30, max_name_column_width=70)
              for key in ("self_device_time_total", "self_cpu_time_total")]
    where.write_text("\n\n".join(([title] if title else []) + tables) + "\n")


def file_label(text: str) -> str:
    """``text`` as a file name: letters, digits, '_' and '.' kept, anything else '-' (the device tool returns only
    plain names)."""
    return "".join(ch if ch.isalnum() or ch in "_." else "-" for ch in text)
