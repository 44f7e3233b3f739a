"""``TritonStages``: the render -> build -> load stages of any backend whose kernel language is Triton.

A backend class inherits it before ``yirage.Backend``::

    class MyBackend(TritonStages, yirage.Backend):
        name = "mine"
        torch_device = "npu"   # the torch device type its tensors live on ("cuda", "npu", "mlu", "musa";
                               # "cpu" only under Triton's interpreter, TRITON_INTERPRET=1)
        kernel_dtypes = TRITON_DTYPES  # or the subset the device's Triton fork computes in

What a backend must set: ``torch_device`` (a class attribute or a property) and
``kernel_dtypes`` (the dtypes it claims; drop "float64" on a device whose
Triton has no float64 arithmetic, so the conformance kit does not ask for it).
``target()`` is derived, not set: ``triton <version>|<device target>``, where
the device target is ``interpreter`` under ``TRITON_INTERPRET=1`` and otherwise
the active driver's ``GPUTarget`` (backend, arch, warp size); override
``triton_device_target()`` for a fork that reports it differently.
``fingerprint()`` adds the Triton version and the renderer's sources to the
backend's own.

Launches pass ``triton_launch_options`` (default ``enable_fp_fusion=False``: no
multiply-add contraction, IEEE results as the C-family renderer's).

Stages: ``render`` is the launch header (``yirage.codegen.launch``: buffers,
launches, scratch, status checks; one ``#`` comment line) on top of
``render_triton``'s module; ``build`` writes it as ``kernels.py`` in the cache
entry; ``load`` imports that file (one module per cache entry and process:
``Artifact.load_once``) and returns a ``TritonProgram``, which allocates
outputs, temporaries and zeroed scratch on ``torch_device`` per call and
launches each kernel on its grid. Nothing here imports triton until a plan is
compiled: ``import yirage`` stays light.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

from yirage.codegen.launch import PYTHON_COMMENT, LaunchHeader, TritonLaunch
from yirage.errors import BackendError

SOURCE_NAME = "kernels.py"
#: every dtype the Triton renderer computes in (float16/bfloat16 widened to float32)
TRITON_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64"})


class TritonLaunchError(BackendError, RuntimeError):
    """Triton rejected or failed a rendered kernel: a renderer or Triton bug, not a user error."""


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (numpy on CPU tensors): ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_version() -> str:
    """The installed Triton's version (imports triton)."""
    return str(importlib.import_module("triton").__version__)


def render_source(plan: Any) -> str:
    """``render_triton(plan)``'s module behind its launch header: buffers, launches, scratch, checks."""
    from yirage.codegen.triton import render_triton

    rendered = render_triton(plan)
    return LaunchHeader.of(plan, rendered.launches, rendered.scratch).write(rendered.source, PYTHON_COMMENT)


class TritonStages:
    """The compile stages of a Triton backend; see the module docstring for what a backend must set."""

    torch_device: Any
    name: Any
    #: keyword options of every launch: no multiply-add contraction (IEEE results, as the C-family renderer's);
    #: a vendor fork that lacks an option overrides this
    triton_launch_options: dict[str, Any] = {"enable_fp_fusion": False}

    def schedule_knobs(self, plan: Any) -> list[Any]:
        """The Triton renderer's knobs (row BLOCK, gemv BLOCK_N / BLOCK_K) for ``g.superoptimize()``."""
        from yirage.codegen.triton import schedule_knobs

        return schedule_knobs(plan)

    def render(self, plan: Any) -> str:
        """Stage 1: the Triton module of ``plan`` behind one JSON comment line describing its launch."""
        return render_source(plan)

    def build(self, source: str, workdir: Path) -> Path:
        """Stage 2: write the module (Triton compiles it on first launch, into its own cache)."""
        from yirage.compiler.cache import write_private

        path = workdir / SOURCE_NAME
        write_private(path, source)
        return path

    def load(self, artifact: Any) -> TritonProgram:
        """Stage 3: import the module (once per process and cache entry) and wrap it in a launcher."""
        return artifact.load_once(lambda: TritonProgram(_import(artifact.path, artifact.key), self.torch_device,
                                                        dict(self.triton_launch_options)))

    def triton_device_target(self) -> str:
        """What the kernels are compiled for: ``interpreter``, or the active driver's GPUTarget."""
        if interpreting():
            return "interpreter"
        driver = importlib.import_module("triton.runtime.driver").driver
        t = driver.active.get_current_target()
        return f"{t.backend}:{t.arch}:{t.warp_size}"

    def target(self) -> str:
        return f"triton {triton_version()}|{self.triton_device_target()}"

    def fingerprint(self) -> str:
        from yirage.codegen.fingerprint import source_fingerprint
        from yirage.codegen.triton import RENDERER_VERSION

        codegen = Path(__file__).resolve().parent.parent / "codegen" / "triton"
        own = super().fingerprint()  # type: ignore[misc]  # Backend.fingerprint: the backend's package
        return (f"{own}|triton-renderer {RENDERER_VERSION} {source_fingerprint(codegen)}|"
                f"{source_fingerprint(Path(__file__).resolve().parent)}|triton {triton_version()}")


