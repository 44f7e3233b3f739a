"""The CUDA backend, for NVIDIA GPUs only.

MetaX, Iluvatar and Hygon stacks answer ``torch.cuda.is_available()`` too;
this backend claims a device only when its name is NVIDIA's and torch is a
CUDA (not a ROCm/HIP) build, so those devices go to their own backends.

Kernel plans are rendered by the core's C-family renderer in the CUDA dialect,
built to cubins with NVRTC (``nvrtc.py``; works without a GPU, so CI compiles
for sm_80 and sm_90) and launched on torch CUDA tensors through the driver API
(``launch.py`` over ``driver.py``; ``capturable(exe)`` is the CUDA-graph-capturable
call path, and ``CUDABackend.capture`` records a plan's CUDA graph for replay:
``graphs.py``). Large float matmuls run as torch's cuBLAS GEMM between the renderer's
prologue and epilogue kernels, which keep the fused RMSNorm, bias, residual and
activation (``gemm.py``).
Per kernel class, kernels may run as Triton instead (``YIRAGE_CUDA_KERNELS``,
``CUDABackend.kernel_languages``; ``languages.py`` and ``mixed.py``): both
renderings go into one cache entry and one launcher runs the plan in order.
``compile_check`` (any sources) and ``check_conformance`` (every plan of the
conformance kit) are the compile-only entry points for CI and yirage_backend_manager.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yirage
from yirage.backend.probes import TorchCudaFacts, TorchDevice, torch_cuda_facts, torch_cuda_memory
from yirage.backend.runtime_contract import LAUNCHED, RESIDENT
from yirage.compiler.cache import write_private
from yirage_backend_cuda.check import DEFAULT_ARCHS, CheckFailure, CheckReport, check_conformance, compile_check
from yirage_backend_cuda.languages import KernelLanguageError, choose, from_env, parse_kernel_languages
from yirage_backend_cuda.nvrtc import BUILD_OPTIONS, CompileError, ToolchainError, compile_cuda, toolchain

logger = logging.getLogger("yirage.cuda")

__all__ = ["BUILD_OPTIONS", "CUDABackend", "CheckFailure", "CheckReport", "CompileError", "KernelLanguageError",
           "ToolchainError", "capturable", "check_conformance", "compile_check"]

YIRAGE_PLUGIN_API = 1

NVIDIA_NAME = re.compile(r"\b(nvidia|geforce|tesla|quadro|titan|rtx|gtx|jetson|grace)\b", re.IGNORECASE)


def nvidia_driver_loaded() -> bool:
    """The NVIDIA kernel driver announces itself here (Linux)."""
    return Path("/proc/driver/nvidia/version").exists()


def nvidia_devices(facts: TorchCudaFacts) -> list[TorchDevice]:
    """Devices with positive NVIDIA evidence: the NVIDIA driver, or an NVIDIA brand name."""
    if facts.hip_version or not facts.cuda_version:
        return []
    if nvidia_driver_loaded():
        return list(facts.devices)
    return [d for d in facts.devices if NVIDIA_NAME.search(d.name)]


class CUDABackend(yirage.Backend):
    name = "cuda"
    priority = 100
    vendor = "NVIDIA"
    torch_device = "cuda"
    device_kind = "gpu"
    description = "CUDA C kernels (NVRTC/nvcc) on NVIDIA GPUs"
    kernel_dtypes = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64"})

    @property
    def persistent_kind(self) -> Any:  # type: ignore[override]
        """``LAUNCHED`` (each decode step as CUDA C task kernels, captured once as a CUDA graph: pk_runtime.py), or
        ``RESIDENT`` with ``YIRAGE_CUDA_PK_RUNTIME=megakernel`` (the whole decode in one launch: megakernel.py)."""
        from yirage_backend_cuda.megakernel import selected_runtime

        return RESIDENT if selected_runtime() == "megakernel" else LAUNCHED

    def persistent_runtime(self, program: Any, config: Any) -> Any:
        """The program's task kernels (the core's C-family renderer, CUDA dialect), launched per decode step and
        replayed as a CUDA graph (``pk_runtime.CudaPersistentRuntime``), or run by one resident cooperative
        kernel (``megakernel.CudaMegakernelRuntime``), as ``YIRAGE_CUDA_PK_RUNTIME`` says."""
        from yirage_backend_cuda.megakernel import megakernel_runtime, selected_runtime
        from yirage_backend_cuda.pk_runtime import cuda_runtime

        self.require_available()
        if selected_runtime() == "megakernel":
            import torch

            device = program.tokens.device
            index = device.index if device.index is not None else torch.cuda.current_device()
            try:
                return megakernel_runtime(program, config, index,
                                          lambda: torch.cuda.current_stream(index).cuda_stream)
            except yirage.NotSupportedError as exc:  # this program or GPU: the launched runtime runs it, said so
                logger.warning("the cuda megakernel cannot run this PersistentKernel (%s); using the launched "
                               "runtime", exc)
        return cuda_runtime(program, config)

    def default_config(self, device: yirage.DeviceInfo) -> dict[str, int]:
        """The launched runtime runs a step's launches in order on one stream (the counts are ignored); the
        resident one runs ``BLOCKS_PER_SM`` thread blocks per SM (at most what the occupancy query allows)."""
        from yirage_backend_cuda.megakernel import BLOCKS_PER_SM, selected_runtime

        if selected_runtime() == "megakernel":
            return {"num_workers": BLOCKS_PER_SM * (device.compute_units or 1), "num_local_schedulers": 0}
        return {"num_workers": 1, "num_local_schedulers": 0}

    def collective_backend(self) -> str | None:
        """Ranks of a tensor-parallel run on NVIDIA GPUs talk through NCCL (a CUDA build of torch has it)."""
        return "nccl"

    def compile_check(self) -> CheckReport:  # type: ignore[override]
        """Compile-only conformance check for machines without a GPU: every kit plan through NVRTC (+ ptxas)."""
        return check_conformance()

    def probe(self) -> yirage.Availability:
        facts = torch_cuda_facts()
        if facts.error and not facts.torch_version:
            return yirage.Availability(False, facts.error)
        if facts.hip_version:
            return yirage.Availability(
                False,
                f"torch {facts.torch_version} is a ROCm/HIP build (HIP {facts.hip_version}), not CUDA; "
                "its devices are AMD or Hygon DCU, not NVIDIA",
            )
        if not facts.cuda_version:
            driver = "an NVIDIA driver is loaded" if nvidia_driver_loaded() else "no NVIDIA driver is loaded"
            return yirage.Availability(
                False,
                f"torch {facts.torch_version} is a CPU-only build (torch.version.cuda is None) and {driver}; "
                "install a CUDA build of torch on a machine with an NVIDIA GPU",
            )
        if not facts.devices:
            extra = f": {facts.error}" if facts.error else ""
            return yirage.Availability(
                False, f"torch {facts.torch_version} (CUDA {facts.cuda_version}) sees no CUDA device{extra}"
            )
        found = nvidia_devices(facts)
        if not found:
            names = ", ".join(repr(d.name) for d in facts.devices)
            return yirage.Availability(
                False,
                f"torch.cuda devices ({names}) are not recognisably NVIDIA GPUs: no NVIDIA driver is loaded "
                "(/proc/driver/nvidia is missing) and the names carry no NVIDIA brand; CUDA-compatible stacks "
                "of other vendors (MetaX, Iluvatar) look like this: use that vendor's backend",
            )
        best = found[0]
        cap = f" (sm_{best.capability[0]}{best.capability[1]})" if best.capability else ""
        return yirage.Availability(True, f"{best.name}{cap}, CUDA {facts.cuda_version}, {len(found)} device(s)")

    def _devices(self) -> list[TorchDevice]:
        self.require_available()
        return nvidia_devices(torch_cuda_facts())

    def _load_device(self) -> TorchDevice:
        """Where plans are built for and loaded: torch's current device when it is NVIDIA's, else the first one."""
        import torch

        devices = self._devices()
        current = torch.cuda.current_device()
        return next((d for d in devices if d.index == current), devices[0])

    def device_count(self) -> int:
        return len(self._devices()) if self.availability().ok else 0

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        device = self._devices()[index]
        return yirage.DeviceInfo(
            name=device.name,
            vendor="NVIDIA",
            kind="gpu",
            compute_units=device.multi_processor_count,
            memory_bytes=device.total_memory,
            simd_width=32,
            extra={"compute_capability": device.capability, "torch_index": device.index},
        )

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        return torch_cuda_memory(self._devices()[index].index)

    # -- kernel languages ----------------------------------------------------
    _kernel_languages: dict[str, str] | None = None

    @property
    def kernel_languages(self) -> dict[str, str]:
        """The language ("cuda" or "triton") of each plan kernel class: as set here, else ``YIRAGE_CUDA_KERNELS``.

        Assign ``"triton"``, ``"matmul=triton,row=cuda"`` or a ``{class: language}`` mapping (missing classes
        stay "cuda"); assign None to follow the environment again. Read when a plan is rendered.
        """
        return dict(self._kernel_languages) if self._kernel_languages is not None else from_env()

    @kernel_languages.setter
    def kernel_languages(self, value: str | Mapping[str, str] | None) -> None:
        self._kernel_languages = (None if value is None
                                  else parse_kernel_languages(value, "CUDABackend.kernel_languages"))

    def languages_for(self, plan: Any) -> dict[str, str]:
        """The language of each of ``plan``'s kernels (by name): the plan's ``language`` knob where a search set
        it (``schedule_knobs``), else the class setting (``kernel_languages``)."""
        from yirage.compiler.schedule import choice

        languages = choose(plan, self.kernel_languages)
        return {name: choice(plan, name, "language", lang) for name, lang in languages.items()}

    def schedule_knobs(self, plan: Any) -> list[Any]:
        """Each kernel's language, CUDA C or Triton, where triton is installed (the class setting's first: on an
        H100 neither won everywhere, Triton's attention 1.6-2.2x faster, its GEMV slower), then the C-family
        renderer's own knobs (row work-group sizes, cuBLAS or the generated product)."""
        from yirage.backend.probes import module_installed
        from yirage.codegen.cstyle import schedule_knobs
        from yirage.codegen.dialects.cuda import DIALECT
        from yirage.compiler.schedule import Knob

        languages = [Knob(name, "language", (lang, "triton" if lang == "cuda" else "cuda"), "CUDA C (NVRTC) or Triton")
                     for name, lang in choose(plan, self.kernel_languages).items()]
        return (languages if module_installed("triton") else []) + schedule_knobs(plan, DIALECT)

    # -- compile stages ------------------------------------------------------
    def render(self, plan: Any) -> str:
        """The plan's kernels as CUDA C (the core's C-family renderer, CUDA dialect) under a launch-metadata line.

        Kernels set to Triton (``kernel_languages``) are rendered by the Triton renderer into the same source.
        """
        from yirage_backend_cuda.launch import render_source

        return render_source(plan, self.languages_for(plan))

    def target(self) -> str:
        """The load device's arch (``"sm_86"``) where an NVIDIA GPU exists, else the compile-check archs."""
        if self.availability().ok:
            device = self._load_device()
            if device.capability:
                return f"sm_{device.capability[0]}{device.capability[1]}"
        return ",".join(DEFAULT_ARCHS)

    def fingerprint(self) -> str:
        """The package's sources, NVRTC's version and headers and the options: a new compiler means new entries."""
        return f"{super().fingerprint()}:{toolchain().fingerprint()}:{' '.join(BUILD_OPTIONS)}"

    def build(self, source: str, workdir: Path) -> list[Path]:
        """``kernels.cu`` (the source with its launch metadata) and one ``kernels.<arch>.cubin`` per target arch,
        and ``kernels.py`` when kernels run as Triton (Triton compiles it on first launch).

        Any NVRTC error or warning raises CompileError before anything is written.
        """
        from yirage_backend_cuda.launch import SOURCE_NAME
        from yirage_backend_cuda.mixed import TRITON_SOURCE_NAME, split_source

        source, triton = split_source(source)
        cubins = {arch: compile_cuda(source, arch, name=SOURCE_NAME, options=BUILD_OPTIONS).cubin
                  for arch in self.target().split(",")}
        paths = [workdir / SOURCE_NAME]
        write_private(paths[0], source)
        if triton:
            paths.append(workdir / TRITON_SOURCE_NAME)
            write_private(paths[-1], triton)
        for arch, cubin in cubins.items():
            paths.append(workdir / f"kernels.{arch}.cubin")
            write_private(paths[-1], cubin)
        return paths

    def load(self, artifact: Any) -> Any:
        """A ``PlanLauncher`` over the entry's cubin for the load device (``launch.py`` says how a call runs)."""
        from yirage_backend_cuda.launch import load

        return load(artifact, self._load_device().index)

    def capture(self, executable: Any, inputs: Sequence[Any]) -> Any:
        """A CUDA graph of one call of ``executable`` on the persistent ``inputs`` (``graphs.py``)."""
        from yirage_backend_cuda.graphs import capture

        return capture(executable, inputs)


def capturable(executable: Any) -> Any:
    """The CUDA-graph-capturable call path of a graph compiled for cuda (see ``launch.capturable``)."""
    from yirage_backend_cuda.launch import capturable as make

    return make(executable)


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [CUDABackend]
