"""The reference's task bodies run a layer at a time: a decode step in torch, for a runtime that is still compiling.

The oracle (ReferenceRuntime) walks every task, so a 30-layer model's step is about 2000 torch calls (300 ms a
token for SmolLM2-135M); a projection's tasks differ only in their columns, so here each layer's body runs once over
all of them (attention once per (row, KV head), its tasks). The same bodies, the same descriptor rows and the same
step contract (which rows decode, EOS, the commit, Ctrl-C between layers) as the oracle: only the walk differs.

What it is for: a compiled runtime whose code is not in its compile cache yet can decode a greedy generation's
first steps with it while its compile runs (``PersistentKernel(..)(eager_start=True)``), so the first answer does
not wait for the compile. Layer order is a valid order of the task graph: its every event runs from a layer to a
later one (task_graph.build_task_graph: a tensor's producer is its last writer before the reading layer).
"""

from __future__ import annotations

from typing import Any

from yirage.persistent.kernel import install_eager_runtime
from yirage.persistent.layers import Layer
from yirage.persistent.specs import IntCol, Partition
from yirage.reference.persistent import TASKS, ReferenceRuntime


class EagerRuntime(ReferenceRuntime):
    """ReferenceRuntime with a step walked layer by layer (see the module docstring); it writes no profile. Like the
    oracle it reads Q8_0 / Q4_0 matrices as float32 copies made once (PersistentKernel allows it up to
    ``EAGER_FLOAT_COPIES`` bytes of them): widened per call instead, SmolLM2 Q4_0 took 370 ms a token, longer
    than its compile for a 48-token answer."""

    def _step(self, profile: Any) -> None:
        for layer in self.program.layers:
            if self._stop:
                return
            self.run_layer(layer)

    def run_layer(self, layer: Layer) -> None:
        """Every task of ``layer``: one body call over all its columns, or task by task where a task's part is
        its KV head's (attention: a task reads its own row's position and head)."""
        if layer.spec.output is Partition.PER_KV_HEAD:
            for t in range(layer.tasks):
                self.run_task(layer, t)
            return
        out = self.values[self.names[self._int(layer, IntCol.OUTPUT)]]
        TASKS.body(layer.kind)(self, layer, 0, out, 0, out.shape[1])


install_eager_runtime(EagerRuntime)
