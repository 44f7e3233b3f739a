"""Run a kernel graph op by op with torch: the semantics every backend matches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yirage.graph.kernel_graph import KernelGraph
from yirage.graph.ops import OPS


def run_reference(graph: KernelGraph, inputs: Sequence[Any], float64: bool = False) -> list[Any]:
    """Evaluate ``graph`` eagerly; ``float64=True`` widens floating tensors first (the test oracle)."""
    import torch

    if len(inputs) != len(graph.inputs):
        raise ValueError(f"the graph has {len(graph.inputs)} inputs but {len(inputs)} tensors were passed")
    values: dict[int, Any] = {}
    for node, t in zip(graph.inputs, inputs, strict=True):
        values[node.id] = t.to(torch.float64) if float64 and node.dtype.is_float else t
    for node in graph.nodes:
        if node.op == "input":
            continue
        args = [values[i] for i in node.inputs]
        values[node.id] = OPS[node.op].reference(*args, **node.attrs)
    input_ids = {n.id for n in graph.inputs}
    return [values[i].clone() if i in input_ids else values[i].contiguous() for i in graph.outputs]
