"""A PersistentKernel runtime for devices without persistent kernels: each step as launched Triton kernels.

Where a device gives no forward-progress guarantee between thread blocks
(or its vendor's Triton cannot express a persistent kernel), the task graph
of a decode step runs as a sequence of launches in layer order on one
stream: ``begin`` (which rows decode, token ids in range), each layer's task
kernels (``yirage.persistent.triton_tasks``), ``commit`` and the next
``begin``. The host reads a small control tensor once per step, so Ctrl-C
lands between steps (the step in flight is committed). Where torch has a
graph API for the device (CUDA graphs, torch_npu's NPU graphs...), the step
is captured once and replayed (``StepGraph``). Every tensor lives on
the program's torch device; the runtime allocates the internal ones there.
Backends whose torch device runs Triton (CUDA, ROCm, the domestic vendors'
forks, or Triton's interpreter on CPU tensors) return ``LaunchedRuntime``
from ``persistent_runtime``.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from yirage.backend.runtime_contract import LAUNCHED
from yirage.errors import NotSupportedError
from yirage.persistent import control, shutdown
from yirage.persistent.control import Ctl
from yirage.persistent.guard import Snapshot, check_tensor, token_out_of_range
from yirage.persistent.layers import Layer
from yirage.persistent.program import PersistentProgram
from yirage.persistent.runtime import NO_SCREEN, SINGLE_DEVICE, TaskBodies, register_task_bodies
from yirage.persistent.specs import FloatCol, IntCol

Launch = Callable[[], None]
logger = logging.getLogger(__name__)
#: failed recordings of a step as a device graph before a runtime decodes without one
CAPTURE_TRIES = 2


#: Triton GEMV programs aimed at per SM (columns per program follow from N), and the most elements of one
#: program's [batch, BN, BK] tile (its accumulator's registers)
GEMV_PROGRAMS_PER_SM = 2
GEMV_TILE = 8192


def _pow2(n: int, cap: int | None = None) -> int:
    p = 1 << max(0, int(n) - 1).bit_length()
    return min(p, cap) if cap else p


class StepGraph:
    """One decode step recorded with the device's graph API (torch.cuda.CUDAGraph, torch_npu's NPUGraph, ...).

    Every launch of a step has fixed arguments (tensors, shapes, the control buffer): the step is the same
    work each time, so it is captured once, after the first step has run eagerly (which compiles the Triton
    kernels), and replayed: one graph launch per step instead of a few per layer.
    """

    CLASSES = ("CUDAGraph", "NPUGraph", "MUSAGraph", "MLUGraph")

    def __init__(self, module: Any, cls: Any, step: Callable[[], None]) -> None:
        """Record ``step``. The garbage collector is off meanwhile: a collection during the capture can destroy an
        older engine's graph or module, a call that invalidates the capture (seen on an H100 between xdist tests);
        other threads' CUDA calls do not invalidate it where the API takes ``capture_error_mode``."""
        self.graph = cls()
        options = {"capture_error_mode": "thread_local"} if _accepts(module.graph, "capture_error_mode") else {}
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with module.graph(self.graph, **options):
                step()
        finally:
            if collecting:
                gc.enable()

    def replay(self) -> None:
        self.graph.replay()

    @classmethod
    def for_device(cls, device: Any) -> Callable[[Callable[[], None]], StepGraph] | None:
        """A capture function for ``device`` if torch's module for it has a graph API, else None."""
        import torch

        module = None if device.type == "cpu" else getattr(torch, device.type, None)
        graph_cls = next((getattr(module, n) for n in cls.CLASSES if hasattr(module, n)), None)
        if graph_cls is None or not callable(getattr(module, "graph", None)):
            return None
        return lambda step: cls(module, graph_cls, step)


