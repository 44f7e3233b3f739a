"""The MPS stages: render a plan as Metal Shading Language, write it, compile it with torch and launch it.

``render`` puts the launch header (``yirage.codegen.launch``: inputs, buffers
to allocate, kernels in order, scratch, status checks) on top of the source, so
a cache entry alone is enough to load. The Metal compiler runs inside
``torch.mps.compile_shader`` at load (once per process and entry:
``Artifact.load_once``); ``load`` keeps one kernel object per launch.

How torch binds a call (torch/csrc/mps/Module.cpp, ``_mps_MetalKernel.__call__``):
positional argument ``i`` is ``[[buffer(i)]]``; a tensor is bound with
``setBuffer`` at its storage offset (no check of dtype, shape or strides: the
core's Executable has checked them), and a call encodes one
``dispatchThreads(threads, threadsPerThreadgroup: group_size)`` on the current
MPS stream. ``dispatchThreads`` allows a non-uniform grid (a smaller last
group), which would break the row kernels' tree reductions, so every launch
passes ``threads = groups * local`` and ``group_size = local`` exactly (a
uniform grid). Calls on one stream run in order, so the launches of a plan,
and torch ops before and after them, see each other's writes; the call's
temporaries can go back to torch's allocator when it returns for the same reason.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from yirage.codegen.cstyle import render
from yirage.codegen.dialects.metal import DIALECT
from yirage.codegen.launch import C_COMMENT, Check, Launch, LaunchHeader
from yirage.compiler.cache import write_private
from yirage.compiler.kernel_ir import KernelPlan
from yirage.compiler.stages import Artifact
from yirage.errors import BackendError, NotSupportedError, YirageError

SOURCE_NAME = "kernels.metal"
MAX_BUFFERS = 31  # Metal's buffer argument table: [[buffer(0)]] .. [[buffer(30)]]
MAX_GRID = (1 << 32) - 1  # thread_position_in_grid is a uint


class MetalBuildError(BackendError, RuntimeError):
    """The Metal compiler rejected a rendered plan, or its entry is unusable: a yirage bug, not a user error."""


class LaunchArgumentError(YirageError, ValueError):
    """A tensor handed to a loaded Metal program is not on its device or not of the planned dtype."""


def check_limits(launches: Sequence[Launch]) -> None:
    """Refuse, before anything is compiled, a launch Metal cannot dispatch as rendered."""
    for x in launches:
        if len(x.args) > MAX_BUFFERS:
            raise NotSupportedError(
                f"kernel {x.kernel} takes {len(x.args)} buffers, but a Metal kernel binds at most {MAX_BUFFERS}; "
                "split the graph into smaller ones, or compile it with backend='cpu'")
        if x.global_size > MAX_GRID:
            raise NotSupportedError(
                f"kernel {x.kernel} needs {x.global_size} threads, more than Metal's 32-bit grid index "
                f"({MAX_GRID}); split the tensors, or compile the graph with backend='cpu'")


def render_source(plan: KernelPlan) -> str:
    """Stage 1: the MSL of ``plan`` behind one JSON comment line describing its launch."""
    rendered = render(plan, DIALECT)
    check_limits(rendered.launches)
    return LaunchHeader.of(plan, rendered.launches, rendered.scratch).write(rendered.source, C_COMMENT)


def build(source: str, workdir: Path) -> Path:
    """Stage 2: write the source; the Metal compiler runs in ``torch.mps.compile_shader`` at load."""
    path = workdir / SOURCE_NAME
    write_private(path, source)
    return path


def target() -> str:
    """The GPU and the macOS version: the Metal compiler and its language version come with the OS."""
    import platform

    import torch

    return f"{torch.backends.mps.get_name()}|macOS {platform.mac_ver()[0]}"


def torch_compile_shader(source: str) -> Any:
    """``torch.mps.compile_shader(source)`` after checking what torch would compile it with.

    torch compiles with fast math when ``PYTORCH_MPS_FAST_MATH`` is set (read once per
    process), which breaks the kernels' IEEE semantics (NaN-propagating max, inf); and
    ``bfloat`` needs Metal Shading Language 3.1, which needs macOS 14.
    """
    fast = os.environ.get("PYTORCH_MPS_FAST_MATH", "")
    if fast not in ("", "0"):
        raise NotSupportedError(
            f"PYTORCH_MPS_FAST_MATH={fast!r} makes torch compile Metal kernels with fast math, which drops the "
            "NaN and infinity semantics yirage's kernels promise; unset it (or set it to 0) before starting Python")
    import torch

    if "bfloat" in source and not torch.backends.mps.is_macos_or_newer(14, 0):
        raise NotSupportedError(
            "this graph has bfloat16 tensors, and Metal's bfloat type needs Metal Shading Language 3.1 "
            "(macOS 14 or newer); update macOS, or cast the tensors to float16 or float32")
    return torch.mps.compile_shader(source)


def load(artifact: Artifact, compile_shader: Callable[[str], Any] = torch_compile_shader) -> MetalProgram:
    """Stage 3: compile the entry's source (once per process, entry and compiler) and keep its kernels."""
    return artifact.load_once(lambda: MetalProgram(artifact.path.read_text(encoding="utf-8"), str(artifact.path),
                                                   compile_shader=compile_shader), scope=compile_shader)


