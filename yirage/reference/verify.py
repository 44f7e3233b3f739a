"""The oracle's tolerances and comparison, and seeded inputs that every graph accepts.

Here, below the conformance kit (``yirage.testing``), because ``g.superoptimize()`` (``yirage.superopt``) holds
each candidate plan to the same float64 oracle and the same per-dtype tolerances as the kit holds a backend:
one definition of "equal" for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yirage.graph.kernel_graph import KernelGraph

#: per output dtype: (rtol, atol) against a float64 oracle; rtol is relative to the element's error scale
DTYPE_TOLERANCE = {
    "float64": (1e-9, 1e-12),
    "float32": (5e-5, 1e-6),
    "float16": (5e-3, 1e-4),
    "bfloat16": (3e-2, 1e-5),
    "int32": (0.0, 0.0),
    "int64": (0.0, 0.0),
}
def _int_role(graph: KernelGraph, node_id: int) -> tuple[int, int]:
    """The range [lo, hi) an integer input must be drawn from: embedding ids, attention lengths, else 0..7."""
    for user in graph.consumers().get(node_id, []):
        node = graph.nodes[user]
        if node.op == "embedding" and node.inputs[0] == node_id:
            return 0, graph.nodes[node.inputs[1]].dims[0]
        if node.op == "attention" and len(node.inputs) > 3 and node.inputs[3] == node_id:
            return 1, graph.nodes[node.inputs[1]].dims[2] + 1
    return 0, 8


def random_inputs(graph: KernelGraph, seed: int = 0, scale: float = 1.0) -> list[Any]:
    """One seeded tensor per graph input, laid out as declared (transposed weights too).

    Integer inputs feeding an embedding are valid ids, those feeding an attention valid lengths.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for node in graph.inputs:
        order = sorted(range(len(node.dims)), key=lambda i: -(node.strides or ())[i]) if node.strides else None
        dims = [node.dims[i] for i in order] if order else list(node.dims)
        if node.dtype.is_float:
            t = (torch.randn(dims, generator=gen, dtype=torch.float64) * scale).to(node.dtype.torch)
        else:
            lo, hi = _int_role(graph, node.id)
            t = torch.randint(lo, hi, dims, generator=gen, dtype=node.dtype.torch)
        if order:
            t = t.permute([order.index(i) for i in range(len(order))])
        tensors.append(t)
    return tensors


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