def _accepts(function: Any, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


class LaunchedSteps:
    """The host side of a launched runtime: one decode step as launches on one stream, read back once per step.

    A subclass (the Triton kernels below, the cuda backend's CUDA C kernels) sets ``program``, ``device``,
    ``values`` (program tensor name -> the tensor its kernels read), ``ctl`` (the control buffer on the device,
    yirage.persistent.control), ``launches`` ((layer index, launch) for one step, in layer order) and
    ``snapshot``, calls ``_init_loop()``, and implements ``_begin`` (which rows decode, token ids in range)
    and ``_commit`` (append the picked tokens, advance ``step``). The loop, the device-graph capture of a step,
    the profiled first step, ``pick`` and ``stop`` are here, once.

    It ignores ``num_workers``/``num_local_schedulers`` (``LAUNCHED``): one stream runs a step's launches.
    """

    kind = LAUNCHED
    program: PersistentProgram
    device: Any
    values: dict[str, Any]
    ctl: Any
    launches: list[tuple[int, Launch]]
    snapshot: Snapshot

    def _init_loop(self) -> None:
        """Refuse tensors on another device than the program's (the PersistentKernel checks device types only:
        a weight on cuda:1 beside tokens on cuda:0 would hand a kernel another device's address), then set up."""
        stray = [f"{name} ({t.device})" for name, t in [*self.values.items(), ("step", self.program.step)]
                 if t.device != self.device]
        if stray:
            raise NotSupportedError(f"the {self.kind} runtime's kernels run on {self.device}, but {', '.join(stray)} "
                                    f"live elsewhere; move every tensor of the PersistentKernel to {self.device}")
        self._stop = False
        #: how a step is recorded for replay on this device (None: launched every time); see StepGraph
        self.capture: Callable[[Callable[[], None]], Any] | None = StepGraph.for_device(self.device)
        self._graph: Any = None
        self._capture_failures = 0

    def _begin(self) -> None:
        raise NotImplementedError

    def _commit(self) -> None:
        raise NotImplementedError

    def _sync(self) -> None:
        """Wait for every launch so far (on the CPU, under Triton's interpreter, launches are synchronous)."""
        if self.device.type != "cpu":
            import torch

            torch.accelerator.synchronize(self.device)

    def _profiled(self) -> None:
        """One step's launches, each layer timed on the host after a device sync (start/end ns per task)."""
        import time

        spans: dict[int, tuple[int, int]] = {}
        self._sync()
        origin = time.perf_counter_ns()
        for layer, launch in self.launches:
            start = time.perf_counter_ns() - origin
            launch()
            self._sync()
            end = time.perf_counter_ns() - origin
            lo, _ = spans.get(layer, (start, end))
            spans[layer] = (lo, end)
        out = self.program.profiler_tensor.view(-1)
        graph = self.program.task_graph
        for task in range(min(graph.num_tasks, out.numel() // 3)):
            lo, hi = spans[graph.task_layer[task]]
            out[3 * task], out[3 * task + 1], out[3 * task + 2] = lo, hi, 0  # one stream: one "worker"

    def _step(self) -> None:
        """One decode step's launches: the layers, commit, and the next step's begin."""
        for _, launch in self.launches:
            launch()
        self._commit()
        self._begin()

    def _captured(self) -> Any:
        """The step as a graph, or None after a failed capture: the failed capture ran nothing, so the next step
        runs eagerly (a real launch error raises there) and the capture is tried again; after
        ``CAPTURE_TRIES`` failures this runtime decodes without a graph, which is correct, only slower."""
        try:
            return self.capture(self._step)
        except RuntimeError as exc:  # torch.AcceleratorError, a driver's launch error inside the capture
            self._capture_failures += 1
            last = self._capture_failures >= CAPTURE_TRIES
            logger.warning("recording a decode step as a device graph failed (%s: %s); %s", type(exc).__name__, exc,
                           "decoding without a graph from now on (slower, same tokens)" if last else
                           "running the next step eagerly and recording again")
            if last:
                self.capture = None
            return None

    def value(self, name: str) -> Any:
        return self.values[name]

    def pick(self, logits: Any) -> Any:
        """The picker layer's launches alone on ``logits`` at the current positions (PersistentRuntime.pick)."""
        picker = self.program.picker
        self.values[picker.inputs["input"].name].copy_(logits)
        for layer, launch in self.launches:
            if layer == picker.index:
                launch()
        return self.values[picker.output.name][:, 0]

    def stop(self) -> None:
        """Ask the decode in flight to stop after its current step (the exit hook calls it)."""
        self._stop = True

    def run(self, max_new_tokens: int | None = None) -> int:
        """Decode (see PersistentKernel.__call__); the kernel's lock serializes calls."""
        program = self.program
        self.snapshot.verify()
        limit = program.max_seq_length if max_new_tokens is None else int(max_new_tokens)
        self._stop = False
        self.ctl.zero_()
        steps = 0
        with shutdown.decoding(self):
            try:
                self._begin()
                ctl = self.ctl.tolist()  # the one host read of a step (a sync on an accelerator)
                while steps < limit and not self._stop:
                    if ctl[Ctl.ERROR]:
                        row, tok = ctl[Ctl.ERR_ROW], ctl[Ctl.ERR_VALUE]
                        raise token_out_of_range(row, tok)
                    if ctl[Ctl.ALIVE] == 0:
                        break
                    if steps == 0 and program.profiler_tensor is not None:
                        self._profiled()
                        self._commit()
                        self._begin()
                    elif self._graph is not None:
                        self._graph.replay()
                    else:
                        self._step()
                        if self.capture is not None:  # the kernels are compiled now: record the step once
                            self._graph = self._captured()
                    ctl = self.ctl.tolist()
                    steps += 1
            finally:  # Ctrl-C between two launches: nothing of ours still runs when run() raises
                self._sync()
        if self._stop:
            shutdown.check_not_stopped()
        if steps and ctl[Ctl.STEPS] != steps:
            raise AssertionError(f"the device counted {ctl[Ctl.STEPS]} steps, the host {steps}")  # a runtime bug
        return steps


class LaunchedRuntime(LaunchedSteps):
    """Runs a frozen PersistentProgram as launched Triton kernels on its tensors' device (LaunchedSteps' loop)."""

    def __init__(self, program: PersistentProgram, config: dict[str, int], processors: int = 0) -> None:
        """``processors``: the device's streaming multiprocessors (compute units), as its backend reports them;
        0 where unknown (the GEMV then keeps its fixed blocks: ``_gemv_blocks``)."""
        import torch

        self.tasks = importlib.import_module("yirage.persistent.triton_tasks")  # imports triton: only here
        self.program, self.config, self.processors = program, config, int(processors)
        if program.tokens.dtype != torch.int64 or program.step.dtype != torch.int64:
            raise NotSupportedError("the launched PersistentKernel runtime needs int64 step and tokens tensors")
        self.device = program.tokens.device
        self.values: dict[str, Any] = {}
        for t in program.tensors:
            if t.attached:
                value = program.values[t.name]
            else:
                value = torch.zeros(t.dims, dtype=getattr(torch, t.dtype), device=self.device)
            check_tensor(value, f"the launched runtime's tensor {t.name!r}", self.device.type, written=not t.attached)
            self.values[t.name] = value
        self.by_index = [self.values[t.name] for t in program.tensors]
        self.ctl = torch.zeros(control.size(program.batch), dtype=torch.int64, device=self.device)
        self.eos = torch.tensor(list(program.eos_token_ids) or [-1], dtype=torch.int64, device=self.device)
        self.launches: list[tuple[int, Launch]] = []  # (layer, launch) for one step
        self.xs = torch.zeros(1, device=self.device)
        self.scores = torch.zeros(1, device=self.device)
        TASKS.require(layer.kind for layer in program.layers)
        for layer in program.layers:
            for launch in TASKS.body(layer.kind)(self, layer):
                self.launches.append((layer.index, launch))
        self.snapshot = Snapshot([*self.values.items(), ("step", program.step)])
        self._init_loop()

    # -- descriptor access ------------------------------------------------------------------
    def _int(self, layer: Layer, column: IntCol) -> int:
        return self.program.descriptors.int_value(layer.index, column)

    def _float(self, layer: Layer, column: FloatCol) -> float:
        return self.program.descriptors.float_value(layer.index, column)

    def _arg(self, layer: Layer, role: str) -> Any:
        return self.by_index[self._int(layer, layer.spec.column(role))]

    def _out(self, layer: Layer) -> Any:
        return self.by_index[self._int(layer, IntCol.OUTPUT)]

    def _scratch(self, name: str, count: int) -> Any:
        import torch

        if getattr(self, name).numel() < count:
            setattr(self, name, torch.zeros(count, device=self.device))
        return lambda: getattr(self, name)  # read at launch time: a later layer may have grown it

    # -- one layer's launches ----------------------------------------------------------------
    def _embed(self, layer: Layer) -> list[Launch]:
        p, k = self.program, self.tasks
        n = self._int(layer, IntCol.N)
        out, w, tokens, step = self._out(layer), self._arg(layer, "weight"), p.tokens, p.step
        block = _pow2(n, 1024)
        grid = (p.batch, -(-n // block))
        return [lambda: k.y_embed[grid](out, tokens, step, w, n, tokens.shape[1], w.shape[0], block)]

    def _gemv(self, layer: Layer, x: Callable[[], Any], k_dim: int, w: Any, bias: Any, res: Any) -> Launch:
        b = self.program.batch
        n = self._int(layer, IntCol.N)
        out = self._out(layer)
        bn, bk = self._gemv_blocks(n, k_dim, _pow2(b))
        grid = (-(-n // bn),)
        return lambda: self.tasks.y_gemv[grid](out, x(), w, out if bias is None else bias, out if res is None else res,
                                               n, k_dim, b, _pow2(b), bias is not None, res is not None, bn, bk)

    def _gemv_blocks(self, n: int, k_dim: int, rows: int) -> tuple[int, int]:
        """(BN, BK) of a GEMV: ``GEMV_PROGRAMS_PER_SM`` programs per SM where the backend said how many it has
        (columns per program: a power of two, at most 64), and K tiles of up to ``GEMV_TILE`` // (BN x batch rows)
        elements. 64 columns a program left most SMs idle on the H100 (N = 576: 9 programs; 9.3 us a GEMV where
        the C-family one took 3)."""
        sms = self.processors
        if not sms:
            return _pow2(n, 64), _pow2(k_dim, 128)
        per_program = max(1, n // (GEMV_PROGRAMS_PER_SM * sms))
        bn = min(64, 1 << (per_program.bit_length() - 1))  # a power of two at or below the share
        return bn, _pow2(k_dim, max(128, GEMV_TILE // (bn * rows)))

    def _rmsnorm_linear(self, layer: Layer) -> list[Launch]:
        b, k_dim = self.program.batch, self._int(layer, IntCol.K)
        xs = self._scratch("xs", b * k_dim)
        x, gamma, eps = self._arg(layer, "input"), self._arg(layer, "weight_norm"), self._float(layer, FloatCol.EPS)
        bias = self._arg(layer, "bias") if self._int(layer, layer.spec.column("bias")) >= 0 else None
        bk = _pow2(k_dim, 1024)
        return [lambda: self.tasks.y_rmsnorm[(b,)](xs(), x, gamma, eps, k_dim, bk),
                self._gemv(layer, xs, k_dim, self._arg(layer, "weight_linear"), bias, None)]

    def _linear_with_residual(self, layer: Layer) -> list[Launch]:
        x = self._arg(layer, "input")
        return [self._gemv(layer, lambda: x, self._int(layer, IntCol.K), self._arg(layer, "weight"), None,
                           self._arg(layer, "residual"))]

    def _silu_mul_linear_with_residual(self, layer: Layer) -> list[Launch]:
        b, k_dim = self.program.batch, self._int(layer, IntCol.K)
        xs = self._scratch("xs", b * k_dim)
        gu = self._arg(layer, "input")
        block = _pow2(k_dim, 1024)
        grid = (b, -(-k_dim // block))
        return [lambda: self.tasks.y_silu_mul[grid](xs(), gu, k_dim, block),
                self._gemv(layer, xs, k_dim, self._arg(layer, "weight"), None, self._arg(layer, "residual"))]

    def _attention(self, layer: Layer) -> list[Launch]:
        p, k = self.program, self.tasks
        kv, group, d = (self._int(layer, c) for c in (IntCol.KV_HEADS, IntCol.GROUP, IntCol.HEAD_DIM))
        seq = self._int(layer, IntCol.CACHE_SEQ)
        out, qkv = self._out(layer), self._arg(layer, "input")
        kc, vc, cos, sin = (self._arg(layer, r) for r in ("k_cache", "v_cache", "cos", "sin"))
        bd, bs = _pow2(d), _pow2(seq, 64)
        scale = 1.0 / d**0.5
        return [lambda: k.y_kv_store[(p.batch, kv)](kc, vc, qkv, p.step, cos, sin, kv, group, d, seq, bd),
                lambda: k.y_attention[(p.batch, kv * group)](out, qkv, kc, vc, p.step, cos, sin, scale, kv, group,
                                                              d, seq, bd, bs)]

    def _argmax(self, layer: Layer) -> list[Launch]:
        out, x = self._out(layer), self._arg(layer, "input")
        vocab = self._int(layer, IntCol.K)
        return [lambda: self.tasks.y_argmax[(self.program.batch,)](out, x, vocab, _pow2(vocab, 1024))]

    def _sample(self, layer: Layer) -> list[Launch]:
        p = self.program
        out, x = self._out(layer), self._arg(layer, "input")
        vocab = self._int(layer, IntCol.K)
        scores = self._scratch("scores", p.batch * vocab)
        inv_t = 1.0 / self._float(layer, FloatCol.TEMPERATURE)
        top_p, top_k = self._float(layer, FloatCol.TOP_P), self._int(layer, IntCol.TOP_K)
        seed = self._int(layer, IntCol.SEED)
        top_k = top_k if 0 < top_k < vocab else 0
        bv = _pow2(vocab, 1024)
        return [*self._argmax(layer),  # what a row with nothing to draw from picks
                lambda: self.tasks.y_sample[(p.batch,)](out, scores(), x, p.step, inv_t, top_p, seed, vocab, bv,
                                                        top_k, top_p < 1.0)]

    # -- running ---------------------------------------------------------------------------------
    def _begin(self) -> None:
        p = self.program
        vocab = p.vocab if p.vocab is not None else 2**62
        self.tasks.y_begin[(1,)](self.ctl, p.tokens, p.step, self.eos, p.batch, _pow2(p.batch), p.tokens.shape[1],
                                 p.max_seq_length, vocab, len(p.eos_token_ids))

    def _commit(self) -> None:
        p = self.program
        self.tasks.y_commit[(1,)](p.tokens, p.step, self.ctl, self.by_index[p.pick_id], p.batch, _pow2(p.batch),
                                  p.tokens.shape[1])

#: one layer's launches per LayerSpec kind (the kernels: yirage.persistent.triton_tasks)
TASKS: TaskBodies = register_task_bodies("launched", {
    "embed": LaunchedRuntime._embed, "rmsnorm_linear": LaunchedRuntime._rmsnorm_linear,
    "attention": LaunchedRuntime._attention, "linear_with_residual": LaunchedRuntime._linear_with_residual,
    "silu_mul_linear_with_residual": LaunchedRuntime._silu_mul_linear_with_residual,
    "argmax": LaunchedRuntime._argmax, "sample": LaunchedRuntime._sample,
}, declined={**SINGLE_DEVICE, **NO_SCREEN},
   where="yirage.persistent.launched (a LaunchedRuntime method, named in launched.TASKS) and its kernels to "
         "yirage.persistent.triton_tasks")

__all__ = ["TASKS", "LaunchedRuntime", "LaunchedSteps", "StepGraph"]
