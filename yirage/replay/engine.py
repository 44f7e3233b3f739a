"""FusedInferEngine: record a plan per input signature, replay it on later calls, and say what happened.

The user-facing names follow InfiniLM's ``FusedInferEngine`` (enable_fusion,
warmup_iterations, set_fusion_enabled, clear_cache, get_stats). What is
recorded depends on the target (see yirage/replay/graph_plans.py and
model_plans.py for each mode there); the caching, fallback and counting are
the same for both and live here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from yirage.graph.kernel_graph import KernelGraph
from yirage.locks import ForkSafeRLock
from yirage.replay.graph_plans import FALLBACK_BACKEND, GraphTarget
from yirage.replay.model_plans import ModelTarget
from yirage.replay.signature import ReplayError, Signature, check_buckets, check_count, check_flag
from yirage.replay.stats import ReplayStats

logger = logging.getLogger("yirage.replay")

DEFAULT_MAX_SEQ_LEN = 512  # positions a model engine's KV caches hold unless max_seq_len says otherwise


class _Entry:
    __slots__ = ("plan", "reason", "text")

    def __init__(self, plan: Any, text: str, reason: str | None) -> None:
        self.plan, self.text, self.reason = plan, text, reason


class FusedInferEngine:
    """Wrap a model or a kernel graph; each new input signature is recorded once, then replayed.

    ``target``: an InferEngine, a LlamaModel or a model path (a Hugging Face
    directory or a GGUF file), called as ``forward(input_ids, positions)``
    (``pos=`` too) and returning logits (batch, len, vocab) while writing the
    engine's KV caches; or a KernelGraph, or a builder ``f(*tensors) ->
    KernelGraph`` called once per new signature, called as ``forward(x, w, ...)``
    and returning the graph's outputs as a list.

    The cache key is the signature (each tensor's shape and dtype, the
    device, the backend; a model's batch after bucketing) plus whether fusion
    was on when the entry was made. Modes (``get_stats()["fusion_modes"]``):

    * ``"fusion"``: a fused compiled plan, replayed from persistent input
      buffers that each call's tensors are copied into: a graph compiled on
      the engine's backend, or a model's PersistentKernel decode step for the
      bucket's batch size. On a backend with device graphs (CUDA graphs:
      ``Backend.capture``) a kernel graph's plan is captured once on its
      buffers and every later call replays the device graph
      (``get_stats()["device_graphs"]`` lists those keys);
      ``device_graphs=False`` calls the compiled plan instead. A failed
      capture keeps the fused plan uncaptured, logged and counted in
      ``capture_fallbacks``.
    * ``"graph_replay"``: a kernel graph whose fused compile failed, compiled
      on the reference backend (torch op by op, unfused) and replayed from
      persistent buffers.
    * ``"eager"``: nothing recorded, torch op by op on every call: fusion
      off, a model whose fused build failed, or a model's multi-token
      (prefill) call, which has no fused plan.

    A failing fused plan (compile error, NotSupportedError, a dtype the
    backend lacks) falls back as above, logged at WARNING on the
    ``yirage.replay`` logger with the reason and counted in
    ``fusion_fallbacks``; ``fallback=False`` raises instead. The attempt
    covers the compile and the ``warmup_iterations`` warm-up runs (so with
    the default one, a plan that fails on its first run falls back too; with
    0 such a failure raises from the call). Returned tensors
    always belong to the caller: plans return copies, never their buffers.
    ``batch_buckets=(1, 2, 4, 8)`` pads a model call's batch up to the next
    bucket so at most one decode plan per bucket is compiled. Thread-safe:
    calls on one engine are serialized.
    """

    def __init__(self, target: Any, *, backend: Any = None, enable_fusion: bool = True, warmup_iterations: int = 1,
                 batch_buckets: Any = None, max_seq_len: int | None = None, fallback: bool = True,
                 dtype: Any = None, num_workers: int | None = None, num_local_schedulers: int | None = None,
                 tasks_per_layer: int | None = None, device_graphs: bool | None = None) -> None:
        """Model-only options: batch_buckets, max_seq_len (default 512 positions per KV cache row), dtype (with a
        model path), num_workers, num_local_schedulers, tasks_per_layer (as InferEngine's). Kernel-graph only:
        device_graphs (default True: capture where the backend can)."""
        self._enabled = check_flag(enable_fusion, "enable_fusion")
        self._device_graphs = True if device_graphs is None else check_flag(device_graphs, "device_graphs")
        self._warmup = check_count(warmup_iterations, "warmup_iterations")
        self._fallback = check_flag(fallback, "fallback")
        model_options = {"batch_buckets": batch_buckets, "max_seq_len": max_seq_len, "dtype": dtype,
                         "num_workers": num_workers, "num_local_schedulers": num_local_schedulers,
                         "tasks_per_layer": tasks_per_layer}
        self.model: Any = None
        if _is_graph(target):
            given = sorted(k for k, v in model_options.items() if v is not None)
            if given:
                raise ReplayError(f"{', '.join(given)} only apply to a model target (an InferEngine, LlamaModel or "
                                  "model path); drop them for a kernel graph")
            self._target: Any = GraphTarget(target, _graph_backend(target, backend))
        else:  # every setting is checked before a model path is loaded
            if device_graphs is not None:
                raise ReplayError("device_graphs applies to a kernel-graph target; a model's decode step is one "
                                  "PersistentKernel launch already: drop device_graphs=")
            chosen = _model_backend(target, backend)
            buckets = check_buckets(batch_buckets)
            length = check_count(max_seq_len if max_seq_len is not None else DEFAULT_MAX_SEQ_LEN, "max_seq_len", 1)
            options = _decoder_options(target, num_workers, num_local_schedulers, tasks_per_layer)
            self.model = _model_of(target, dtype)
            self._target = ModelTarget(self.model, chosen, buckets, length, options)
        self.backend = self._target.backend
        self._lock = ForkSafeRLock()
        self._entries: dict[tuple[Signature, bool], _Entry] = {}
        self._stats = ReplayStats()

    # -- settings ------------------------------------------------------------------------
    @property
    def fusion_enabled(self) -> bool:
        return self._enabled

    @property
    def warmup_iterations(self) -> int:
        return self._warmup

    def set_fusion_enabled(self, enabled: bool) -> None:
        """Fused plans (True) or eager torch (False) for calls from now on; recorded entries of both are kept."""
        self._enabled = check_flag(enabled, "set_fusion_enabled(enabled)")

    def clear_cache(self, reset_stats: bool = True) -> None:
        """Drop every recorded plan and buffer (a model's KV caches too: prefill again) and, by default, the
        statistics, so ``get_stats()`` then describes what happened since."""
        with self._lock:
            self._entries.clear()
            self._target.clear()
            if check_flag(reset_stats, "reset_stats"):
                self._stats.reset()

    def get_stats(self) -> dict[str, Any]:
        """InfiniLM's statistics (see ReplayStats for each counter), plus backend, fallback reasons and times."""
        with self._lock:
            entries = list(self._entries.values())
            return self._stats.report(self._enabled, self.backend.name, {e.text: e.plan.mode for e in entries},
                                      {e.text: e.reason for e in entries if e.reason},
                                      [e.text for e in entries if getattr(e.plan, "device_graph", None) is not None])

    # -- calls -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run one call: replay its signature's plan, recording it first on a miss."""
        with self._lock:
            call = self._target.prepare(args, kwargs)  # bad input raises here, before anything is recorded
            key = (call.signature, self._enabled)
            entry = self._entries.get(key)
            if entry is None:
                self._stats.cache_misses += 1
                started = time.perf_counter()
                try:
                    entry = self._record(call, f"{call.signature.text()} fusion {'on' if self._enabled else 'off'}")
                finally:
                    self._stats.planning_seconds += time.perf_counter() - started
                self._entries[key] = entry
            else:
                self._stats.cache_hits += 1
            started = time.perf_counter()
            try:
                return entry.plan.run(call)
            finally:
                self._stats.compute_seconds += time.perf_counter() - started

    __call__ = forward

    def _record(self, call: Any, text: str) -> _Entry:
        recording = self._target.recording(call)
        if not self._enabled:
            return _Entry(recording.eager(), text, None)
        if recording.fused_reason is not None:
            logger.info("%s: %s", text, recording.fused_reason)
            return _Entry(recording.eager(), text, None)
        self._stats.fusion_attempts += 1
        try:
            plan = recording.fused()
            captured = self._capture(plan, call, text)
            self._warm_up(plan, call)
        except Exception as exc:  # noqa: BLE001 - logged with the reason, counted, and replaced by a correct plan
            if not self._fallback:
                raise
            plan, reason = self._fall_back(recording, call, text, exc)
            self._stats.fusion_fallbacks += 1
            return _Entry(plan, text, reason)
        self._stats.fusion_successes += 1
        self._stats.recordings += 1
        return _Entry(plan, text, captured)

    def _capture(self, plan: Any, call: Any, text: str) -> str | None:
        """Capture the plan's device graph where the backend has them; the failure's reason, or None."""
        if not self._device_graphs or not hasattr(plan, "capture"):
            return None
        try:
            plan.capture(call)
            return None
        except Exception as exc:  # noqa: BLE001 - logged with the reason, counted; the fused plan runs uncaptured
            if not self._fallback:
                raise
            reason = f"device graph capture failed: {type(exc).__name__}: {exc}"
        plan.device_graph = None
        self._stats.capture_fallbacks += 1
        logger.warning("%s: %s; the fused plan on backend %r runs uncaptured (each call launches it from the host). "
                       "Counted in get_stats()['capture_fallbacks']; fallback=False raises instead", text, reason,
                       self.backend.name)
        return reason

    def _fall_back(self, recording: Any, call: Any, text: str, exc: Exception) -> tuple[Any, str]:
        reason = f"{type(exc).__name__}: {exc}"
        try:
            plan = recording.fallback()
            if plan.recorded:
                self._warm_up(plan, call)
        except Exception as again:  # noqa: BLE001 - re-raised with both causes
            raise ReplayError(f"{text}: the fused plan failed ({reason}) and so did the fallback "
                              f"({type(again).__name__}: {again}); see both errors above") from again
        if plan.recorded:
            self._stats.recordings += 1
        where = f"compiled on {FALLBACK_BACKEND!r}, unfused" if plan.mode == "graph_replay" else "torch op by op"
        logger.warning("%s: the fused plan on backend %r failed (%s); falling back to %s (mode %r). Counted in "
                       "get_stats()['fusion_fallbacks']; fallback=False raises instead", text, self.backend.name,
                       reason, where, plan.mode)
        return plan, reason

    def _warm_up(self, plan: Any, call: Any) -> None:
        for _ in range(self._warmup):
            plan.run(call)

    def __repr__(self) -> str:
        what = "model" if self.model is not None else "kernel graph"
        return (f"<FusedInferEngine ({what}) on {self.backend.name}: fusion {'on' if self._enabled else 'off'}, "
                f"{len(self._entries)} cached>")


def _is_graph(target: Any) -> bool:
    """True for a KernelGraph or a graph builder, False for a model; anything else raises ReplayError."""
    from yirage.engine import InferEngine
    from yirage.models.llama import LlamaModel

    if isinstance(target, (InferEngine, LlamaModel, str, os.PathLike)):
        return False
    if isinstance(target, KernelGraph) or callable(target):
        return True
    raise ReplayError(f"FusedInferEngine wraps an InferEngine, a LlamaModel, a model path, a KernelGraph or a "
                      f"graph builder (a callable returning a KernelGraph); got {type(target).__name__}")


def _model_of(target: Any, dtype: Any) -> Any:
    """The LlamaModel behind a model target (loaded from a path with ``dtype``)."""
    from yirage.engine import InferEngine, load_model

    if isinstance(target, (str, os.PathLike)):
        return load_model(target, dtype)
    if dtype is not None:
        raise ReplayError("dtype= applies when the engine loads a model path; this model is already loaded in its "
                          "dtype: drop dtype=, or load it with the dtype you want")
    return target.model if isinstance(target, InferEngine) else target


def _model_backend(target: Any, backend: Any) -> Any:
    from yirage.backend.selection import current_backend, resolve
    from yirage.engine import InferEngine

    if backend is None:
        return target.backend if isinstance(target, InferEngine) else current_backend(need="persistent")
    return resolve(backend, "FusedInferEngine(backend=...)", need="persistent")


def _graph_backend(target: KernelGraph | Callable[..., KernelGraph], backend: Any) -> Any:
    from yirage.backend.selection import current_backend, resolve

    if backend is None and isinstance(target, KernelGraph) and target.backend is not None:
        backend = target.backend
    if backend is None:
        return current_backend(need="kernel_graphs")
    return resolve(backend, "FusedInferEngine(backend=...)", need="kernel_graphs")


def _decoder_options(target: Any, num_workers: Any, num_local_schedulers: Any, tasks: Any) -> dict[str, Any]:
    """build_decoder's options: the ones given, else the wrapped InferEngine's."""
    from yirage.engine import InferEngine

    if isinstance(target, InferEngine):
        num_workers = target.num_workers if num_workers is None else num_workers
        num_local_schedulers = target.num_local_schedulers if num_local_schedulers is None else num_local_schedulers
        tasks = target.tasks_per_layer if tasks is None else tasks
    for value, what, minimum in ((tasks, "tasks_per_layer", 1), (num_workers, "num_workers", 1),
                                 (num_local_schedulers, "num_local_schedulers", 0)):
        if value is not None:  # checked here: a bad count must not look like a failed fused build
            check_count(value, what, minimum)
    options = {"num_workers": num_workers, "num_local_schedulers": num_local_schedulers}
    return {**options, **({"tasks": tasks} if tasks is not None else {})}
