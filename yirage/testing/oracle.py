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


def assert_same_floats(got: Any, want: Any, rtol: float, atol: float, scale: Any = None,
                       alternatives: Sequence[Any] = (), what: str = "output") -> None:
    """IEEE-aware comparison of ``got`` with ``want`` (torch's own result at the same dtype).

    NaN must sit exactly where ``want`` has NaN (NaN == NaN here); an infinity must be matched by the
    same infinity, sign included; finite values must agree within ``atol + rtol * m`` per element,
    where ``m`` is that element's own reference magnitude ``|want|`` (not the tensor's maximum), or
    ``scale`` where it is larger: the float64 magnitude of the terms summed into the element (a sum
    whose terms cancel is only as exact as its terms are large). An element also passes if it
    matches one of ``alternatives`` the same way (where torch itself is inconsistent, e.g. float32
    gelu(+inf), or where a narrow dtype may be computed in float32 and rounded once).
    """
    import torch

    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    g, w = got.detach().to(torch.float64).flatten(), want.detach().to(torch.float64).flatten()

    def passes(w: Any) -> Any:
        m = w.abs() if scale is None else torch.maximum(w.abs(), scale.to(torch.float64).flatten().abs())
        close = (g - w).abs() <= atol + rtol * m
        finite = torch.isfinite(w) & torch.isfinite(g) & close
        return (g.isnan() & w.isnan()) | (torch.isinf(w) & (g == w)) | finite

    ok = passes(w)
    for alternative in alternatives:
        ok |= passes(alternative.detach().to(torch.float64).flatten())
    if bool(ok.all()):
        return
    bad = (~ok).nonzero().flatten()
    shown = ", ".join(f"[{int(i)}] got {g[i].item()!r} want {w[i].item()!r}" for i in bad[:8])
    raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} elements differ from torch "
                         f"(rtol {rtol}, atol {atol}, flat index): {shown}")


#: The unary ops every backend is held to, each as ``(graph, input) -> output`` (shared by the kit's cases).
UNARY = {
    "exp": lambda g, x: g.exp(x),
    "silu": lambda g, x: g.silu(x),
    "gelu": lambda g, x: g.gelu(x),
    "relu": lambda g, x: g.relu(x),
    "square": lambda g, x: g.square(x),
    "clamp": lambda g, x: g.clamp(x, -0.5, 0.75),
    "clamp_min": lambda g, x: g.clamp(x, min_val=0.1),
}
