"""The Backend interface: everything in the core talks to backends through it.

A backend is one small class per device family (tinygrad's ``ops_*.py`` idea):
a few class attributes that describe it and a few methods that probe, describe
and (in later layers) compile and run. Plugins return Backend subclasses from
the ``yirage_backends`` hook.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from yirage.backend.runtime_contract import RUNTIME_KINDS, PersistentRuntime, RuntimeKind
from yirage.errors import NotSupportedError, PluginError

if TYPE_CHECKING:
    from yirage.compiler.stages import Artifact

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


#: What a caller can ask ``auto`` for (``current_backend(need=...)``): compiled kernel graphs, or a
#: PersistentKernel runtime.
NEEDS = ("kernel_graphs", "persistent")


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run: ``auto`` matches requests against it and ``info`` shows it.

    Why a separate description: a plugin that only probes (describes a device, compiles nothing) must
    not capture every unqualified ``new_kernel_graph()`` just because its priority is high. Derived by
    ``Backend.capabilities()`` from what the class defines; a backend may override that method.
    ``kernel_dtypes`` is empty exactly when ``kernel_graphs`` is False.
    """

    kernel_graphs: bool
    kernel_dtypes: frozenset[str]
    persistent: bool
    weight_formats: frozenset[str]
    #: how its PersistentKernel runtime runs a step (yirage.persistent.runtime.RUNTIME_KINDS: "persistent",
    #: "resident", "launched", "serial"); "" without a runtime, or where the backend does not declare it
    persistent_kind: str = ""

    def missing(self, need: str, dtypes: frozenset[str] = frozenset()) -> str:
        """Why this backend cannot serve ``need`` (for ``dtypes``), as a phrase; '' when it can."""
        if need == "kernel_graphs":
            if not self.kernel_graphs:
                return "cannot compile kernel graphs (it declares no kernel_dtypes / compile stages)"
            lacking = sorted(dtypes - self.kernel_dtypes)
            if lacking:
                return (f"cannot compile kernel graphs in {', '.join(lacking)} "
                        f"(its kernel_dtypes: {', '.join(sorted(self.kernel_dtypes))})")
            return ""
        if need == "persistent":
            return "" if self.persistent else "has no PersistentKernel runtime (no persistent_runtime)"
        raise ValueError(f"unknown capability need {need!r}; use one of {', '.join(NEEDS)}")

    def as_dict(self) -> dict[str, Any]:
        """Plain data with sorted lists, for ``info --json``."""
        return {"kernel_graphs": self.kernel_graphs, "kernel_dtypes": sorted(self.kernel_dtypes),
                "persistent": self.persistent, "weight_formats": sorted(self.weight_formats),
                "persistent_kind": self.persistent_kind}


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
        """The memoized probe, run with a time limit and checked.

        A probe that raises, hangs (``YIRAGE_PROBE_TIMEOUT``) or answers
        with anything but a well-formed Availability makes the backend
        unavailable with a reason naming the plugin; it never takes the host down.
        """
        if self._availability is None:
            started = time.perf_counter()
            self._availability = self._timed_probe()
            logger.debug("probed backend %r in %.3f s: ok=%s auto=%s (%s)", self.name, time.perf_counter() - started,
                         self._availability.ok, self._availability.auto, self._availability.reason)
        return self._availability

    def _timed_probe(self) -> Availability:
        limit = getattr(self, "_probe_timeout", None)
        if limit is None:
            from yirage import config

            limit = config.probe_timeout()
        who = plugin_label(self)
        call = getattr(self, "_probe_call", None)
        if call is None or call.finished.is_set():  # a probe still hanging from before is waited on, not doubled
            call = TimedCall(self.probe, f"yirage-probe-{self.name}")
            self._probe_call = call
        if not call.wait(limit):
            message = (
                f"probe timed out after {limit:g} s: {who} did not answer; fix or uninstall the plugin, "
                f"or raise YIRAGE_PROBE_TIMEOUT if its device is just slow to wake up"
            )
            logger.warning("%s", message)
            return Availability(False, message)
        self._probe_call = None
        if call.error is not None:
            if not isinstance(call.error, (Exception, SystemExit)):
                raise call.error
            logger.warning("probe of backend %r raised", self.name, exc_info=call.error)
            return Availability(False, f"the probe of {who} raised {type(call.error).__name__}: {call.error}")
        answer, problem = check_availability(call.result)
        if problem:
            message = f"{who}: probe() {problem} (a bug in the plugin; report it to its authors)"
            logger.warning("%s", message)
            return Availability(False, message)
        assert answer is not None
        return answer

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

    def check_process(self) -> None:
        """Raise, naming the fix, where this backend cannot run in this process although it is available: e.g.
        a child forked after its parent started threads the backend's runtime needs (work there would block
        forever). Engines call it before a generation's first step; the default has nothing to check."""

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
    #: weight formats its PersistentKernel runtime reads: float dtypes, and quantized block formats
    #: (yirage.quant: "q8_0", "q4_0") only where its task bodies dequantize them
    persistent_weight_formats: ClassVar[frozenset[str]] = frozenset({"float32", "bfloat16", "float16"})
    #: how the runtime ``persistent_runtime`` returns runs a step, declared so that ``info`` and
    #: ``PersistentKernel.config`` can say which configuration fields it ignores without building one
    #: (yirage.persistent.runtime: PERSISTENT, RESIDENT, LAUNCHED or SERIAL); None: not declared
    persistent_kind: ClassVar[RuntimeKind | None] = None
    #: optional: a method ``compile_check(self)`` for machines without the device, compiling every
    #: conformance-kit kernel without running it; returns an object with ``ok: bool`` and ``summary() -> str``
    #: (``yirage_backend_manager.py test NAME`` runs it when the backend is unavailable here)
    compile_check: ClassVar[Any] = None
    #: optional: a method ``kernel_path(self)`` for backends with more than one compiler path (the domestic
    #: ones: the vendor's Triton or the torch lowering); returns an object with ``path: str``, ``reason: str`` and
    #: ``summary() -> str`` (``yirage_backend_manager.py info`` shows it, also for unavailable backends)
    kernel_path: ClassVar[Any] = None

    def compile(self, plan: Any, graph: Any) -> Any:
        """Build a callable ``run(inputs) -> outputs`` for a fused KernelPlan.

        Inputs reach it already checked against the graph's declarations. A
        backend that overrides the stages below gets this for free: render,
        then build only on a cache miss, then load, through the one cache of
        ``yirage.compiler.stages.compile_cached``.
        """
        if type(self).render is Backend.render:
            raise NotSupportedError(
                f"backend {self.name!r} cannot compile kernel graphs yet; "
                "use backend='cpu' or backend='reference'"
            )
        from yirage.compiler.stages import compile_cached

        self.require_available()
        return compile_cached(self, plan)

    def schedule_knobs(self, plan: Any) -> Sequence[Any]:
        """The schedule decisions this backend's renderer would take for ``plan`` that a measured search may take
        instead: ``yirage.compiler.schedule.Knob`` records (kernel, name, legal values with the backend's own pick
        first). ``g.superoptimize()`` tries them; the renderer reads the chosen values back with
        ``yirage.compiler.schedule.choice(plan, kernel, name, default)``. The default: none."""
        return ()

    # -- compile stages (a backend that compiles overrides render, build and load) --
    def render(self, plan: Any) -> str:
        """Stage 1: the source text of a KernelPlan (pure: the same plan gives the same text).

        The text is the main part of the cache key, so everything the
        generated code depends on (shapes, dtypes, constants) must appear in it.
        """
        raise NotSupportedError(f"backend {self.name!r} does not render kernel plans")

    def build(self, source: str, workdir: Path) -> Path | Sequence[Path]:
        """Stage 2: turn ``source`` into files inside ``workdir`` (a private cache entry); return their paths.

        Runs only on a cache miss (or to replace a corrupted entry). Write with
        ``yirage.compiler.cache.write_private`` so a crash never leaves a torn file.
        """
        raise NotSupportedError(f"backend {self.name!r} does not build kernel sources")

    def load(self, artifact: Artifact) -> Callable[..., Any]:
        """Stage 3: the launcher ``run(inputs) -> outputs`` from verified build output (``artifact.path``)."""
        raise NotSupportedError(f"backend {self.name!r} does not load compiled kernels")

    def fingerprint(self) -> str:
        """What besides the source decides the build output: by default a hash of the backend's own package.

        Override to add compiler versions; it is part of every cache key.
        """
        import inspect

        from yirage.codegen.fingerprint import source_fingerprint

        try:
            package = Path(inspect.getfile(type(self))).resolve().parent
        except (TypeError, OSError) as exc:
            raise NotSupportedError(
                f"backend {self.name!r} is not defined in a source file ({exc}), so yirage cannot fingerprint it "
                "for the compile cache; override Backend.fingerprint() to return what its output depends on"
            ) from exc
        return source_fingerprint(package)

    def target(self) -> str:
        """What the build is for (GPU arch, thread count...), part of every cache key; '' for one target."""
        return ""

    def persistent_runtime(self, program: Any, config: Any) -> PersistentRuntime:
        """Build the runtime that runs a frozen PersistentProgram (``yirage.persistent.program``).

        The program holds the tensors, layers, task graph and descriptor rows with named columns
        (``yirage.persistent.specs``); a runtime reads only the program, so a backend adds task
        bodies for the LayerSpec kinds and nothing else. What the runtime must do (run / value / stop,
        Ctrl-C, the config fields it honours): ``yirage.persistent.runtime.PersistentRuntime``; its
        ``kind`` must be ``persistent_kind``.
        """
        raise NotSupportedError(
            f"backend {self.name!r} has no PersistentKernel runtime yet"
        )

    def persistent_task_bodies(self) -> Any:
        """The task bodies of this backend's PersistentKernel runtime (the ``TaskBodies`` its runtime module
        registers, ``yirage.persistent.runtime``), or None (the default: not said). ``PersistentKernel.runs`` reads
        it, so a model builds a layer kind only some runtimes have (``screened_logits``) only where it runs; with
        None a model builds only the kinds every runtime runs."""
        return None

    def default_config(self, device: DeviceInfo) -> dict[str, int]:
        """Workers and schedulers for a PersistentKernel on ``device``."""
        raise NotSupportedError(
            f"backend {self.name!r} does not propose a PersistentKernel configuration"
        )

    def capture(self, executable: Any, inputs: Sequence[Any]) -> Any:
        """Record one call of ``executable`` on ``inputs`` into a device graph (CUDA graphs), or None (the default).

        Replaying a device graph skips the host's launch work, which dominates small decode steps. The
        inputs are persistent tensors the caller keeps alive and refills before each replay. The result
        has ``replay() -> list`` (the same output tensors every time, overwritten; the values follow in
        stream order) and ``check_status()`` (raise the bad-input error a replay recorded on the device).
        None means this backend has no device graphs: callers call the executable instead.
        """
        return None

    def prompt_linear(self) -> Callable[[Any, Any], Any] | None:
        """A projection for the prompt's prefill (``yirage.models.prefill``), or None (the default: torch's
        ``x @ W.T`` on the weight made float32).

        The callable takes ``x`` (M, K) float32 on this backend's device and a weight (a torch tensor or a
        ``yirage.quant.QuantizedTensor``) and returns ``x @ W.T`` as (M, N) float32, or None where it has no
        faster way for that weight or M (torch's then runs). With ``InferEngine(prompt_dtype="bfloat16")``
        ``x`` comes rounded, as bfloat16, for bf16 weights (``prefill.rounded_linear``): the sum of products
        of those values, accumulated in float32, or None. A backend offers it where its own kernels beat a
        dequantize-then-GEMM, e.g. quantized matrices read as blocks.
        """
        return None

    def prepare_decode(self, kv_dtype: Any = None) -> None:
        """Start, in the background, the compiles a PersistentKernel decode with KV caches of ``kv_dtype`` (None:
        float32) will need on this backend (a JIT's first compile), and return at once; the default: nothing.
        InferEngine calls it before it loads the model, so that the compile overlaps the engine's own work (the
        load, the tokenizer, the prompt's prefill) instead of following it."""

    def collective_backend(self) -> str | None:
        """The torch.distributed backend ("gloo", "nccl", "hccl", ...) that moves this device's tensors between
        ranks in a multi-rank (tensor-parallel) run; None: this backend cannot run multi-rank (the default)."""
        return None

    def capabilities(self) -> Capabilities:
        """What this backend can run, derived from what its class defines (override to declare it yourself).

        Kernel graphs: ``kernel_dtypes`` is non-empty and ``compile`` or the ``render`` stage is
        implemented. PersistentKernels: ``persistent_runtime`` is overridden; it reads
        ``persistent_weight_formats``.
        """
        cls = type(self)
        compiles = cls.compile is not Backend.compile or cls.render is not Backend.render
        dtypes = frozenset(self.kernel_dtypes) if compiles else frozenset()
        persistent = cls.persistent_runtime is not Backend.persistent_runtime
        formats = frozenset(self.persistent_weight_formats) if persistent else frozenset()
        kind = self.persistent_kind if persistent else None
        return Capabilities(bool(dtypes), dtypes, persistent, formats, kind.name if kind is not None else "")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def validate_backend_class(cls: Any, plugin: str) -> str | None:
    """Why ``cls`` is not a usable Backend class, or None when it is.

    The core relies on these class attributes (sorting by priority, BackendType
    members by name, torch devices by ``torch_device``), so a plugin that sets
    them wrongly is refused here, at the boundary, with the plugin named.
    """
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return f"plugin {plugin!r} returned {safe_repr(cls)}, which is not a yirage Backend subclass"
    if not isinstance(cls.name, str) or not cls.name.isidentifier() or cls.name != cls.name.lower():
        return (
            f"plugin {plugin!r} returned {cls.__name__} with name {safe_repr(cls.name)}; "
            "a backend name must be a lower-case identifier such as 'cpu'"
        )
    if cls.name == "auto":
        return f"plugin {plugin!r} returned a backend named 'auto', which is reserved"
    if not isinstance(cls.priority, int) or isinstance(cls.priority, bool):
        return (
            f"plugin {plugin!r}: {cls.__name__}.priority must be an int such as 50, "
            f"not {safe_repr(cls.priority)} ({type(cls.priority).__name__})"
        )
    for attr in ("vendor", "torch_device", "device_kind", "description"):
        value = getattr(cls, attr)
        if not isinstance(value, str) and not isinstance(value, property):  # a property is read per device
            return f"plugin {plugin!r}: {cls.__name__}.{attr} must be a str, not {safe_repr(value)}"
    dtypes = cls.kernel_dtypes
    if isinstance(dtypes, property):
        return None
    if not isinstance(dtypes, (set, frozenset)) or not all(isinstance(d, str) for d in dtypes):
        return (
            f"plugin {plugin!r}: {cls.__name__}.kernel_dtypes must be a frozenset of dtype names "
            f"such as frozenset({{'float32'}}), not {safe_repr(dtypes)}"
        )
    return None


