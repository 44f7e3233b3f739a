"""How a domestic backend runs kernel plans and PersistentKernels: its vendor's Triton, or torch ops.

Every vendor here ships a Triton port as its kernel language; where it is
installed and its driver reports the vendor's device, kernel plans go
through ``TritonStages`` (render -> build -> load, one cache) and a
PersistentKernel runs as launched Triton kernels (``LaunchedRuntime``).
Otherwise plans run as unfused torch ops on the device
(``TorchLoweringStages``) and a PersistentKernel task by task in torch
(``ReferenceRuntime``): correct wherever the vendor's torch runs, slower.

``DomesticKernels`` inherits both mixins and routes ``compile`` by
``kernel_path()``, decided once per probe (``forget_probe`` decides again).
A vendor class says what its Triton looks like in a few class attributes
(``triton_backends``, ``triton_targets``, ...); see ``_triton_probe``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import yirage
from yirage.backend.runtime_contract import LAUNCHED, SERIAL, PersistentRuntime, RuntimeKind
from yirage.backend.torch_stages import TORCH_LOWERING_DTYPES, TorchLoweringStages
from yirage.backend.triton_stages import TRITON_DTYPES, TritonStages
from yirage_backend_domestic._triton_probe import TritonInstall, active_target, installed_triton

logger = logging.getLogger("yirage.backend")
_LOG_LOCK = threading.Lock()

TRITON = "triton"
TORCH = "torch"


@dataclass(frozen=True)
class KernelPath:
    """Which compiler path a backend uses (or would use, where its device is absent) and why."""

    path: str  # TRITON or TORCH
    why: str  # short, for tables: "triton-ascend 3.2.0, target npu:Ascend910B:0" / "triton-ascend not installed"
    reason: str  # a sentence a user can act on
    settled: bool  # True: decided on the device (the backend is available); False: guessed from what is installed

    @property
    def label(self) -> str:
        return "Triton" if self.path == TRITON else "torch lowering"

    def summary(self) -> str:
        """``uses: Triton (triton-ascend 3.2.0, ...)`` / ``would use: torch lowering (triton-ascend not installed)``."""
        return f"{'uses' if self.settled else 'would use'}: {self.label} ({self.why})"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary()}


class DomesticKernels(TorchLoweringStages, TritonStages, yirage.Backend):
    """A domestic backend's compile and PersistentKernel paths, chosen by what is installed.

    Vendor classes set: ``triton_name`` (how users know the vendor's Triton), ``triton_install``
    (how to get it), ``triton_backends`` (its ``triton.backends.<name>`` names), ``triton_targets``
    (the ``GPUTarget.backend`` its driver reports), ``triton_dists`` (its distribution names),
    ``triton_fp64`` (whether its Triton computes float64; FlagGems' vendor descriptors) and
    ``later_step`` (what else is planned, said in the fallback reason) and ``collective`` (the
    torch.distributed backend the vendor's torch registers for its devices: multi-rank runs).
    """

    triton_name: ClassVar[str] = ""
    triton_install: ClassVar[str] = ""
    triton_backends: ClassVar[tuple[str, ...]] = ()
    triton_targets: ClassVar[frozenset[str]] = frozenset()
    triton_dists: ClassVar[tuple[str, ...]] = ()
    triton_fp64: ClassVar[bool] = False
    later_step: ClassVar[str] = ""
    collective: ClassVar[str | None] = None

    _kernel_path: KernelPath | None = None
    _fallback_logged: bool = False

    def collective_backend(self) -> str | None:
        """The vendor's collective library as torch.distributed names it (yirage.distributed checks it is there)."""
        return self.collective

    # -- the choice ----------------------------------------------------------------------
    def present(self) -> str:
        """What the probe found on the device side, for fallback reasons (``torch_npu is present``)."""
        raise NotImplementedError

    def kernel_path(self) -> KernelPath:
        """The compiler path, memoized with the probe (``forget_probe`` clears both)."""
        avail = self.availability()
        path = self._kernel_path
        if path is None or path.settled != avail.ok:
            path = self._kernel_path = self.choose_path(settled=avail.ok)
        return path

    def settle_path(self) -> KernelPath:
        """Called by ``probe()`` once the device is found: decide on the device and remember it."""
        path = self._kernel_path = self.choose_path(settled=True)
        return path

    def forget_probe(self) -> None:
        super().forget_probe()
        self._kernel_path = None
        self._fallback_logged = False

    def choose_path(self, settled: bool) -> KernelPath:
        """TRITON when the vendor's Triton is installed (and, ``settled``, its driver reports the device)."""
        install = installed_triton(self.triton_dists)
        if install is None:
            return self._torch(f"{self.triton_name} not installed", f"{self.triton_name} is not installed", settled)
        ours = [b for b in install.backends if b in self.triton_backends]
        if not ours:
            found = ", ".join(install.backends) or "none"
            return self._torch(
                f"{self.triton_name} not installed",
                f"{self.triton_name} is not installed (the installed Triton, {install.label}, has the backends "
                f"{found} and none of this vendor's: triton.backends.{' / '.join(self.triton_backends)})", settled)
        if install.too_old():
            return self._torch(
                f"{install.label} is older than Triton 3.0",
                f"the installed {install.label} is older than Triton 3.0, the language yirage's Triton renderer "
                "emits (3.0-3.5)", settled, fix=f"install a 3.x build of it ({self.triton_install})")
        where = f"{install.label}, backend {ours[0]!r}"
        if not settled:
            return KernelPath(TRITON, where, f"{self.triton_name} ({where}) is installed: kernel plans would be "
                              "compiled with it where the device is present", settled=False)
        return self._on_device(install, where)

    def _on_device(self, install: TritonInstall, where: str) -> KernelPath:
        try:
            target = active_target()
        except Exception as exc:  # noqa: BLE001 - whatever the vendor's driver raises becomes the fallback reason
            logger.debug("Triton's driver failed for backend %r", self.name, exc_info=True)
            return self._torch(f"{install.label} failed to start ({type(exc).__name__})",
                               f"{self.triton_name} ({where}) is installed but its driver failed: "
                               f"{type(exc).__name__}: {exc}", settled=True,
                               fix="make Triton's driver start (the vendor's Triton must match its driver and torch "
                               "build, and be the only Triton backend whose driver is active)")
        if target.split(":")[0] not in self.triton_targets:
            wanted = " or ".join(sorted(self.triton_targets))
            return self._torch(f"Triton's active driver targets {target}",
                               f"{self.triton_name} ({where}) is installed but Triton's active driver targets "
                               f"{target}, not {wanted}", settled=True,
                               fix="make the vendor's backend the one whose driver is active (remove other Triton "
                               "backends that claim the device)")
        return KernelPath(TRITON, f"{install.label}, target {target}",
                          f"{self.triton_name} ({where}) compiles kernel plans for {target}", settled=True)

    def _torch(self, why: str, problem: str, settled: bool, fix: str = "") -> KernelPath:
        lead = f"{self.present()} but {problem}" if settled else problem
        fix = fix or f"install it ({self.triton_install})"
        later = f"; {self.later_step}" if self.later_step else ""
        return KernelPath(TORCH, why, f"{lead}. To compile fused kernels, {fix}; until then kernel plans run as "
                          f"unfused torch ops on the device{later}", settled)

    def kernels_note(self, path: KernelPath) -> str:
        """The probe reason's tail naming the path: ``kernels: Triton (...)`` / ``kernels: unfused torch ops (...)``."""
        if path.path == TRITON:
            return f"kernels: Triton ({path.why})"
        return f"kernels: unfused torch ops (no vendor Triton: {path.why})"

    # -- what follows the choice ------------------------------------------------------------
    @property
    def kernel_dtypes(self) -> frozenset[str]:  # type: ignore[override]
        """Triton's dtypes (without float64 where the vendor's Triton lacks it), or the torch lowering's."""
        if self.kernel_path().path == TRITON:
            return TRITON_DTYPES if self.triton_fp64 else TRITON_DTYPES - {"float64"}
        return TORCH_LOWERING_DTYPES

    def compile(self, plan: Any, graph: Any) -> Callable[[Sequence[Any]], list[Any]]:
        """Triton through the core's render -> build -> load stages and cache, or the torch-device lowering."""
        self.require_available()
        if self.kernel_path().path == TRITON:
            return yirage.Backend.compile(self, plan, graph)  # TritonStages' render/build/load, compile_cached
        self._log_fallback()
        return self.torch_lowering(plan)

    def schedule_knobs(self, plan: Any) -> list[Any]:
        """The Triton renderer's knobs on the Triton path; none on the torch lowering, which has no schedule."""
        return TritonStages.schedule_knobs(self, plan) if self.kernel_path().path == TRITON else []

    @property
    def persistent_kind(self) -> RuntimeKind:  # type: ignore[override]
        """Launched Triton kernels on the Triton path, else the reference runtime's serial torch ops."""
        return LAUNCHED if self.kernel_path().path == TRITON else SERIAL

    def persistent_runtime(self, program: Any, config: Any) -> PersistentRuntime:
        """Launched Triton kernels per decode step, or the torch ops of the reference runtime, on the device."""
        if self.kernel_path().path == TRITON:
            from yirage.persistent.launched import LaunchedRuntime

            return LaunchedRuntime(program, config)
        self._log_fallback()
        from yirage.reference.persistent import ReferenceRuntime

        return ReferenceRuntime(program, config)

    def default_config(self, device: yirage.DeviceInfo) -> dict[str, int]:
        """One worker: both runtimes launch a step's tasks in order on one stream (and ignore the counts)."""
        return {"num_workers": 1, "num_local_schedulers": 1}

    def _log_fallback(self) -> None:
        with _LOG_LOCK:
            if self._fallback_logged:
                return
            self._fallback_logged = True
        logger.warning("backend %r runs kernels as unfused torch ops: %s", self.name, self.kernel_path().reason)
