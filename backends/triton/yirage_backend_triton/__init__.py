"""The Triton backend: yirage's Triton renderer on a CUDA/ROCm GPU, or in Triton's interpreter.

With ``TRITON_INTERPRET=1`` Triton runs every kernel in its interpreter
(numpy, one program at a time) on torch CPU tensors: slow, but it executes
the very source a GPU would compile, so the conformance kit verifies the
renderer on a machine without a GPU. ``auto`` never picks that mode. Without
it the backend needs a GPU torch can see (CUDA, or ROCm through torch.cuda).
Only ``probe`` and the compile stages import triton or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

import yirage
from yirage.backend.host import host_device_info, host_memory_info
from yirage.backend.probes import distribution_version, module_installed
from yirage.backend.runtime_contract import LAUNCHED, PersistentRuntime
from yirage.backend.triton_stages import TRITON_DTYPES, TritonStages, interpreting

YIRAGE_PLUGIN_API = 1

HOW = ("run on a CUDA/ROCm GPU that torch sees, or set TRITON_INTERPRET=1 to run Triton's interpreter on CPU "
       "tensors (for verification: slow)")


class TritonBackend(TritonStages, yirage.Backend):
    name = "triton"
    # above cpu and opencl: on a ROCm GPU (no cuda backend) a GPU backend with a PersistentKernel runtime must win
    # auto; below cuda (100), which leads on NVIDIA GPUs. The interpreter mode is never auto (its probe says so)
    priority = 60
    vendor = "OpenAI Triton"
    description = "Triton kernels from yirage's Triton renderer (GPU, or Triton's interpreter on CPU tensors)"
    kernel_dtypes = TRITON_DTYPES

    @property
    def torch_device(self) -> str:  # type: ignore[override]
        """Where tensors live: the interpreter runs on CPU tensors, Triton's GPU backends on torch.cuda's."""
        return "cpu" if interpreting() else "cuda"

    @property
    def device_kind(self) -> str:  # type: ignore[override]
        return "cpu" if interpreting() else "gpu"

    def probe(self) -> yirage.Availability:
        if not module_installed("triton"):
            return yirage.Availability(
                False, "triton is not installed: pip install 'yirage-backend-triton[triton]' (Triton 3.0-3.5); "
                f"then {HOW}")
        if not interpreting():
            torch = importlib.import_module("torch")
            if not torch.cuda.is_available():
                return yirage.Availability(False, f"torch sees no CUDA/ROCm GPU (torch {torch.__version__}); {HOW}")
        try:
            triton = importlib.import_module("triton")
        except ImportError as exc:
            return yirage.Availability(False, f"triton is installed but does not import: {exc}")
        if interpreting():
            standard = importlib.import_module("triton.language.standard")
            if type(standard.sum).__name__ != "InterpretedFunction":
                return yirage.Availability(
                    False, "TRITON_INTERPRET=1 was set after triton was imported in this process, so Triton's own "
                    "library functions were compiled for a GPU; set it in the environment before Python starts")
            return yirage.Availability(
                True, f"Triton {triton.__version__}'s interpreter on CPU tensors (TRITON_INTERPRET=1): runs the "
                "rendered kernels with numpy to verify them, slowly; auto passes over it", auto=False)
        torch = importlib.import_module("torch")
        return yirage.Availability(True, f"Triton {triton.__version__} on {torch.cuda.get_device_name(0)}")

    def device_count(self) -> int:
        if not self.availability().ok:
            return 0
        return 1 if interpreting() else int(importlib.import_module("torch").cuda.device_count())

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        self.require_available()
        if interpreting():
            return host_device_info(triton=distribution_version("triton"), triton_mode="interpreter")
        torch = importlib.import_module("torch")
        props = torch.cuda.get_device_properties(index)
        return yirage.DeviceInfo(
            name=props.name, vendor="AMD" if torch.version.hip else "NVIDIA", kind="gpu",
            compute_units=props.multi_processor_count, memory_bytes=props.total_memory,
            simd_width=getattr(props, "warp_size", 32),
            extra={"triton": distribution_version("triton"), "target": self.triton_device_target()})

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        self.require_available()
        if interpreting():
            return host_memory_info()
        free, total = importlib.import_module("torch").cuda.mem_get_info(index)
        return yirage.MemoryInfo(total, total - free, free, "torch.cuda.mem_get_info")

    persistent_kind = LAUNCHED  # yirage.persistent.launched

    def persistent_runtime(self, program: Any, config: Any) -> PersistentRuntime:
        """Each decode step as launched Triton task kernels (yirage.persistent.launched: why not persistent)."""
        from yirage.persistent.launched import LaunchedRuntime

        device = program.tokens.device
        processors = 0
        if device.type == "cuda":  # SMs size the GEMV's programs; the interpreter (CPU tensors) keeps fixed blocks
            processors = importlib.import_module("torch").cuda.get_device_properties(device).multi_processor_count
        return LaunchedRuntime(program, config, processors)

    def default_config(self, device: yirage.DeviceInfo) -> dict[str, int]:
        return {"num_workers": 1, "num_local_schedulers": 0}  # launches run in order on one stream


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [TritonBackend]