class MetalProgram:
    """``run(inputs) -> outputs``: the plan's launches in order on ``device`` tensors, then its status checks.

    ``compile_shader(source)`` returns a library whose attribute ``<kernel>`` is a callable
    ``kernel(*tensors, threads=, group_size=)`` with ``max_threads_per_threadgroup``
    (torch's ShaderLibrary); tests pass a fake one.
    """

    def __init__(self, source: str, where: str, *, compile_shader: Callable[[str], Any] = torch_compile_shader,
                 device: str = "mps") -> None:
        self.meta = LaunchHeader.read(source, where, C_COMMENT)
        self.launches: list[Launch] = list(self.meta.launches)  # a C header holds Launch records
        self.device = device
        check_limits(self.launches)
        try:
            library = compile_shader(source)
        except RuntimeError as exc:  # torch raises RuntimeError with the compiler's log
            raise MetalBuildError(
                f"the Metal compiler rejected the kernels rendered in {where}: {exc}. This is a bug in yirage's "
                "C-family renderer (Metal dialect); report it with the graph (g.to_json())") from exc
        kernels: dict[str, Any] = {}
        for x in self.launches:
            if x.kernel not in kernels:
                try:
                    kernels[x.kernel] = getattr(library, x.kernel)
                except (AttributeError, RuntimeError) as exc:
                    raise MetalBuildError(f"the Metal library compiled from {where} has no kernel {x.kernel} "
                                          f"({exc}); a bug in yirage's renderer: report it") from exc
            limit = int(kernels[x.kernel].max_threads_per_threadgroup)
            if x.local > limit:
                raise NotSupportedError(
                    f"kernel {x.kernel} needs threadgroups of {x.local} threads, but this GPU runs it with at "
                    f"most {limit}; compile the graph with backend='cpu' (and report it: the renderer should "
                    "size row reductions to the pipeline's limit)")
        self.kernels = [kernels[x.kernel] for x in self.launches]
        self.lock = threading.Lock()  # one launch sequence at a time per program

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        import torch

        m, dev = self.meta, self.device
        tensors: dict[str, Any] = {}
        for name, index, dtype in m.inputs:
            t = inputs[index]  # float16/bfloat16 as they are: the kernels widen them as they load
            if t.device.type != dev or t.dtype != getattr(torch, dtype):
                raise LaunchArgumentError(
                    f"input {index} ({name}) is a {t.dtype} tensor on {t.device}, but the Metal program reads "
                    f"torch.{dtype} on {dev!r}; call it through the compiled graph, which checks and says the fix")
            tensors[name] = t
        for name, dims, dtype, role in m.buffers:
            if role == "output":
                tensors[name] = torch.empty(dims, dtype=getattr(torch, dtype), device=dev)
            else:  # temporaries are kept at compute type
                wide = "float32" if dtype in ("float16", "bfloat16") else dtype
                tensors[name] = torch.empty(max(1, math.prod(dims)), dtype=getattr(torch, wide), device=dev)
        for s in m.scratch:
            tensors[s.name] = torch.zeros(s.count, dtype=getattr(torch, s.dtype), device=dev)
        with self.lock:
            for kernel, x in zip(self.kernels, self.launches, strict=True):
                kernel(*[tensors[a] for a in x.args], threads=x.global_size, group_size=x.local)
        for x in self.launches:
            if x.check is not None:
                _raise_if_bad(x.check, tensors)
        return [tensors[name] for name in m.outputs]


def _raise_if_bad(check: Check, tensors: dict[str, Any]) -> None:
    status = int(tensors[check.status][0])  # waits for the kernels
    if not status:
        return
    pos = status - 1
    value = str(int(tensors[check.value_of].reshape(-1)[pos])) if check.value_of else ""
    error = IndexError if check.error == "IndexError" else ValueError
    raise error(check.message.format(pos=pos, value=value))


__all__ = ["LaunchArgumentError", "MetalBuildError", "MetalProgram", "build", "check_limits", "load",
           "render_source", "target", "torch_compile_shader"]
