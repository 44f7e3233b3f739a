"""CUDA graphs of compiled plans: ``CUDABackend.capture`` records one capturable call, replays it.

Torch's rules for capture (``torch.cuda.graphs``): warm up on a side stream
first (a Triton step compiles and loads on its first launch, and the caching
allocator settles), then capture under ``torch.cuda.graph``, which runs on its
own stream and allocates from the graph's private pool. The captured outputs
and temporaries live in that pool as long as the graph does; the inputs are
the caller's persistent tensors, refilled before each replay. The launch path
is ``launch.CapturableRun``: no host sync or read in a call, status flags in
persistent buffers armed before the capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CapturedPlan:
    """``replay()`` runs the recorded launches on the captured buffers and returns the captured outputs."""

    def __init__(self, graph: Any, outputs: list[Any], run: Any, inputs: Sequence[Any]) -> None:
        self._graph, self._outputs, self._run = graph, outputs, run
        self._inputs = list(inputs)  # the graph reads their addresses: keep them alive as long as it

    def replay(self) -> list[Any]:
        self._graph.replay()
        return self._outputs

    def check_status(self) -> None:
        """Raise the bad-input error (an id out of range) a replay recorded on the device; waits only when the
        plan has such checks."""
        self._run.check_status()


def capture(executable: Any, inputs: Sequence[Any], cuda: Any = None) -> CapturedPlan:
    """Warm up, then capture one call of ``executable``'s capturable path on ``inputs``.

    The warm-up call's bad input is raised here, before a graph exists. ``cuda`` is ``torch.cuda``
    (a test passes a stand-in: this machine has no GPU).
    """
    import torch

    cuda = torch.cuda if cuda is None else cuda
    run = executable.capturable()  # arms the status flags (a synchronize): outside the capture
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        run(inputs)
    cuda.current_stream().wait_stream(side)
    run.check_status()
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        outputs = run(inputs)
    return CapturedPlan(graph, outputs, run, inputs)
