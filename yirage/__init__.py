"""yirage: compile tensor programs and LLM decode loops for many kinds of hardware.

Import-light on purpose: importing yirage imports neither torch nor any
backend library; backends are discovered and probed on first use.
"""

from __future__ import annotations

from typing import Any

from yirage.backend import torch_backend as _torch_backend  # noqa: F401 - registers the torch-device lowering
from yirage.backend.base import PLUGIN_API_VERSION, Availability, Backend, DeviceInfo, MemoryInfo
from yirage.backend.hookspecs import hookimpl
from yirage.backend.selection import (
    BackendType,
    get_available_backends,
    get_backend,
    get_backend_info,
    get_memory_info,
    is_backend_available,
    last_auto_report,
    reset_backend,
    set_backend,
)
from yirage.bench import benchmark_backends
from yirage.engine import GenerationConfig, GenerationResult, InferEngine
from yirage.errors import (
    BackendError,
    BackendUnavailableError,
    DeviceMemoryError,
    NotSupportedError,
    PluginAPIVersionError,
    PluginError,
    UnknownBackendError,
    YirageError,
)
from yirage.graph.dtypes import bfloat16, float16, float32, float64, int32, int64
from yirage.graph.kernel_graph import KernelGraph, Tensor
from yirage.graph.ops import GraphError
from yirage.log import configure_from_environment as _configure_logging
from yirage.persistent.kernel import PersistentKernel
from yirage.quant import QuantizedTensor, quantize
from yirage.reference import backend as _reference_backend  # noqa: F401 - registers the built-in oracle plugin
from yirage.reference.graph import run_reference
from yirage.runtime.graphs import new_kernel_graph  # also installs the compiler behind g.compile() and g(...)
from yirage.superopt import superoptimize as _superoptimize  # noqa: F401 - installs g.superoptimize()

__version__ = "0.1.0"

__all__ = [
    "PLUGIN_API_VERSION",
    "FusedInferEngine",
    "Availability",
    "Backend",
    "BackendError",
    "BackendType",
    "BackendUnavailableError",
    "DeviceInfo",
    "DeviceMemoryError",
    "MemoryInfo",
    "NotSupportedError",
    "PluginAPIVersionError",
    "PluginError",
    "UnknownBackendError",
    "YirageError",
    "GraphError",
    "GenerationConfig",
    "GenerationResult",
    "InferEngine",
    "KernelGraph",
    "PersistentKernel",
    "auto_configure_backend",
    "BackendOptimizer",
    "benchmark_backends",
    "QuantizedTensor",
    "Tensor",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int32",
    "int64",
    "new_kernel_graph",
    "quantize",
    "run_reference",
    "get_available_backends",
    "get_backend",
    "get_backend_info",
    "get_memory_info",
    "hookimpl",
    "is_backend_available",
    "last_auto_report",
    "reset_backend",
    "set_backend",
]

_configure_logging()


#: exports imported on first use (their modules import the model code; ``import yirage`` stays quick)
_LAZY = {"auto_configure_backend": "yirage.autoconfig_sweep", "BackendOptimizer": "yirage.autoconfig_sweep",
         "FusedInferEngine": "yirage.replay"}


def __getattr__(name: str) -> Any:
    """Lazy exports (_LAZY); other missing names: Mirage APIs yirage lacks say what to use instead."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from yirage.graph.compat import module_attribute_error

    raise module_attribute_error(__name__, name, __all__)
