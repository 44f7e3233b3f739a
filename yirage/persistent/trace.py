"""Export a PersistentKernel profile as a Chrome / Perfetto trace (JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def chrome_trace(pk: Any, profile: Any | None = None) -> dict[str, Any]:
    """One complete event per task of the profiled step: layer, task index, worker thread.

    ``profile`` defaults to the kernel's ``profiler_tensor`` (3 int64 per task:
    start ns, end ns, worker). Open the file in ui.perfetto.dev or chrome://tracing.
    """
    profile = pk.profiler_tensor if profile is None else profile
    program = pk.program
    if profile is None or program is None:
        raise ValueError("profile a compiled PersistentKernel: pass profiler_tensor=torch.zeros(3 * tasks, "
                         "dtype=torch.int64) and run it once")
    graph = program.task_graph
    values = [int(v) for v in profile.reshape(-1)[: 3 * graph.num_tasks]]
    events = []
    for task in range(graph.num_tasks):
        start, end, worker = values[3 * task: 3 * task + 3]
        if end <= 0:
            continue
        layer = program.layers[graph.task_layer[task]]
        events.append({
            "name": f"{layer.kind} L{layer.index}", "cat": layer.kind, "ph": "X", "pid": 0, "tid": worker,
            "ts": start / 1e3, "dur": max(end - start, 0) / 1e3,
            "args": {"task": task, "index": graph.task_index[task], "output": layer.output.name},
        })
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"backend": pk.backend.name, "tasks": graph.num_tasks, "events": graph.num_events}}


def write_chrome_trace(pk: Any, path: str | Path, profile: Any | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(pk, profile)))
    return path
