"""Replay plans for kernel graphs: a fixed KernelGraph, or a builder called once per input signature.

fusion        the graph compiled on the engine's backend (fused kernels), replayed from persistent input buffers,
              through a device graph captured on them where the backend has device graphs (CUDA graphs)
graph_replay  the fused compile failed: the same graph compiled on the reference backend (op by op, unfused),
              replayed from persistent input buffers
eager         fusion off: the graph evaluated op by op in torch (run_reference) on the caller's tensors, no buffers
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from yirage.backend.base import Backend
from yirage.graph.kernel_graph import KernelGraph
from yirage.replay.signature import ReplayError, Signature, check_plain_tensor, dtype_name

#: the backend a failed fused compile falls back to: torch op by op, the oracle, compiles any graph
FALLBACK_BACKEND = "reference"


@dataclass
class GraphCall:
    tensors: list[Any]
    signature: Signature


class GraphTarget:
    """Checks calls, builds each signature's graph and records its plans."""

    def __init__(self, source: KernelGraph | Callable[..., KernelGraph], backend: Backend) -> None:
        self.backend = backend
        self.device = backend.torch_device.split(":")[0]
        if isinstance(source, KernelGraph):
            if not source.outputs:
                raise ReplayError("the KernelGraph has no outputs: call g.mark_output(t) before wrapping it")
            self.graph: KernelGraph | None = source.copy()  # ops added to the user's graph later do not reach us
            self.builder = None
        else:
            self.graph, self.builder = None, source

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GraphCall:
        if kwargs:
            raise ReplayError(f"a kernel-graph engine takes its input tensors positionally, got keywords "
                              f"{sorted(kwargs)}; call engine(x, w, ...) or engine([x, w, ...])")
        tensors = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
        for k, t in enumerate(tensors):
            check_plain_tensor(t, f"input {k}", self.device)
        if self.graph is not None:
            _check_matches(self.graph, tensors, "the wrapped KernelGraph declares",
                           "to run other shapes or dtypes, wrap a graph builder instead: "
                           "FusedInferEngine(lambda *inputs: build_graph_for(inputs))")
        sig = Signature(tuple((f"in{k}", tuple(t.shape), dtype_name(t.dtype)) for k, t in enumerate(tensors)),
                        self.device, self.backend.name)
        return GraphCall(tensors, sig)

    def recording(self, call: GraphCall) -> GraphRecording:
        """The graph for this signature (the builder runs here, once per entry) and the ways to run it."""
        graph = self.graph
        if graph is None:
            assert self.builder is not None
            graph = self.builder(*call.tensors)
            if not isinstance(graph, KernelGraph):
                raise ReplayError(f"the graph builder returned {type(graph).__name__}, not a KernelGraph; return the "
                                  "graph it built (yr.new_kernel_graph(), inputs, ops, mark_output)")
            if not graph.outputs:
                raise ReplayError("the graph builder returned a graph with no outputs; call g.mark_output(t) in it")
            _check_matches(graph, call.tensors, "the graph builder's graph declares",
                           "build the graph's inputs from the shapes and dtypes of the tensors the builder receives")
            graph = graph.copy()
        return GraphRecording(graph, self.backend, self.device)

    def clear(self) -> None:
        """Nothing outlives the entries (their plans own the buffers)."""


def _check_matches(graph: KernelGraph, tensors: Sequence[Any], whose: str, fix: str) -> None:
    if len(tensors) != len(graph.inputs):
        raise ReplayError(f"{len(tensors)} tensor(s) were passed, but {whose} {len(graph.inputs)} input(s); pass one "
                          "tensor per g.new_input(...), in declaration order")
    for k, (node, t) in enumerate(zip(graph.inputs, tensors, strict=True)):
        if tuple(t.shape) != node.dims or t.dtype != node.dtype.torch:
            raise ReplayError(f"input {k} is {list(t.shape)} {dtype_name(t.dtype)}, but {whose} {list(node.dims)} "
                              f"{node.dtype.name} for it; {fix}")


class GraphRecording:
    """One graph, recorded three ways on demand (the engine picks which)."""

    fused_reason: str | None = None  # every graph has a fused plan to try

    def __init__(self, graph: KernelGraph, backend: Backend, device: str) -> None:
        self.graph, self.backend, self.device = graph, backend, device

    def fused(self) -> BufferedGraphPlan:
        return BufferedGraphPlan("fusion", self.graph.compile(self.backend.name), self.device)

    def fallback(self) -> BufferedGraphPlan:
        return BufferedGraphPlan("graph_replay", self.graph.compile(FALLBACK_BACKEND), self.device)

    def eager(self) -> EagerGraphPlan:
        return EagerGraphPlan(self.graph)


class BufferedGraphPlan:
    """A compiled executable and one persistent buffer per input, laid out as the graph declares.

    Each call copies the caller's tensors into the buffers (any strides are
    accepted; the copy lays them out) and returns copies of the outputs, so
    nothing the caller holds is ever overwritten by a later call. After
    ``capture`` succeeds (a backend with device graphs: CUDA), a call replays
    the device graph recorded on the buffers instead of calling the executable.
    """

    recorded = True

    def __init__(self, mode: str, executable: Any, device: str) -> None:
        import torch

        self.mode, self.executable, self.device = mode, executable, device
        where = executable.backend.torch_device
        self.buffers = [torch.empty_strided(n.dims, n.strides, dtype=n.dtype.torch, device=where)
                        for n in executable.graph.inputs]
        self.device_graph: Any = None

    def capture(self, call: GraphCall) -> bool:
        """Record the backend's device graph on the buffers, filled with this call's data (the capture runs the
        plan once, uncaptured, to warm it up); False when the backend has no device graphs."""
        import torch

        from yirage.runtime.device_graph import capture

        with torch.no_grad():
            self._fill(call)
            self.device_graph = capture(self.executable, self.buffers)
        return self.device_graph is not None

    def run(self, call: GraphCall) -> list[Any]:
        import torch

        with torch.no_grad():
            self._fill(call)
            if self.device_graph is None:
                outputs = self.executable(self.buffers)
            else:
                outputs = self.device_graph.replay()
                self.device_graph.check_status()  # a bad id raises from this call, as an uncaptured call's would
            return [o.to(self.device, copy=True) for o in outputs]

    def _fill(self, call: GraphCall) -> None:
        for buffer, t in zip(self.buffers, call.tensors, strict=True):
            buffer.copy_(t)


class EagerGraphPlan:
    """torch op by op on the caller's tensors (fresh outputs every call)."""

    mode = "eager"
    recorded = False

    def __init__(self, graph: KernelGraph) -> None:
        self.graph = graph

    def run(self, call: GraphCall) -> list[Any]:
        import torch

        from yirage.reference.graph import run_reference

        with torch.no_grad():  # as compiled plans: outputs never require grad
            return run_reference(self.graph, call.tensors)
