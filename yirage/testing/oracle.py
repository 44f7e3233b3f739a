"""Compare a backend's outputs with an independent oracle, element by element.

Inputs are made on the CPU (seeded, the same bits everywhere) and moved to the backend's torch device
(``on_backend``) only to run there; the oracle is computed on the CPU copies and every output is brought
back to the CPU before it is compared, so the kit holds a GPU backend to the same numbers as the CPU.

Every finite element must satisfy ``|out - want| <= atol + rtol * m``, where ``m`` is that element's
own reference magnitude, or the float64 magnitude of the terms summed into it where that is larger
(a sum whose terms cancel is only as exact as its terms are large): never the largest entry of the
whole tensor, which would let a single big entry hide every small one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from yirage.graph.kernel_graph import KernelGraph
from yirage.testing.magnitude import graph_oracle

#: per output dtype: (rtol, atol) against a float64 oracle; rtol is relative to the element's error scale
DTYPE_TOLERANCE = {
    "float64": (1e-9, 1e-12),
    "float32": (5e-5, 1e-6),
    "float16": (5e-3, 1e-4),
    "bfloat16": (3e-2, 1e-5),
    "int32": (0.0, 0.0),
    "int64": (0.0, 0.0),
}
#: relative tolerance alone, per output dtype (the extreme-value cases, against torch at the same dtype)
TOLERANCE = {"float64": 1e-9, "float32": 2e-4, "float16": 4e-3, "bfloat16": 2e-2, "int32": 0.0, "int64": 0.0}


def _int_role(graph: KernelGraph, node_id: int) -> tuple[int, int]:
    """The range [lo, hi) an integer input must be drawn from: embedding ids, attention lengths, else 0..7."""
    for user in graph.consumers().get(node_id, []):
        node = graph.nodes[user]
        if node.op == "embedding" and node.inputs[0] == node_id:
            return 0, graph.nodes[node.inputs[1]].dims[0]
        if node.op == "attention" and len(node.inputs) > 3 and node.inputs[3] == node_id:
            return 1, graph.nodes[node.inputs[1]].dims[2] + 1
    return 0, 8


def backend_device(backend: Any) -> Any:
    """The torch device a backend (a name, BackendType or Backend) reads and writes tensors on."""
    import torch

    from yirage.backend.selection import registry

    found = registry().get(backend) if isinstance(backend, str) or not hasattr(backend, "torch_device") else backend
    return torch.device(found.torch_device)


def on_backend(values: Sequence[Any], backend: Any) -> list[Any]:
    """``values`` with every tensor moved to ``backend``'s device, strides and defects kept (a transposed view stays
    transposed); meta tensors and non-tensors are passed as they are (the cases that hand them over test refusals)."""
    import torch

    device = backend_device(backend)

    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.device.type == "meta" or v.device == device:
            return v
        return v.to(device)

    return [move(v) for v in values]


def run_on_backend(graph: KernelGraph, inputs: Sequence[Any], backend: Any) -> list[Any]:
    """``graph`` run on ``backend`` with ``inputs`` (CPU tensors) moved to its device; the outputs on the CPU."""
    return [out.cpu() for out in graph.run(on_backend(inputs, backend), backend=backend)]


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


def assert_close(got: Any, want: Any, dtype: str, scale: Any = None, what: str = "output") -> None:
    """``got`` (at ``dtype``) against a float64 ``want``, per element, with ``DTYPE_TOLERANCE[dtype]``.

    ``scale``: the float64 magnitude of the terms summed into each element (e.g. ``|A| @ |B|``).
    Integers must be equal.
    """
    import torch

    assert str(got.dtype).removeprefix("torch.") == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not got.is_floating_point():
        assert torch.equal(got.to(torch.int64), want.to(torch.int64)), f"{what}: integers differ from the oracle"
        return
    rtol, atol = DTYPE_TOLERANCE[dtype]
    assert_same_floats(got, want, rtol, atol, scale=scale, what=what)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def assert_matches_torch(graph: KernelGraph, inputs: Sequence[Any], backend: Any, expect: Callable[..., Any],
                         scale: Callable[..., Any] | None = None) -> list[Any]:
    """Run ``graph`` on ``backend`` and compare it with ``expect``, a torch expression written in the test.

    ``expect(*inputs)`` gets the inputs widened to float64 and returns the expected output (or a list
    of them); it must not go through yirage. ``scale(*inputs)``, given the same, returns each output's
    error scale (or None for an output that is no sum): the float64 magnitude of the terms summed into
    each element, e.g. ``abs(a) @ abs(b)`` for a matmul.
    """
    import torch

    wide = [t.to(torch.float64) if t.is_floating_point() else t for t in inputs]
    wants = _as_list(expect(*wide))
    scales = _as_list(scale(*wide)) if scale is not None else [None] * len(wants)
    outs = run_on_backend(graph, inputs, backend)
    assert len(outs) == len(wants) == len(scales), f"{len(outs)} outputs, the oracle gives {len(wants)}"
    for index, (out, want, sc, node) in enumerate(zip(outs, wants, scales, graph.output_nodes, strict=True)):
        assert_close(out, want, node.dtype.name, sc, what=f"output {index} on {backend} ({node.dtype})")
    return outs


def assert_matches_reference(graph: KernelGraph, inputs: Sequence[Any], backend: Any, max_magnitude: float = 1e6,
                             what: str = "") -> list[Any]:
    """Run ``graph`` on ``backend`` and check every output against the graph evaluated in float64 by torch.

    The oracle is ``run_reference``'s op table, so this is independent of a compiled backend only: the
    ``reference`` backend must be checked with ``assert_matches_torch``. Each element's tolerance
    scales with its error magnitude from ``graph_oracle``; positions where the oracle is not finite
    or beyond ``max_magnitude`` are not compared (a backend may saturate where float64 overflows).
    """
    import torch

    outs = run_on_backend(graph, inputs, backend)
    refs, scales = graph_oracle(graph, inputs)
    for index, (out, ref, scale, node) in enumerate(zip(outs, refs, scales, graph.output_nodes, strict=True)):
        assert tuple(out.shape) == node.dims, f"output {index}: shape {tuple(out.shape)}, declared {node.dims}"
        where = f"output {index} of graph {what}\n{graph}\non {backend}"
        if scale is None:
            assert_close(out, ref, node.dtype.name, what=where)
            continue
        keep = torch.isfinite(ref) & (ref.abs() < max_magnitude) & torch.isfinite(scale)
        got = torch.where(keep, out.to(torch.float64), ref)
        assert out.dtype == node.dtype.torch, f"{where}: dtype {out.dtype}, declared {node.dtype}"
        rtol, atol = DTYPE_TOLERANCE[node.dtype.name]
        assert_same_floats(got, ref, rtol, atol, scale=torch.where(keep, scale, 0.0),
                           what=where)
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
    "sigmoid": lambda g, x: g.sigmoid(x),
    "relu": lambda g, x: g.relu(x),
    "square": lambda g, x: g.square(x),
    "clamp": lambda g, x: g.clamp(x, -0.5, 0.75),
    "clamp_min": lambda g, x: g.clamp(x, min_val=0.1),
}

def _torch() -> Any:
    import torch

    return torch


#: The same unary ops as torch calls: the kit's independent oracle for ``UNARY`` (any dtype).
UNARY_TORCH: dict[str, Callable[[Any], Any]] = {
    "exp": lambda x: _torch().exp(x),
    "silu": lambda x: _torch().nn.functional.silu(x),
    "gelu": lambda x: _torch().nn.functional.gelu(x),
    "sigmoid": lambda x: _torch().sigmoid(x),
    "relu": lambda x: _torch().relu(x),
    "square": lambda x: x * x,
    "clamp": lambda x: _torch().clamp(x, -0.5, 0.75),
    "clamp_min": lambda x: _torch().clamp(x, min=0.1),
}
