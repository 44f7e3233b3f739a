"""Executable: a kernel graph compiled for one backend, with checked inputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from yirage.backend.base import Backend
from yirage.compiler.kernel_ir import KernelPlan
from yirage.compiler.lower import build_plan
from yirage.errors import YirageError
from yirage.graph.kernel_graph import KernelGraph, contiguous_strides

logger = logging.getLogger("yirage.runtime")


class InputError(YirageError, ValueError):
    """A tensor passed to a compiled graph that does not match its declaration."""


class Executable:
    """Call with a list of torch tensors (one per graph input); returns the outputs."""

    def __init__(self, graph: KernelGraph, plan: KernelPlan, backend: Backend,
                 run: Callable[[Sequence[Any]], list[Any]], compile_seconds: float) -> None:
        self.graph = graph
        self.plan = plan
        self.backend = backend
        self.compile_seconds = compile_seconds
        self._run = run
        self._device = backend.torch_device
        self._checks = []
        self._fast = []
        for index, node in enumerate(graph.inputs):
            big = tuple(i for i, d in enumerate(node.dims) if d > 1)
            strides = node.strides or contiguous_strides(node.dims)
            self._checks.append((index, node.label, node.dims, node.dtype.torch, node.dtype.name,
                                 big, tuple(strides[i] for i in big)))
            contiguous = tuple(strides[i] for i in big) == tuple(contiguous_strides(node.dims)[i] for i in big)
            self._fast.append((node.dtype.torch, node.dims, contiguous, big, tuple(strides[i] for i in big)))
        self._count = len(self._fast)
        self._on_cpu = self._device == "cpu"

    def _fast_ok(self, inputs: Sequence[Any]) -> bool:
        """The common case in a few attribute reads; any doubt goes to ``check``."""
        import torch

        if type(inputs) not in (list, tuple) or len(inputs) != self._count:
            return False
        tensor, strided = torch.Tensor, torch.strided
        for t, (dtype, dims, contiguous, big, strides) in zip(inputs, self._fast, strict=True):
            if not isinstance(t, tensor) or t.layout is not strided or t.dtype is not dtype or t.shape != dims:
                return False
            if t.requires_grad:
                return False
            if contiguous:
                if not t.is_contiguous():
                    return False
            elif tuple(t.stride()[i] for i in big) != strides:
                return False
            if (not t.is_cpu) if self._on_cpu else t.device.type != self._device:
                return False
        return True

    def check(self, inputs: Sequence[Any]) -> None:
        import torch

        if not isinstance(inputs, (list, tuple)):
            raise InputError(f"inputs must be a list of torch tensors, got {type(inputs).__name__}")
        if len(inputs) != len(self._checks):
            raise InputError(
                f"the graph has {len(self._checks)} input(s) but {len(inputs)} tensor(s) were passed; "
                "pass one tensor per g.new_input(...), in declaration order"
            )
        for (index, label, dims, dtype, dtype_name, big, strides), t in zip(self._checks, inputs, strict=True):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {index} ({label}) must be a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:
                raise InputError(f"input {index} ({label}) has layout {t.layout}; pass a dense tensor "
                                 "(e.g. t.to_dense())")
            if t.dtype != dtype:
                raise InputError(
                    f"input {index} ({label}) has dtype {t.dtype}, but the graph declares {dtype_name}; "
                    f"pass t.to(torch.{dtype_name})"
                )
            if tuple(t.shape) != dims:
                raise InputError(f"input {index} ({label}) has shape {tuple(t.shape)}, but the graph declares {dims}")
            got = t.stride()
            if tuple(got[i] for i in big) != strides:
                raise InputError(
                    f"input {index} ({label}) has strides {got}, but the graph declares "
                    f"{self.graph.inputs[index].strides}; pass t.contiguous() (or a tensor laid out as declared), "
                    "or declare its layout with new_input(..., strides=...)"
                )
            if t.device.type != self._device:
                raise InputError(
                    f"input {index} ({label}) is on device {t.device}, but backend {self.backend.name!r} "
                    f"reads {self._device} tensors; pass t.to({self._device!r})"
                )

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        if not self._fast_ok(inputs):
            self.check(inputs)  # raises with the precise cause
            inputs = [t.detach() for t in inputs]  # compiled code reads values; autograd does not flow
        return self._run(inputs)

    def __repr__(self) -> str:
        return f"<Executable {self.plan.digest[:12]} on {self.backend.name}: {len(self.plan.kernels)} kernel(s)>"


def compile_graph(graph: KernelGraph, backend: Any = None) -> Executable:
    """Compile once per (backend, graph content); later calls reuse the executable."""
    from yirage.backend.selection import current_backend, resolve

    chosen = current_backend() if backend is None else resolve(backend)
    key = (chosen.name, graph.digest)
    cached = graph._executables.get(key)
    if cached is not None:
        return cached
    started = time.perf_counter()
    plan = build_plan(graph)
    run = chosen.compile(plan, graph)
    seconds = time.perf_counter() - started
    logger.info("compiled graph %s for %s in %.3f s (%d kernels)", graph.digest[:12], chosen.name, seconds,
                len(plan.kernels))
    exe = Executable(graph, plan, chosen, run, seconds)
    graph._executables[key] = exe
    return exe
