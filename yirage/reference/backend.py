"""The reference backend: torch eager on the CPU, the oracle for every test.

It lives in the core, in one package with the graph runner and the
PersistentKernel runtime it runs, is always registered (even with plugin
autoload off) and is always available where torch is.
"""

from __future__ import annotations

import sys
from typing import Any

from yirage.backend.base import Availability, Backend, DeviceInfo, MemoryInfo
from yirage.backend.hookspecs import hookimpl
from yirage.backend.host import host_device_info, host_memory_info
from yirage.backend.plugins import install_core_plugin
from yirage.backend.probes import distribution_version, module_installed
from yirage.backend.runtime_contract import SERIAL, PersistentRuntime
from yirage.reference import eager as _eager  # noqa: F401 - installs the runtime of PersistentKernel's eager_start

YIRAGE_PLUGIN_API = 1


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    vendor = "PyTorch"
    torch_device = "cpu"
    device_kind = "cpu"
    description = "torch eager on the CPU, op by op; the golden result"

    def probe(self) -> Availability:
        if not module_installed("torch"):
            return Availability(False, "torch is not installed: pip install 'torch==2.13.0'")
        return Availability(True, f"torch {distribution_version('torch')} eager on the host CPU", auto=True)

    def device_info(self, index: int = 0) -> DeviceInfo:
        return host_device_info(torch=distribution_version("torch"))

    def memory_info(self, index: int = 0) -> MemoryInfo:
        return host_memory_info()

    kernel_dtypes = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64"})
    persistent_weight_formats = frozenset({"float32", "bfloat16", "float16", "q8_0", "q4_0"})

    persistent_kind = SERIAL  # the oracle: one task at a time

    def persistent_runtime(self, program: Any, config: Any) -> PersistentRuntime:
        from yirage.reference.persistent import ReferenceRuntime

        return ReferenceRuntime(program, config)

    def default_config(self, device: DeviceInfo) -> dict[str, int]:
        return {"num_workers": 1, "num_local_schedulers": 1}  # it runs one task at a time

    def compile(self, plan: Any, graph: Any) -> Any:
        from yirage.reference.graph import run_reference

        def run(inputs: Any) -> list[Any]:
            return run_reference(graph, inputs)

        return run


@hookimpl
def yirage_backends() -> list[type[Backend]]:
    return [ReferenceBackend]


install_core_plugin(sys.modules[__name__], "reference")
