"""KernelGraph: a small tensor program built op by op, Mirage-style.

Every op checks its operands when it is added, so a wrong shape fails on the
line that wrote it. A graph prints readably, hashes stably and round-trips
through JSON; calling it compiles it for its backend (once) and runs it.

This module is pure IR: it imports nothing above the graph layer. Compiling
is done by the runtime layer, which installs its compiler here when it is
imported (``import yirage`` does), and caches executables outside the graph.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from yirage.graph.dtypes import DType, as_dtype, float32
from yirage.graph.ops import OPS, GraphError, Operand, as_number, check_dims, check_numel
from yirage.graph.serialize import FORMAT_VERSION, check_document, check_node, read_source

#: The runtime's ``compile_graph(graph, backend)``; the graph layer cannot import it (layering is one-way).
_compiler: Callable[[KernelGraph, Any], Any] | None = None


_superoptimizer: Callable[..., Any] | None = None


def install_superoptimizer(superoptimize: Callable[..., Any]) -> None:
    """Set what ``KernelGraph.superoptimize`` calls (``yirage.superopt`` installs itself: it sits layers above)."""
    global _superoptimizer
    if not callable(superoptimize):
        raise TypeError(f"install_superoptimizer needs a function, got {superoptimize!r}")
    _superoptimizer = superoptimize


def install_compiler(compile_graph: Callable[[KernelGraph, Any], Any]) -> None:
    """Let ``g.compile()``/``g(...)`` reach the runtime layer, which calls this when it is imported."""
    global _compiler
    if not callable(compile_graph):
        raise TypeError(f"install_compiler needs a compile_graph(graph, backend) function, got {compile_graph!r}")
    _compiler = compile_graph


@dataclass(frozen=True)
class Node:
    """One tensor of the graph and the op that makes it."""

    id: int
    op: str  # "input" or a key of OPS
    inputs: tuple[int, ...]
    attrs: dict[str, Any]
    dims: tuple[int, ...]
    dtype: DType
    strides: tuple[int, ...] | None = None  # inputs only: the memory layout callers pass
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or f"t{self.id}"

    def operand(self) -> Operand:
        return Operand(self.label, self.dims, self.dtype)


def contiguous_strides(dims: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(dims):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def check_dense_strides(dims: tuple[int, ...], strides: Any) -> tuple[int, ...]:
    """Strides must describe a dense layout: a permutation of contiguous dims."""
    try:
        if isinstance(strides, (str, bytes)) or any(isinstance(s, bool) or not hasattr(s, "__index__")
                                                    for s in strides):
            raise TypeError
        out = tuple(int(s) for s in strides)
    except TypeError:
        raise GraphError(f"strides must be a sequence of ints, got {strides!r}") from None
    if len(out) != len(dims):
        raise GraphError(f"strides {out} must have one entry per dim of {dims}")
    big = sorted((s, d) for s, d in zip(out, dims, strict=True) if d > 1)
    expected = 1
    for s, d in big:
        if s != expected:
            raise GraphError(
                f"strides {out} for dims {dims} do not describe a dense layout "
                "(a permutation of the dims, stored without gaps), which is all yirage reads; "
                "pass a .contiguous() tensor, or a transpose of one, and declare its strides"
            )
        expected *= d
    return out


class Tensor:
    """A handle on one node of a KernelGraph; arithmetic operators add ops."""

    __slots__ = ("graph", "id")

    def __init__(self, graph: KernelGraph, node_id: int) -> None:
        self.graph = graph
        self.id = node_id

    @property
    def node(self) -> Node:
        return self.graph.nodes[self.id]

    @property
    def dims(self) -> tuple[int, ...]:
        return self.node.dims

    shape = dims

    @property
    def dtype(self) -> DType:
        return self.node.dtype

    @property
    def num_dims(self) -> int:
        return len(self.node.dims)

    def dim(self, index: int) -> int:
        return self.node.dims[index]

    def __add__(self, other: Tensor) -> Tensor:
        return self.graph.add(self, other)

    def __sub__(self, other: Tensor) -> Tensor:
        return self.graph.sub(self, other)

    def __mul__(self, other: Tensor) -> Tensor:
        return self.graph.mul(self, other)

    def __truediv__(self, other: Tensor) -> Tensor:
        return self.graph.div(self, other)

    def __pow__(self, other: Tensor) -> Tensor:
        return self.graph.pow(self, other)

    def __matmul__(self, other: Tensor) -> Tensor:
        return self.graph.matmul(self, other)

    def __repr__(self) -> str:
        node = self.node
        return f"<Tensor {node.label} = {node.op} {node.dims} {node.dtype}>"


@dataclass
class KernelGraph:
    """A tensor program: inputs, ops, marked outputs; see ``yr.new_kernel_graph``."""

    backend: str | None = None
    nodes: list[Node] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    _digest: str | None = field(default=None, repr=False, compare=False)

    # -- building ----------------------------------------------------------
    def new_input(
        self, dims: Sequence[int], strides: Sequence[int] | None = None, dtype: Any = float32, name: str = ""
    ) -> Tensor:
        """A graph input; ``strides`` declares a dense non-contiguous layout (e.g. a transposed weight)."""
        dims_t = check_dims(dims)
        dtype = as_dtype(dtype)
        if not isinstance(name, str):
            raise GraphError(f"new_input: name must be a str, got {type(name).__name__} {name!r}")
        strides_t = check_dense_strides(dims_t, strides) if strides is not None else contiguous_strides(dims_t)
        return self._append("input", (), {}, dims_t, dtype, strides_t, name)

    def mark_output(self, t: Tensor, strides: Sequence[int] | None = None) -> None:
        self._own(t, "mark_output")
        if strides is not None and tuple(strides) != contiguous_strides(t.dims):
            raise GraphError(f"mark_output({t.node.label}): yirage writes contiguous outputs; omit strides")
        if t.id in self.outputs:
            raise GraphError(f"mark_output({t.node.label}): this tensor is already an output")
        self.outputs.append(t.id)
        self._changed()

    def matmul(self, a: Tensor, b: Tensor) -> Tensor: return self._op("matmul", a, b)
    def reduction(self, t: Tensor, dim: int) -> Tensor: return self._op("reduction", t, dim=dim)
    def exp(self, t: Tensor) -> Tensor: return self._op("exp", t)
    def silu(self, t: Tensor) -> Tensor: return self._op("silu", t)
    def gelu(self, t: Tensor) -> Tensor: return self._op("gelu", t)
    def sigmoid(self, t: Tensor) -> Tensor: return self._op("sigmoid", t)
    def relu(self, t: Tensor) -> Tensor: return self._op("relu", t)
    def sqrt(self, t: Tensor) -> Tensor: return self._op("sqrt", t)
    def square(self, t: Tensor) -> Tensor: return self._op("square", t)
    def add(self, a: Tensor, b: Tensor) -> Tensor: return self._op("add", a, b)
    def sub(self, a: Tensor, b: Tensor) -> Tensor: return self._op("sub", a, b)
    def mul(self, a: Tensor, b: Tensor) -> Tensor: return self._op("mul", a, b)
    def div(self, a: Tensor, b: Tensor) -> Tensor: return self._op("div", a, b)
    def pow(self, a: Tensor, b: Tensor) -> Tensor: return self._op("pow", a, b)
    def softmax(self, t: Tensor, dim: int = -1) -> Tensor: return self._op("softmax", t, dim=dim)
    def embedding(self, ids: Tensor, table: Tensor) -> Tensor: return self._op("embedding", ids, table)
    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor: return self._op("rotary", x, cos, sin)

    def clamp(self, t: Tensor, min_val: float | None = None, max_val: float | None = None) -> Tensor:
        lo, hi = as_number("clamp", "min_val", min_val), as_number("clamp", "max_val", max_val)
        return self._op("clamp", t, min_val=lo, max_val=hi)

    def rms_norm(self, t: Tensor, normalized_shape: Sequence[int], eps: float = 1e-6) -> Tensor:
        """x / sqrt(mean(x^2) + eps) over the last dim (no weight: multiply by one with ``mul``)."""
        return self._op("rms_norm", t, normalized_shape=list(check_dims(normalized_shape, "normalized_shape")),
                        eps=as_number("rms_norm", "eps", eps))

    def attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor | None = None, scale: float | None = None
    ) -> Tensor:
        """Decode attention of one query per head over a KV cache (GQA when H_kv < H)."""
        operands = (q, k_cache, v_cache) if lengths is None else (q, k_cache, v_cache, lengths)
        return self._op("attention", *operands, scale=as_number("attention", "scale", scale))

    def _own(self, t: Any, op: str) -> None:
        if not isinstance(t, Tensor):
            raise GraphError(f"{op}: expected a yirage Tensor of this graph, got {type(t).__name__}")
        if t.graph is not self:
            raise GraphError(f"{op}: {t.node.label} belongs to another KernelGraph")

    def _op(self, op: str, *operands: Tensor, **attrs: Any) -> Tensor:
        for t in operands:
            self._own(t, op)
        spec = OPS[op]
        dims, dtype = spec.infer([t.node.operand() for t in operands], attrs)
        return self._append(op, tuple(t.id for t in operands), attrs, dims, dtype, None, "")

    def _append(self, op: str, inputs: tuple[int, ...], attrs: dict[str, Any], dims: tuple[int, ...],
                dtype: DType, strides: tuple[int, ...] | None, name: str) -> Tensor:
        if name and any(n.name == name for n in self.nodes):
            raise GraphError(f"a tensor named {name!r} already exists in this graph")
        check_numel(dims, f"{op} {name or f't{len(self.nodes)}'}")
        attrs = dict(sorted(attrs.items()))  # canonical: printing and JSON agree after a round trip
        self.nodes.append(Node(len(self.nodes), op, inputs, attrs, dims, dtype, strides, name))
        self._changed()
        return Tensor(self, len(self.nodes) - 1)

    def _changed(self) -> None:
        self._digest = None  # compiled executables are cached by digest, so this also retires them

    # -- views ---------------------------------------------------------------
    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "input"]

    @property
    def output_nodes(self) -> list[Node]:
        return [self.nodes[i] for i in self.outputs]

    def consumers(self) -> dict[int, list[int]]:
        users: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                users[i].append(n.id)
        return users

    def __str__(self) -> str:
        lines = [f"KernelGraph(backend={self.backend or 'default'})"]
        for n in self.nodes:
            if n.op == "input":
                layout = "" if n.strides == contiguous_strides(n.dims) else f", strides={n.strides}"
                lines.append(f"  {n.label} = input(dims={n.dims}, dtype={n.dtype}{layout})")
                continue
            args = [self.nodes[i].label for i in n.inputs]
            args += [f"{k}={v}" for k, v in n.attrs.items() if v is not None]
            lines.append(f"  {n.label} = {n.op}({', '.join(args)})  # {n.dims} {n.dtype}")
        lines.append(f"  outputs: {', '.join(self.nodes[i].label for i in self.outputs) or '(none)'}")
        return "\n".join(lines)

    def copy(self) -> KernelGraph:
        """An independent graph with the same program; adding ops to either leaves the other as it was."""
        return KernelGraph(backend=self.backend, nodes=list(self.nodes), outputs=list(self.outputs))

    # -- identity ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "nodes": [
                {"op": n.op, "inputs": list(n.inputs), "attrs": n.attrs, "dims": list(n.dims),
                 "dtype": n.dtype.name, **({"strides": list(n.strides)} if n.strides else {}),
                 **({"name": n.name} if n.name else {})}
                for n in self.nodes
            ],
            "outputs": list(self.outputs),
        }

    def to_json(self, path: str | os.PathLike[str] | int | None = None, indent: int | None = None) -> str:
        """The graph as JSON text; given a path (Mirage's ``g.to_json("graph.json")``) also write it there.

        ``g.to_json(2)`` still means indent=2 (an int is never a path).
        """
        if isinstance(path, int) and not isinstance(path, bool):
            if indent is not None:
                raise GraphError(f"to_json({path}, indent={indent!r}): indent given twice; pass one of them")
            path, indent = None, path
        if indent is not None and (isinstance(indent, bool) or not isinstance(indent, int) or indent < 0):
            raise GraphError(
                f"to_json: indent must be a non-negative int or None, got {indent!r}; "
                "to write a file pass its path: g.to_json('graph.json')"
            )
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise GraphError(f"to_json: path must be a str or os.PathLike (a file to write), got {path!r}")
        text = json.dumps(self.to_dict(), indent=indent, sort_keys=True)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    @property
    def digest(self) -> str:
        """Content hash of the program (ops, dims, dtypes, layouts); not of the backend."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.to_json().encode()).hexdigest()
        return self._digest

    def __hash__(self) -> int:
        return int(self.digest[:16], 16)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KernelGraph) and self.to_json() == other.to_json()

    @classmethod
    def from_json(cls, source: str | os.PathLike[str] | bytes | dict[str, Any], backend: str | None = None
                  ) -> KernelGraph:
        """Rebuild a graph from JSON text, a file path or a dict, re-validating every op as it is added.

        A str that starts with '{' is JSON text, any other str (or a pathlib.Path) names a file.
        Anything malformed raises GraphError saying what is wrong.
        """
        nodes, outputs = check_document(read_source(source))
        g = cls(backend=backend)
        for i, node in enumerate(nodes):
            raw = check_node(i, node)
            if raw["op"] == "input":
                t = g.new_input(raw["dims"], raw.get("strides"), raw["dtype"], raw.get("name", ""))
            else:
                t = g._op(raw["op"], *(Tensor(g, j) for j in raw["inputs"]), **raw["attrs"])
            if list(t.dims) != raw["dims"] or t.dtype.name != raw["dtype"]:
                raise GraphError(f"node {i}: recorded dims/dtype {raw['dims']} {raw['dtype']} disagree with the op")
        for out in outputs:
            if isinstance(out, bool) or not isinstance(out, int) or not 0 <= out < len(g.nodes):
                raise GraphError(f"output {out!r} does not name a node (there are {len(g.nodes)})")
            g.mark_output(Tensor(g, out))
        return g

    # -- running -------------------------------------------------------------
    def compile(self, backend: Any = None) -> Any:
        """Fuse, generate and build for ``backend`` (else the graph's, else the default); cached per graph."""
        if _compiler is None:
            from yirage.errors import YirageError

            raise YirageError("KernelGraph.compile needs yirage's runtime layer, which installs the compiler when "
                              "it is imported: import yirage (or yirage.runtime.graphs) before compiling a graph")
        return _compiler(self, backend if backend is not None else self.backend)

    def run(self, inputs: Sequence[Any], backend: Any = None) -> list[Any]:
        return self.compile(backend)(inputs)

    def superoptimize(self, config: str | None = None, backend: Any = None, *, warmup_iters: int = 3,
                      profile_iters: int = 10, time_budget_s: float = 60.0, use_cached_graphs: bool = True,
                      **options: Any) -> Any:
        """Mirage's search: every fusion plan of this graph compiled on ``backend``, checked against a float64
        oracle, timed on the device; returns the fastest verified one as a callable graph with a ``.report``
        (yirage.superopt says how). The winner is cached: a second process does not search again."""
        if _superoptimizer is None:
            from yirage.errors import YirageError

            raise YirageError("KernelGraph.superoptimize needs yirage.superopt, which installs the search when it is "
                              "imported: import yirage before superoptimizing a graph")
        return _superoptimizer(self, config=config, backend=backend if backend is not None else self.backend,
                             warmup_iters=warmup_iters, profile_iters=profile_iters, time_budget_s=time_budget_s,
                             use_cached_graphs=use_cached_graphs, **options)

    def __call__(self, inputs: Sequence[Any] | None = None, *, outputs: Sequence[Tensor] | None = None,
                 backend: Any = None, stream: Any = None) -> list[Any]:
        """Compile (once) and run; Mirage's ``g(inputs=[...], outputs=[O])`` picks marked outputs to return.

        ``stream`` (Mirage's CUDA stream) must be None: yirage launches on the backend's default stream,
        and silently ignoring a stream would break the caller's ordering.
        """
        if inputs is None:
            raise TypeError("call a KernelGraph as g(inputs=[tensor, ...]) with one torch tensor per input")
        if stream is not None:
            from yirage.errors import NotSupportedError

            raise NotSupportedError("g(..., stream=...) is not supported yet: yirage launches on the backend's "
                                    "default stream; drop stream= (synchronize your own stream first, e.g. "
                                    "stream.synchronize()) or leave it None")
        picks = None if outputs is None else self._output_positions(outputs)
        results = self.run(inputs, backend)
        return results if picks is None else [results[k] for k in picks]

    def _output_positions(self, outputs: Any) -> list[int]:
        """Where each tensor of ``outputs=`` sits among the marked outputs; only those can be returned."""
        if not isinstance(outputs, (list, tuple)):
            raise GraphError(f"outputs= must be a list of tensors of this graph, got {type(outputs).__name__}")
        positions = []
        for t in outputs:
            self._own(t, "outputs=")
            if t.id not in self.outputs:
                raise GraphError(
                    f"outputs=: {t.node.label} is not a marked output of this graph (marked: "
                    f"{', '.join(self.nodes[i].label for i in self.outputs) or 'none'}); "
                    f"call g.mark_output({t.node.label}) before running, or leave outputs= out to get every one"
                )
            positions.append(self.outputs.index(t.id))
        return positions

    def __getattr__(self, name: str) -> Any:
        """Only reached for missing names: Mirage APIs yirage lacks say what to use instead."""
        if name.startswith("_"):
            raise AttributeError(name)
        from yirage.graph.compat import graph_attribute_error

        raise graph_attribute_error(self, name)
