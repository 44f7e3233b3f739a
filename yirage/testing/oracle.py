"""Compare a backend's outputs with the float64 torch reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yirage.graph.kernel_graph import KernelGraph
from yirage.graph.reference import run_reference

#: relative tolerance against the float64 oracle, per output dtype
TOLERANCE = {"float64": 1e-9, "float32": 2e-4, "float16": 4e-3, "bfloat16": 2e-2, "int32": 0.0, "int64": 0.0}


def random_inputs(graph: KernelGraph, seed: int = 0, scale: float = 1.0) -> list[Any]:
    """One tensor per graph input, laid out as declared (transposed weights too)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for node in graph.inputs:
        order = sorted(range(len(node.dims)), key=lambda i: -(node.strides or ())[i]) if node.strides else None
        dims = [node.dims[i] for i in order] if order else list(node.dims)
        if node.dtype.is_float:
            t = (torch.randn(dims, generator=gen, dtype=torch.float64) * scale).to(node.dtype.torch)
        else:
            t = torch.randint(0, 8, dims, generator=gen, dtype=node.dtype.torch)
        if order:
            t = t.permute([order.index(i) for i in range(len(order))])
        tensors.append(t)
    return tensors


def assert_matches_reference(graph: KernelGraph, inputs: Sequence[Any], backend: Any, rtol: float | None = None,
                             max_magnitude: float = 1e6) -> list[Any]:
    """Run ``graph`` on ``backend`` and check every output against float64 torch.

    Positions where the oracle is not finite or beyond ``max_magnitude`` are
    not compared (a backend may saturate where float64 overflows).
    """
    import torch

    outs = graph.run(list(inputs), backend=backend)
    refs = run_reference(graph, inputs, float64=True)
    for index, (out, ref, node) in enumerate(zip(outs, refs, graph.output_nodes, strict=True)):
        assert out.dtype == node.dtype.torch, f"output {index}: dtype {out.dtype}, declared {node.dtype}"
        assert tuple(out.shape) == node.dims, f"output {index}: shape {tuple(out.shape)}, declared {node.dims}"
        tol = TOLERANCE[node.dtype.name] if rtol is None else rtol
        if not node.dtype.is_float:
            assert torch.equal(out.to(torch.int64), ref.to(torch.int64)), f"output {index} differs"
            continue
        mask = torch.isfinite(ref) & (ref.abs() < max_magnitude)
        got, want = out.to(torch.float64)[mask], ref[mask]
        scale = float(want.abs().max()) if want.numel() else 1.0
        torch.testing.assert_close(
            got, want, rtol=tol, atol=tol * max(1.0, scale),
            msg=lambda m, i=index: f"output {i} of graph\n{graph}\ndiffers from the float64 reference: {m}",
        )
    return outs
