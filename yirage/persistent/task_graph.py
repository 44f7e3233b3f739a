"""The task graph: tasks, events with trigger counts, and what each event gates.

Backend-neutral: runtimes (torch reference, numba CPU, later GPU ones) only
read these arrays. An event fires when ``trigger[e]`` producer tasks have
finished; it then decrements the pending count of every task it gates; a
task with no pending events is ready for a worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from yirage.persistent.layers import Layer


@dataclass
class TaskGraph:
    layers: list[Layer]
    task_layer: list[int] = field(default_factory=list)  # task -> layer index
    task_index: list[int] = field(default_factory=list)  # task -> index within its layer
    task_events: list[list[int]] = field(default_factory=list)  # task -> events it triggers on finishing
    task_waits: list[int] = field(default_factory=list)  # task -> number of events it waits for
    event_trigger: list[int] = field(default_factory=list)  # event -> finishing tasks needed to fire
    event_gates: list[list[int]] = field(default_factory=list)  # event -> tasks it releases

    @property
    def num_tasks(self) -> int:
        return len(self.task_layer)

    @property
    def num_events(self) -> int:
        return len(self.event_trigger)

    def topological_order(self) -> list[int]:
        """A valid single-worker schedule (what the reference runtime follows)."""
        pending = list(self.task_waits)
        counts = [0] * self.num_events
        ready = [t for t in range(self.num_tasks) if pending[t] == 0]
        order: list[int] = []
        while ready:
            task = ready.pop(0)
            order.append(task)
            for e in self.task_events[task]:
                counts[e] += 1
                if counts[e] == self.event_trigger[e]:
                    for gated in self.event_gates[e]:
                        pending[gated] -= 1
                        if pending[gated] == 0:
                            ready.append(gated)
        if len(order) != self.num_tasks:
            raise AssertionError("the task graph has a cycle or an unreachable task")  # build bug, not user input
        return order

    def summary(self) -> str:
        lines = [f"TaskGraph: {self.num_tasks} tasks, {self.num_events} events, {len(self.layers)} layers"]
        for layer in self.layers:
            lines.append(f"  {layer}")
        return "\n".join(lines)


def build_task_graph(layers: list[Layer]) -> TaskGraph:
    graph = TaskGraph(layers)
    first_task: list[int] = []
    for layer in layers:
        first_task.append(graph.num_tasks)
        for t in range(layer.tasks):
            graph.task_layer.append(layer.index)
            graph.task_index.append(t)
            graph.task_events.append([])
            graph.task_waits.append(0)
    writer = {}  # tensor name -> producing layer
    for layer in layers:
        for role, tensor in layer.inputs.items():
            producer = writer.get(tensor.name)
            if producer is None:
                continue  # attached, or written in an earlier step
            p, c = producer.out_parts, layer.read_parts(role)
            g = math.gcd(p, c)
            for e in range(g):
                event = graph.num_events
                producers = [t for t in range(producer.tasks) if producer.write_part(t) * g // p == e]
                consumers = [t for t in range(layer.tasks) if layer.read_part(role, t) * g // c == e]
                graph.event_trigger.append(len(producers))
                graph.event_gates.append([first_task[layer.index] + t for t in consumers])
                for t in producers:
                    graph.task_events[first_task[producer.index] + t].append(event)
                for t in consumers:
                    graph.task_waits[first_task[layer.index] + t] += 1
        writer[layer.output.name] = layer
    return graph