class TimedCall:
    """``fn()`` run in a daemon thread that the caller waits for at most a time limit.

    Why: a plugin whose import or probe never returns must not hang the
    host. The thread is abandoned on timeout (Python cannot kill it); the
    result, or the exception (any BaseException), is kept for the caller.
    """

    def __init__(self, fn: Callable[[], Any], thread_name: str) -> None:
        self._fn = fn
        self.finished = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, which decides
            self.error = exc
        finally:
            self.finished.set()

    def wait(self, timeout: float) -> bool:
        """True when the call finished within ``timeout`` seconds."""
        return self.finished.wait(timeout)


def safe_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` for messages: shortened, and never raising."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a hostile __repr__ must not hide the real problem
        text = f"<{type(value).__name__} whose repr raised {type(exc).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plugin_label(backend: Backend) -> str:
    """Which plugin (distribution and module) a backend came from, for error messages."""
    cls = type(backend)
    origin = getattr(backend, "_plugin_origin", "")
    where = f"{cls.__module__}.{cls.__qualname__}"
    return f"backend {backend.name!r} ({where}{', ' + origin if origin else ''})"


def _kind_problem(field_name: str, value: Any, kinds: tuple[type, ...], allow_none: bool = False) -> str:
    if value is None and allow_none:
        return ""
    if isinstance(value, bool) and bool not in kinds:  # True is an int to Python, not to us
        ok = False
    else:
        ok = isinstance(value, kinds)
    if ok:
        return ""
    wanted = " or ".join(k.__name__ for k in kinds) + (" or None" if allow_none else "")
    return f"{field_name}={safe_repr(value)} ({type(value).__name__}, not {wanted})"


def check_availability(answer: Any) -> tuple[Availability | None, str]:
    """A clean copy of a probe's answer, or why it is not a well-formed Availability."""
    if not isinstance(answer, Availability):
        return None, f"returned {safe_repr(answer)} instead of an Availability"
    problems = [
        p for p in (
            _kind_problem("ok", answer.ok, (bool,)),
            _kind_problem("reason", answer.reason, (str,)),
            _kind_problem("auto", answer.auto, (bool,)),
        ) if p
    ]
    if problems:
        return None, f"returned an Availability with {', '.join(problems)}; ok and auto must be True or False"
    return Availability(answer.ok, answer.reason, answer.auto), ""


def checked_device_info(backend: Backend, index: int = 0) -> DeviceInfo:
    """``backend.device_info(index)``, refused with a PluginError unless well-formed."""
    info = backend.device_info(index)
    if not isinstance(info, DeviceInfo):
        problems = [f"returned {safe_repr(info)} instead of a DeviceInfo"]
    else:
        problems = [p for p in (
            _kind_problem("name", info.name, (str,)),
            _kind_problem("vendor", info.vendor, (str,)),
            _kind_problem("kind", info.kind, (str,)),
            _kind_problem("compute_units", info.compute_units, (int,), allow_none=True),
            _kind_problem("memory_bytes", info.memory_bytes, (int,), allow_none=True),
            _kind_problem("simd_width", info.simd_width, (int,), allow_none=True),
            _kind_problem("caches", info.caches, (dict,)),
            _kind_problem("extra", info.extra, (dict,)),
        ) if p]
    if problems:
        raise PluginError(
            f"{plugin_label(backend)}: device_info({index}) {'; '.join(problems)} "
            "(a bug in the plugin; report it to its authors)"
        )
    return info


def checked_capabilities(backend: Backend) -> Capabilities:
    """``backend.capabilities()``, refused with a PluginError unless well-formed and self-consistent."""
    caps = backend.capabilities()
    if not isinstance(caps, Capabilities):
        problems = [f"returned {safe_repr(caps)} instead of a Capabilities"]
    else:
        problems = [p for p in (
            _kind_problem("kernel_graphs", caps.kernel_graphs, (bool,)),
            _kind_problem("persistent", caps.persistent, (bool,)),
        ) if p]
        for name, names in (("kernel_dtypes", caps.kernel_dtypes), ("weight_formats", caps.weight_formats)):
            if not isinstance(names, frozenset) or not all(isinstance(n, str) for n in names):
                problems.append(f"{name}={safe_repr(names)} (not a frozenset of str)")
        if not problems and caps.kernel_graphs != bool(caps.kernel_dtypes):
            problems.append("kernel_graphs must be True exactly when kernel_dtypes names the dtypes it compiles")
        if not problems and caps.persistent_kind not in ("", *(RUNTIME_KINDS if caps.persistent else ())):
            problems.append(f"persistent_kind={safe_repr(caps.persistent_kind)} (one of {', '.join(RUNTIME_KINDS)} "
                            "for a backend with a PersistentKernel runtime, else '')")
    if problems:
        raise PluginError(
            f"{plugin_label(backend)}: capabilities() {'; '.join(problems)} "
            "(a bug in the plugin; report it to its authors)"
        )
    return caps


def checked_memory_info(backend: Backend, index: int = 0) -> MemoryInfo:
    """``backend.memory_info(index)``, refused with a PluginError unless well-formed."""
    info = backend.memory_info(index)
    if not isinstance(info, MemoryInfo):
        problems = [f"returned {safe_repr(info)} instead of a MemoryInfo"]
    else:
        problems = [p for p in (
            _kind_problem("total", info.total, (int,)),
            _kind_problem("used", info.used, (int,), allow_none=True),
            _kind_problem("free", info.free, (int,), allow_none=True),
            _kind_problem("source", info.source, (str,)),
        ) if p]
    if problems:
        raise PluginError(
            f"{plugin_label(backend)}: memory_info({index}) {'; '.join(problems)} "
            "(a bug in the plugin; report it to its authors)"
        )
    return info
