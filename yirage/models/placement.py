"""Where a model's tensors live: decided once, from the backend that will read them.

Why one record: weights, KV caches, RoPE tables, tokens, step and the prefill
must all be on the device the backend computes on (a CUDA backend reads CUDA
tensors; a tensor left on the CPU is an error at the first launch, or a copy
per step). Every allocation of the LLM path takes its device from a
``Placement``; nothing there names "cpu" except ``Placement.host()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _host_free() -> int | None:
    import psutil

    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class Placement:
    """A torch device and how to ask how many bytes are free on it now (None: it cannot tell)."""

    device: Any  # a torch.device
    free_bytes: Callable[[], int | None]
    where: str = "memory"  # how messages name that memory ("memory", "cuda memory (NVIDIA H100)")

    @classmethod
    def host(cls) -> Placement:
        """The CPU and its available RAM: models loaded without a backend (tools, tests, the oracle)."""
        import torch

        return cls(torch.device("cpu"), _host_free)

    @classmethod
    def of_backend(cls, backend: Any, local_index: int | None = None) -> Placement:
        """The backend's torch device (``Backend.torch_device``) and its ``memory_info().free``.

        ``local_index``: for one rank of a multi-rank run, the device index of this rank on its machine (its
        LOCAL_RANK); ignored for the CPU and where the backend names an index itself.
        """
        import torch

        from yirage.backend.base import checked_memory_info

        device = torch.device(backend.torch_device)
        if device.type != "cpu" and device.index is None and local_index is not None:
            device = torch.device(device.type, local_index)
        if device.type == "cpu":
            return cls(device, _host_free)

        def free() -> int | None:
            return checked_memory_info(backend, device.index or 0).free

        return cls(device, free, f"{backend.name} device memory")

    def check_fits(self, nbytes: int, what: str, fix: str, extra: int = 0) -> None:
        """Raise ModelError before allocating ``nbytes`` for ``what`` (and ``extra`` bytes beside it, not named in the
        message) when less is free; ``fix`` says what to do."""
        from yirage.models.config import ModelError

        free = self.free_bytes()
        if free is not None and nbytes + extra > free:
            raise ModelError(f"{what} would need {nbytes / 2**30:.3g} GB on {self.device}, but only "
                             f"{free / 2**30:.3g} GB of {self.where} is available; {fix}")
