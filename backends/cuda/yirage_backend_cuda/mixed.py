"""Plans whose kernels run partly as CUDA C and partly as Triton (``languages.py`` says how a kernel is chosen).

``render_mixed`` renders the plan in both languages and writes one source: the
launch header (``yirage.codegen.launch``: CUDA launches and ``Gemm`` steps of
the kernels that stay CUDA C, ``triton`` launches of the others, every step in
plan order, and the length of the Triton module as ``triton_chars``), the CUDA
C, then the Triton module.
``split_source`` separates them again for ``build`` (NVRTC compiles the CUDA
part; the Triton module is written as ``kernels.py``). ``TritonRunner`` imports
that module from the cache entry and launches one kernel on given torch tensors
on torch's current stream (where Triton launches), which is what the
``PlanLauncher`` calls for a Triton step.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from yirage.backend.probes import module_installed
from yirage.codegen.cstyle import render
from yirage.codegen.dialects.cuda import DIALECT
from yirage.codegen.exprs import UnsupportedExprError
from yirage.codegen.launch import C_COMMENT, Gemm, Launch, LaunchHeader, TritonLaunch
from yirage.compiler.kernel_ir import KernelPlan
from yirage.errors import BackendError
from yirage_backend_cuda.languages import ENV, TRITON_SCRATCH, KernelLanguageError, kernel_class, owner

TRITON_SOURCE_NAME = "kernels.py"
#: keyword options of every Triton launch: no multiply-add contraction (IEEE results, as the CUDA C kernels')
TRITON_OPTIONS = {"enable_fp_fusion": False}


class TritonMissingError(BackendError, RuntimeError):
    """Kernels were set to run as Triton, but triton is not importable."""


def require_triton(plan: KernelPlan, languages: Mapping[str, str]) -> None:
    """TritonMissingError naming the kernels, their classes and the fix, when triton cannot be imported."""
    if module_installed("triton"):
        return
    names = ", ".join(f"{k.name} ({kernel_class(k)})" for k in plan.kernels if languages.get(k.name) == "triton")
    raise TritonMissingError(
        f"the cuda backend is set to run plan kernels {names} as Triton ({ENV} or CUDABackend.kernel_languages), "
        f"but triton is not installed: pip install 'triton>=3.0,<3.6' (CUDA builds of torch ship it), or set "
        f"{ENV}=cuda to run every kernel as CUDA C")


def render_mixed(plan: KernelPlan, languages: Mapping[str, str]) -> str:
    """The plan with each kernel in its language: launch header, CUDA C, Triton module (module docstring)."""
    from yirage.codegen.triton import render_triton

    require_triton(plan, languages)
    names = [k.name for k in plan.kernels]
    cuda = render(plan, DIALECT)
    try:
        tri = render_triton(plan)  # the whole plan: the renderer has no per-kernel entry point
    except UnsupportedExprError as exc:
        raise UnsupportedExprError(f"{exc}. The cuda backend renders plans with kernels set to Triton ({ENV} or "
                                   f"CUDABackend.kernel_languages) through the Triton renderer; set {ENV}=cuda to "
                                   "run this plan as CUDA C") from exc

    def step_owner(step: Launch | Gemm) -> str:
        return step.name if isinstance(step, Gemm) else owner(step.kernel, names)

    stray = [x.kernel for x in tri.launches if x.kernel not in names]
    if stray:
        raise KernelLanguageError(f"Triton kernels {stray} are not named after a plan kernel of {names}: the Triton "
                                  f"renderer's names changed; a bug, report it with the graph and set {ENV}=cuda")
    launches = tuple(x for x in cuda.launches if languages[owner(x.kernel, names)] == "cuda")
    steps: list[Launch | Gemm | TritonLaunch] = []
    triton_steps = []
    renamed = {s.name: TRITON_SCRATCH + s.name for s in tri.scratch}
    for name in names:
        if languages[name] == "cuda":
            steps += [s for s in cuda.steps if step_owner(s) == name]
            continue
        for x in (x for x in tri.launches if x.kernel == name):
            check = replace(x.check, status=renamed[x.check.status]) if x.check else None
            triton_steps.append(replace(x, args=tuple(renamed.get(a, a) for a in x.args), check=check))
            steps.append(triton_steps[-1])
    used = {a for x in launches for a in x.args} | {n for s in steps if isinstance(s, Gemm) for n in (s.a, s.out)}
    scratch = [s for s in cuda.scratch if s.name in used]
    used = {a for x in triton_steps for a in x.args}
    scratch += [replace(s, name=renamed[s.name]) for s in tri.scratch if renamed[s.name] in used]
    header = LaunchHeader.of(plan, launches, scratch, steps, triton_steps, triton_chars=len(tri.source))
    return header.write(cuda.source + tri.source, C_COMMENT)


def split_source(source: str, where: str = "the rendered plan") -> tuple[str, str]:
    """(the CUDA part with its launch header, the Triton module or "") of a rendered source.

    A source without a launch header (hand-written CUDA C) is all CUDA part.
    """
    if not source.startswith(LaunchHeader.prefix(C_COMMENT)):
        return source, ""
    chars = LaunchHeader.read(source, where, C_COMMENT).extra.get("triton_chars", 0)
    if type(chars) is not int or not 0 <= chars < len(source):
        raise KernelLanguageError(f"the launch header of {where} gives the Triton module {chars!r} characters; "
                                  "render the plan again with the cuda backend's render")
    if not chars:
        return source, ""
    return source[:-chars], source[-chars:]


class TritonRunner:
    """Launches the kernels of one entry's Triton module on torch tensors, on torch's current stream of ``device``.

    ``launch(step, tensors)`` is what ``PlanLauncher`` calls for a Triton step; tensors arrive in ``step.args``
    order and were checked (inputs) or allocated (buffers, scratch) by the launcher on ``device``.
    """

    def __init__(self, path: Path, key: str, device: Any, kernels: Sequence[str]) -> None:
        try:
            importlib.import_module("triton")
        except ImportError as exc:
            raise TritonMissingError(
                f"the compile-cache entry {path.parent} runs kernels {', '.join(kernels)} as Triton, but triton does "
                f"not import ({exc}): pip install 'triton>=3.0,<3.6', or set {ENV}=cuda and compile again") from exc
        self.path, self.device = path, device
        self.module = _import(path, f"yirage_cuda_triton_{key}")
        missing = [k for k in kernels if not callable(getattr(self.module, k, None))]
        if missing:
            raise TritonMissingError(f"{path} has no Triton kernels {missing}: a stale or foreign cache entry; "
                                     f"delete {path.parent} so it is rebuilt")

    def launch(self, step: TritonLaunch, tensors: Sequence[Any]) -> None:
        """``kernel[grid](*tensors, **constexprs, num_warps=...)`` on the current stream of the device."""
        import contextlib

        import torch

        kernel = getattr(self.module, step.kernel)
        # Triton launches on the current device's current stream; a CPU device is Triton's interpreter (tests)
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on_device:
            try:
                kernel[step.grid](*tensors, **step.params, num_warps=step.num_warps, **TRITON_OPTIONS)
            except Exception as exc:  # noqa: BLE001 - re-raised with the kernel and the module named
                raise BackendError(
                    f"Triton failed on kernel {step.kernel} of {self.path} ({type(exc).__name__}: {exc}). A bug in "
                    f"yirage's Triton renderer or in the installed Triton: report it with the graph (g.to_json()); "
                    f"set {ENV}=cuda meanwhile") from exc


def _import(path: Path, name: str) -> Any:
    """Import ``path`` as module ``name`` (registered in sys.modules: Triton looks kernels' globals up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TritonMissingError(f"cannot import the Triton kernels in {path}: no module spec; delete "
                                 f"{path.parent} and compile again")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        sys.modules.pop(name, None)
        raise BackendError(f"the Triton kernels rendered in {path} failed to import ({type(exc).__name__}: {exc}): "
                           f"a bug in yirage's Triton renderer or an unsupported Triton; set {ENV}=cuda") from exc
    return module


__all__ = ["TRITON_OPTIONS", "TRITON_SOURCE_NAME", "TritonMissingError", "TritonRunner", "render_mixed",
           "require_triton", "split_source"]