def _import(path: Path, key: str) -> Any:
    """Import ``path`` as module ``yirage_triton_<key>`` (registered in sys.modules: Triton looks it up)."""
    name = f"yirage_triton_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TritonLaunchError(f"cannot import the Triton kernels in {path}: no module spec; delete the cache "
                                "entry's directory and compile again")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise TritonLaunchError(
            f"the Triton kernels rendered in {path} failed to import ({type(exc).__name__}: {exc}). This is a bug "
            "in yirage's Triton renderer or an unsupported Triton version; report it with the graph "
            "(g.to_json())") from exc
    return module


class TritonProgram:
    """``run(inputs) -> outputs``: allocates on the backend's torch device, launches every kernel in order.

    Outputs, temporaries and scratch are new tensors each call, on the inputs' device (a call holds no state,
    so calls may run concurrently); inputs arrive checked by the core (device type, dtype, strides, storage),
    and kernels launch on their device (``torch.cuda.device``: Triton launches on the current one).
    """

    def __init__(self, module: Any, device: str, options: dict[str, Any] | None = None) -> None:
        meta = LaunchHeader.read(Path(module.__file__).read_text(encoding="utf-8"), module.__file__, PYTHON_COMMENT)
        self.module, self.device = module, device
        self.options = {"enable_fp_fusion": False} if options is None else options
        self.inputs = [(n, i) for n, i, _ in meta.inputs]
        self.buffers = list(meta.buffers)
        self.outputs = list(meta.outputs)
        launches: list[TritonLaunch] = list(meta.launches)  # a Python header holds TritonLaunch records
        self.launches = [(getattr(module, x.kernel), x) for x in launches]
        self.checks = [x.check for x in launches if x.check]
        self.scratch = list(meta.scratch)

    def __call__(self, inputs: Any) -> list[Any]:
        import torch

        tensors: dict[str, Any] = {name: inputs[index] for name, index in self.inputs}
        devices = {t.device for t in tensors.values()}
        if len(devices) > 1:
            raise ValueError(f"the inputs are on several devices ({', '.join(sorted(map(str, devices)))}); a Triton "
                             "launch runs on one: move them to one device with t.to(device)")
        device = devices.pop() if devices else torch.device(self.device)
        for name, dims, dtype, role in self.buffers:
            if role == "output":
                tensors[name] = torch.empty(dims, dtype=getattr(torch, dtype), device=device)
            else:  # temporaries are kept at compute type
                ct = "float32" if dtype in ("float16", "bfloat16") else dtype
                tensors[name] = torch.empty(max(1, math.prod(dims)), dtype=getattr(torch, ct), device=device)
        for s in self.scratch:
            tensors[s.name] = torch.zeros(s.count, dtype=getattr(torch, s.dtype), device=device)
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device, _quiet_numpy() if interpreting() else contextlib.nullcontext():
            for kernel, launch in self.launches:
                try:
                    kernel[launch.grid](*[tensors[a] for a in launch.args], **launch.params,
                                        num_warps=launch.num_warps, **self.options)
                except Exception as exc:
                    raise TritonLaunchError(
                        f"Triton failed on kernel {launch.kernel} of {self.module.__file__} "
                        f"({type(exc).__name__}: {exc}). This is a bug in yirage's Triton renderer or in the "
                        "installed Triton; report it with the graph (g.to_json())") from exc
        for check in self.checks:
            status = int(tensors[check.status][0])
            if status:
                pos = status - 1
                value = str(int(tensors[check.value_of].reshape(-1)[pos])) if check.value_of else ""
                error = IndexError if check.error == "IndexError" else ValueError
                raise error(check.message.format(pos=pos, value=value))
        return [tensors[name] for name in self.outputs]


@contextlib.contextmanager
def _quiet_numpy() -> Any:
    """The interpreter evaluates masked-off lanes too (e.g. 1 / 0 there): numpy must not warn about them."""
    np = importlib.import_module("numpy")
    with np.errstate(all="ignore"):
        yield


__all__ = ["TRITON_DTYPES", "TritonLaunchError", "TritonProgram", "TritonStages", "interpreting",
           "render_source", "triton_version"]
