"""The cuda backend's PersistentKernel runtime: each decode step as CUDA C task kernels, replayed as a CUDA graph.

The kernels are the core's C-family PersistentKernel renderer in the CUDA dialect (``yirage.persistent.cstyle``:
``begin``, each layer's task kernels, ``commit``), built with NVRTC for the device's arch once per process and
rendering, and launched through the driver API on torch's current stream. The host loop is the launched
runtimes' one (``yirage.persistent.launched.LaunchedSteps``): the first step runs eagerly, is then captured
once as a CUDA graph and replayed, one graph launch per step; the host reads the small control buffer after
each step (so Ctrl-C lands between steps, the step in flight committed). This is the stepping stone to the
resident megakernel: the same task bodies, launched per step instead of scheduled inside one launch, so
``num_workers``/``num_local_schedulers`` are ignored (``LAUNCHED``; ``pk.config`` and ``info`` say so).

Every tensor is on the program's device: the attached ones (weights, KV caches, RoPE tables, tokens, step) are
the caller's, checked by the PersistentKernel; the runtime's own (intermediates, control buffer, scratch) are
allocated there. Kernel arguments are addresses fixed at build time and re-validated before every run
(``Snapshot``), which is also what makes the captured graph's replays sound.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from yirage.codegen.dialects.cuda import DIALECT
from yirage.compiler.loaded import load_once
from yirage.compiler.stages import cache_key
from yirage.errors import NotSupportedError
from yirage.persistent.cstyle import CTL, GROUP, SCORES, STEP, XS, PKLaunch, PKRendered, render_persistent, tensor_name
from yirage.persistent.cstyle import TASKS as CSTYLE_TASKS
from yirage.persistent.guard import Snapshot, check_tensor
from yirage.persistent.launched import Launch, LaunchedSteps
from yirage.persistent.program import PersistentProgram
from yirage.persistent.runtime import register_task_bodies
from yirage_backend_cuda.driver import CudaModule, LaunchError, call
from yirage_backend_cuda.nvrtc import BUILD_OPTIONS, compile_cuda

SOURCE_NAME = "persistent.cu"

#: the C-family task bodies, launched by this runtime
TASKS = register_task_bodies("cuda", CSTYLE_TASKS.bodies, declined=CSTYLE_TASKS.declined, where=CSTYLE_TASKS.where)


def render_cuda(program: PersistentProgram) -> PKRendered:
    """The program's task kernels in CUDA C exactly as this runtime builds them (the compile-only check too)."""
    return render_persistent(program, DIALECT, GROUP, lanes=0)


def load_module(source: str, device_index: int, name: str = SOURCE_NAME) -> CudaModule:
    """``source`` built with NVRTC for ``cuda:device_index``'s arch and loaded there, once per process."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"sm_{major}{minor}"

    def build() -> CudaModule:
        return CudaModule(compile_cuda(source, arch, name=name, options=BUILD_OPTIONS).cubin, device_index)

    return load_once(cache_key(source, f"{__name__} {' '.join(BUILD_OPTIONS)}", arch), build, scope=device_index)


class CudaPersistentRuntime(LaunchedSteps):
    """A frozen PersistentProgram run as CUDA C task kernels per step (see the module docstring).

    ``module`` holds the rendered kernels (``load_module(render_cuda(program).source, index)``) and
    ``stream()`` gives the handle of the stream to launch on (torch's current one); tests pass a module over a
    recording driver.
    """

    def __init__(self, program: PersistentProgram, config: dict[str, int], module: CudaModule,
                 stream: Callable[[], int], rendered: PKRendered | None = None) -> None:
        import torch

        self.program, self.config, self.module, self._stream = program, config, module, stream
        if program.tokens.dtype != torch.int64 or program.step.dtype != torch.int64:
            raise NotSupportedError("the cuda PersistentKernel runtime needs int64 step and tokens tensors; create "
                                    "them with dtype=torch.int64")
        TASKS.require(layer.kind for layer in program.layers)
        self.rendered = rendered or render_cuda(program)
        self.device = program.tokens.device
        self.values: dict[str, Any] = {}
        self.buffers: dict[str, Any] = {}  # kernel argument name -> tensor
        for t in program.tensors:
            if t.attached:
                value = program.values[t.name]
            else:
                value = torch.zeros(t.dims, dtype=getattr(torch, t.dtype), device=self.device)
                check_tensor(value, f"the cuda runtime's tensor {t.name!r}", self.device.type, written=True)
            self.values[t.name] = value
            self.buffers[tensor_name(t.index)] = value
        self._init_loop()  # refuses tensors off the program's device before any address is bound
        self.ctl = torch.zeros(self.rendered.ctl_size, dtype=torch.int64, device=self.device)
        self.buffers.update({STEP: program.step, CTL: self.ctl})
        for scratch in (XS, SCORES):
            self.buffers[scratch] = torch.zeros(self.rendered.scratch[scratch], dtype=torch.float32,
                                                device=self.device)
        self._begin_launch = self._launcher(self.rendered.begin)
        self._commit_launch = self._launcher(self.rendered.commit)
        self.launches: list[tuple[int, Launch]] = [(x.layer, self._launcher(x)) for x in self.rendered.layers]
        self.snapshot = Snapshot([*self.values.items(), ("step", program.step)])

    def _launcher(self, x: PKLaunch) -> Launch:
        """One kernel launch with its arguments bound (the addresses of its buffers, fixed for this runtime)."""
        module, driver = self.module, self.module.driver
        fn = module.launchable(x.kernel, x.groups, x.local, "yirage.persistent.cstyle (with the model's config)")
        missing = [a for a in x.args if a not in self.buffers]
        if missing:
            raise LaunchError(f"kernel {x.kernel} reads buffers {missing} this runtime does not have: a renderer "
                              "this runtime does not match; report it")
        args = tuple(self.buffers[a].data_ptr() for a in x.args)
        types = (ctypes.c_void_p,) * len(args)
        what = f"cuLaunchKernel({x.kernel})"

        def launch() -> None:
            with module.current():
                call(driver, what, driver.cuLaunchKernel(fn, x.groups, 1, 1, x.local, 1, 1, 0, self._stream(),
                                                         (args, types), 0))

        return launch

    def _begin(self) -> None:
        self._begin_launch()

    def _commit(self) -> None:
        self._commit_launch()


def cuda_runtime(program: PersistentProgram, config: dict[str, int]) -> CudaPersistentRuntime:
    """The runtime of ``program`` on its CUDA device: kernels rendered, built for the device's arch, loaded."""
    import torch

    device = program.tokens.device
    if device.type != "cuda":
        raise NotSupportedError(f"the cuda PersistentKernel runtime runs on CUDA tensors; the program's tokens are "
                                f"on {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    rendered = render_cuda(program)
    module = load_module(rendered.source, index)
    return CudaPersistentRuntime(program, config, module, lambda: torch.cuda.current_stream(index).cuda_stream,
                                 rendered)


__all__ = ["TASKS", "CudaPersistentRuntime", "cuda_runtime", "load_module", "render_cuda"]
