"""Flash-decoding's split for the CPU runtime: an attention layer's task per KV head becomes several, one per
chunk of the cached positions, so a few KV heads keep every worker busy at long contexts.

SmolLM2 has 3 KV heads: at batch 1 its attention is 3 tasks, which 2 workers run in two rounds (one worker idle
through the second) while the next projection waits for all three. At 2048 positions that was a third of every
layer's attention time idle. Split in 2 chunks, the 6 tasks run in three rounds on both workers.

The core's task graph stays as built; the runtime expands its own copy: every copy of a split task waits for
what the task waited for and counts toward the events it triggered (their trigger counts grow to match). The
chunks' partial sums meet in ``pk_tasks.attention_task``: the last chunk of a KV head to finish merges them
before it triggers anything, so the consumers see finished rows as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK_MIN_SEQ = 1024  # a cache shorter than this keeps one task per KV head: the split's merge is not free
MAX_CHUNKS = 4


def attention_chunks(tasks: int, workers: int, cache_seq: int) -> int:
    """Chunks per KV head for an attention layer of ``tasks`` tasks: the fewest (up to MAX_CHUNKS) that give
    every worker as many tasks, 1 where the tasks already balance (4 per worker or more) or the cache is short."""
    if workers < 2 or cache_seq < CHUNK_MIN_SEQ or tasks >= 4 * workers:
        return 1
    for chunks in range(1, MAX_CHUNKS + 1):
        if tasks * chunks % workers == 0:
            return chunks
    return MAX_CHUNKS


@dataclass(frozen=True)
class ExpandedGraph:
    """The runtime's copy of the task graph with split tasks repeated; ``origin[t]``: the core's task that task
    ``t`` is a chunk of (the profiler reports per core task)."""

    task_layer: np.ndarray
    task_index: np.ndarray
    task_events: list[list[int]]
    task_waits: np.ndarray
    event_trigger: np.ndarray
    event_gates: list[list[int]]
    origin: np.ndarray


def expand(task_layer: list[int], task_index: list[int], task_events: list[list[int]], task_waits: list[int],
           event_trigger: list[int], event_gates: list[list[int]], chunks: dict[int, int]) -> ExpandedGraph:
    """Repeat each task of a layer in ``chunks`` (layer index -> chunks per task) that many times; the copies of
    task index i get indices i * chunks .. i * chunks + chunks - 1."""
    copies: list[list[int]] = []
    layer_out, index_out, events_out, waits_out, origin = [], [], [], [], []
    trigger = list(event_trigger)
    for t, layer in enumerate(task_layer):
        k = chunks.get(layer, 1)
        mine = []
        for c in range(k):
            mine.append(len(layer_out))
            layer_out.append(layer)
            index_out.append(task_index[t] * k + c)
            events_out.append(list(task_events[t]))
            waits_out.append(task_waits[t])
            origin.append(t)
        copies.append(mine)
        for e in task_events[t]:
            trigger[e] += k - 1
    gates = [[new for old in gated for new in copies[old]] for gated in event_gates]
    return ExpandedGraph(np.array(layer_out, np.int64), np.array(index_out, np.int64), events_out,
                         np.array(waits_out, np.int64), np.array(trigger, np.int64), gates,
                         np.array(origin, np.int64))


def fold_profile(profile: np.ndarray, origin: np.ndarray, tasks: int) -> np.ndarray:
    """Per core task (start, end, worker) from the expanded graph's records: a split task runs from its first
    chunk's start to its last chunk's end, on the worker that ran that last chunk."""
    out = np.zeros(3 * tasks, np.int64)
    starts, ends, workers = profile[0::3], profile[1::3], profile[2::3]
    for t, o in enumerate(origin):
        if ends[t] == 0:
            continue  # did not run (a stopped step)
        if out[3 * o + 1] == 0 or starts[t] < out[3 * o]:
            out[3 * o] = starts[t]
        if ends[t] > out[3 * o + 1]:
            out[3 * o + 1], out[3 * o + 2] = ends[t], workers[t]
    return out
