"""The Backend interface: everything in the core talks to backends through it.

A backend is one small class per device family (tinygrad's ``ops_*.py`` idea):
a few class attributes that describe it and a few methods that probe, describe
and (in later layers) compile and run. Plugins return Backend subclasses from
the ``yirage_backends`` hook.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from yirage.errors import NotSupportedError

#: The plugin-API version this yirage speaks. A plugin module declares the
#: version it was written for as ``YIRAGE_PLUGIN_API = 1``.
PLUGIN_API_VERSION = 1
SUPPORTED_PLUGIN_APIS = frozenset({1})

logger = logging.getLogger("yirage.backend")


@dataclass(frozen=True)
class Availability:
    """The answer of a probe: can this backend run here, and why (not)?

    ``auto`` is False for a backend that works but that ``set_backend('auto')``
    should pass over (OpenCL on the host CPU, where the cpu backend is faster);
    ``reason`` is a sentence a user can act on in either case.
    """

    ok: bool
    reason: str
    auto: bool = True

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class DeviceInfo:
    """Measured facts about one device: what the auto-configurator reads."""

    name: str
    vendor: str
    kind: str  # "cpu", "gpu", "npu", "accelerator"
    compute_units: int | None = None
    memory_bytes: int | None = None
    simd_width: int | None = None  # fp32 lanes per vector op, or warp/wavefront size
    caches: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes; ``free`` is None where the API cannot tell."""

    total: int
    used: int | None
    free: int | None
    source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Backend:
    """One kind of device yirage can compile for.

    Subclasses set the class attributes and override ``probe``,
    ``device_info`` and ``memory_info``. ``probe`` must be cheap and must not
    import heavy libraries unless they are needed to tell the truth; the
    registry memoizes it through ``availability()``.
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0  # higher wins under set_backend('auto')
    vendor: ClassVar[str] = ""
    torch_device: ClassVar[str] = "cpu"
    device_kind: ClassVar[str] = "cpu"
    description: ClassVar[str] = ""

    def __init__(self) -> None:
        self._availability: Availability | None = None

    # -- probing ---------------------------------------------------------
    def probe(self) -> Availability:
        raise NotImplementedError(f"backend {self.name!r} does not implement probe()")

    def availability(self) -> Availability:
        """The memoized probe; a probe that raises is reported, not fatal."""
        if self._availability is None:
            try:
                answer = self.probe()
            except Exception as exc:  # noqa: BLE001 - a broken probe must not take the host down
                logger.warning("probe of backend %r raised", self.name, exc_info=True)
                answer = Availability(False, f"the probe raised {type(exc).__name__}: {exc}")
            if not isinstance(answer, Availability):
                logger.warning("probe of backend %r returned %r, not an Availability", self.name, answer)
                answer = Availability(
                    False, f"the probe returned {answer!r} instead of an Availability (a bug in the plugin)"
                )
            self._availability = answer
        return self._availability

    def forget_probe(self) -> None:
        """Drop the memoized probe so the next availability() probes again."""
        self._availability = None

    def require_available(self) -> None:
        from yirage.errors import BackendUnavailableError

        avail = self.availability()
        if not avail.ok:
            raise BackendUnavailableError(
                f"backend {self.name!r} is unavailable: {avail.reason}"
            )

    # -- description -----------------------------------------------------
    def device_count(self) -> int:
        return 1 if self.availability().ok else 0

    def device_info(self, index: int = 0) -> DeviceInfo:
        raise NotSupportedError(f"backend {self.name!r} does not describe its devices")

    def memory_info(self, index: int = 0) -> MemoryInfo:
        raise NotSupportedError(f"backend {self.name!r} does not report memory")

    # -- filled in by the compiler and runtime layers --------------------
    #: dtypes this backend compiles kernel graphs for; empty: it cannot yet
    kernel_dtypes: ClassVar[frozenset[str]] = frozenset()

    def compile(self, plan: Any, graph: Any) -> Any:
        """Build a callable ``run(inputs) -> outputs`` for a fused KernelPlan.

        Inputs reach it already checked against the graph's declarations.
        """
        raise NotSupportedError(
            f"backend {self.name!r} cannot compile kernel graphs yet; "
            "use backend='cpu' or backend='reference'"
        )

    def persistent_runtime(self, task_graph: Any, config: Any) -> Any:
        """Build the runtime that executes a PersistentKernel's task graph."""
        raise NotSupportedError(
            f"backend {self.name!r} has no PersistentKernel runtime yet"
        )

    def default_config(self, device: DeviceInfo) -> dict[str, int]:
        """Workers and schedulers for a PersistentKernel on ``device``."""
        raise NotSupportedError(
            f"backend {self.name!r} does not propose a PersistentKernel configuration"
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def validate_backend_class(cls: Any, plugin: str) -> str | None:
    """Why ``cls`` is not a usable Backend class, or None when it is."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return f"plugin {plugin!r} returned {cls!r}, which is not a yirage Backend subclass"
    if not isinstance(cls.name, str) or not cls.name.isidentifier() or cls.name != cls.name.lower():
        return (
            f"plugin {plugin!r} returned {cls.__name__} with name {cls.name!r}; "
            "a backend name must be a lower-case identifier such as 'cpu'"
        )
    if cls.name == "auto":
        return f"plugin {plugin!r} returned a backend named 'auto', which is reserved"
    if not isinstance(cls.priority, int):
        return f"plugin {plugin!r}: {cls.__name__}.priority must be an int"
    return None
