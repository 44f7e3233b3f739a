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
from yirage.reference.magnitude import graph_oracle
from yirage.reference.verify import DTYPE_TOLERANCE, assert_same_floats, random_inputs  # noqa: F401 - the kit's API

#: relative tolerance alone, per output dtype (the extreme-value cases, against torch at the same dtype)
TOLERANCE = {"float64": 1e-9, "float32": 2e-4, "float16": 4e-3, "bfloat16": 2e-2, "int32": 0.0, "int64": 0.0}


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
