"""Mirage names that yirage does not provide, each with what to use instead.

Code ported from Mirage calls these; a bare AttributeError would leave the
user guessing whether yirage is broken or the call is spelled differently.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from yirage.errors import UnsupportedAPIError

_RUN = "build the computation with kernel-graph ops and call g(inputs=[...]) (or g.compile() to compile ahead)"

#: ``KNGraph`` methods of Mirage (python/mirage/kernel.py) that a KernelGraph does not have.
GRAPH_HINTS: dict[str, str] = {
    "customized": "yirage has no hand-written threadblock graphs; it generates fused kernels from the ops: " + _RUN,
    "visualize": "print(g) shows every op with its dims and dtype; g.to_json('graph.json') saves the graph",
    "cuda_call": "call g(inputs=[...]); pick the device with yr.new_kernel_graph(backend='cuda') or yr.set_backend",
    "triton_call": "call g(inputs=[...]); pick the device with yr.new_kernel_graph(backend=...) or yr.set_backend",
    "valid_kernels": "g.compile() raises a clear error when the graph cannot be compiled; there is no validity flag",
    "get_mugraph": "the KernelGraph is the program: print(g), g.to_dict() or g.to_json() show it",
    "get_graph_structure": "g.nodes lists every op (print(g) shows them); g.to_dict() gives plain data",
    "get_input_dtensors": "g.inputs lists the input nodes in declaration order",
    "get_input_dtensor_layout": "each node in g.inputs carries its .dims and .strides",
    "generate_triton_program": "yirage compiles for the selected backend itself: call g.compile(backend)",
    "cygraph": "a KernelGraph is pure Python; g.nodes, g.inputs and g.outputs describe it",
    "get_owner_independent_hash": "g.digest is a stable content hash of the graph (the same in every process)",
    "get_error_message": "yirage raises every graph or compile error as an exception when it happens "
                         "(yr.YirageError subclasses); there is no stored message to fetch",
}

#: Module-level names of Mirage (python/mirage/__init__.py) that ``yirage`` does not have.
MODULE_HINTS: dict[str, str] = {
    "new_threadblock_graph": "yirage has no hand-written threadblock graphs; it generates fused kernels from "
                             "kernel-graph ops: g = yr.new_kernel_graph(), " + _RUN,
    "superoptimize": "superoptimize is a method of the graph, as in Mirage: g = yr.new_kernel_graph(), build it, "
                     "then g.superoptimize() (searches fusion plans on the backend) or g.compile(backend)",
    "set_gpu_device_id": "choose the backend with yr.set_backend('cuda') (or new_kernel_graph(backend=...)); "
                         "yirage runs on its device 0",
    "bypass_compile_errors": "yirage raises every compile error with its cause; catch yr.YirageError to go on",
    "global_config": "backends are chosen with yr.set_backend / YIRAGE_BACKEND; see yr.get_backend_info()",
    "graph_dataset": "yirage does not search graphs, so it keeps no dataset of discovered graphs",
    "KNGraph": "yirage's kernel graph class is yr.KernelGraph; make one with yr.new_kernel_graph()",
    "TBGraph": "yirage has no hand-written threadblock graphs; it generates fused kernels from kernel-graph ops",
    "InputNotFoundError": "a wrong input raises yr.YirageError subclasses (ValueError) naming the input",
}


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, [c for c in candidates if not c.startswith("_")], n=3, cutoff=0.75)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def graph_attribute_error(obj: object, name: str) -> AttributeError:
    """The error for ``g.<name>`` when a KernelGraph has no such attribute."""
    owner = type(obj).__name__
    if name in GRAPH_HINTS:
        error = UnsupportedAPIError(
            f"{owner}.{name} (a Mirage API) is not supported by yirage yet: {GRAPH_HINTS[name]}"
        )
    else:
        error = AttributeError(f"{owner!r} object has no attribute {name!r}{_did_you_mean(name, dir(obj))}")
    error.name, error.obj = name, obj
    return error


def module_attribute_error(module: str, name: str, names: Iterable[str]) -> AttributeError:
    """The error for ``yirage.<name>`` when the package has no such attribute."""
    if name in MODULE_HINTS:
        error = UnsupportedAPIError(f"{module}.{name} (a Mirage API) is not supported by yirage yet: "
                                    f"{MODULE_HINTS[name]}")
    else:
        error = AttributeError(f"module {module!r} has no attribute {name!r}{_did_you_mean(name, names)}")
    error.name = name
    return error
