"""Shared probe for accelerators with their own torch adapter package (Ascend, Cambricon, Moore Threads)."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import yirage
from yirage.backend.probes import module_installed
from yirage_backend_domestic._kernels import DomesticKernels


class TorchAdapterBackend(DomesticKernels):
    """A device reached as ``torch.<torch_device>`` once ``adapter`` is imported; kernels: see ``_kernels``."""

    device_kind = "npu"
    adapter: ClassVar[str] = ""  # e.g. "torch_npu"
    stack: ClassVar[str] = ""  # what else must be installed, for the reason text

    def _module(self) -> Any:
        import torch

        importlib.import_module(self.adapter)
        return getattr(torch, self.torch_device)

    def probe(self) -> yirage.Availability:
        if not module_installed("torch"):
            return yirage.Availability(False, "torch is not installed")
        if not module_installed(self.adapter):
            return yirage.Availability(
                False, f"{self.adapter} is not installed; the {self.vendor} backend needs {self.stack}"
            )
        try:
            device = self._module()
        except (ImportError, OSError, RuntimeError) as exc:
            return yirage.Availability(False, f"{self.adapter} is installed but does not load: {exc}")
        if device is None or not device.is_available():
            return yirage.Availability(False, f"{self.adapter} loads but reports no {self.vendor} device")
        count = device.device_count()
        note = self.kernels_note(self.settle_path())
        return yirage.Availability(True, f"{device.get_device_name(0)} ({count} device(s)) via {self.adapter}; {note}")

    def present(self) -> str:
        return f"{self.adapter} is present"

    def device_count(self) -> int:
        return self._module().device_count() if self.availability().ok else 0

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        self.require_available()
        props = self._module().get_device_properties(index)
        return yirage.DeviceInfo(
            name=str(getattr(props, "name", self._module().get_device_name(index))),
            vendor=self.vendor,
            kind=self.device_kind,
            compute_units=getattr(props, "multi_processor_count", None) or getattr(props, "cube_core_num", None),
            memory_bytes=getattr(props, "total_memory", None),
        )

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        self.require_available()
        free, total = self._module().mem_get_info(index)
        return yirage.MemoryInfo(int(total), int(total - free), int(free), f"torch.{self.torch_device}.mem_get_info")
