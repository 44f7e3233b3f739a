"""The reference PersistentKernel runtime: every task's body in torch, one task at a time.

It walks the task graph exactly as a single worker would (events, trigger
counts, release order), so it checks the graph as well as the math; it is
the oracle the compiled runtimes are compared with, not a fast path. It reads
only the frozen PersistentProgram, and each layer through its descriptor row
(the same named columns the compiled runtimes read), so a wrong encoder shows
up here too. Its only per-kind code is the table of task bodies.
"""

from __future__ import annotations

import time
from typing import Any

from yirage.backend.runtime_contract import SERIAL
from yirage.persistent import shutdown
from yirage.persistent.layers import Layer
from yirage.persistent.program import PersistentProgram
from yirage.persistent.runtime import SINGLE_DEVICE, TaskBodies, register_task_bodies
from yirage.persistent.specs import SCREEN_OVERFLOW, SCREEN_UNDERFLOW, FloatCol, IntCol
from yirage.quant import FORMATS as QUANT_FORMATS
from yirage.quant import dequantize


class ReferenceRuntime:
    """The oracle (see the module docstring); it ignores ``num_workers``/``num_local_schedulers`` (``SERIAL``)."""

    kind = SERIAL

    def __init__(self, program: PersistentProgram, config: dict[str, int]) -> None:
        import torch

        self.program, self.graph, self.config = program, program.task_graph, config
        TASKS.require(layer.kind for layer in program.layers)
        self.values: dict[str, Any] = dict(program.values)
        for t in program.tensors:
            if t.dtype in QUANT_FORMATS:  # the oracle reads quantized weights as their float32 values
                self.values[t.name] = dequantize(self.values[t.name], t.dtype, t.dims[1])
            if not t.attached:
                dtype = torch.int64 if t.dtype.startswith("int") else torch.float32
                self.values[t.name] = torch.zeros(t.dims, dtype=dtype, device=program.tokens.device)  # not ambient
        self.names = [t.name for t in program.tensors]  # descriptor tensor index -> name
        self.order = self.graph.topological_order()
        self.generator = torch.Generator(device=program.tokens.device)  # multinomial draws on the tensors' device
        self.steps_run = 0
        self._stop = False

    def value(self, name: str) -> Any:
        return self.values[name]

    def stop(self) -> None:
        """Ask the decode in flight to stop before its next task (the step in flight is not committed)."""
        self._stop = True

    # -- descriptor access ------------------------------------------------------------
    def _int(self, layer: Layer, column: IntCol) -> int:
        return self.program.descriptors.int_value(layer.index, column)

    def _float(self, layer: Layer, column: FloatCol) -> float:
        return self.program.descriptors.float_value(layer.index, column)

    def _arg(self, layer: Layer, role: str) -> Any:
        """The value of input ``role``, found through the layer's descriptor row."""
        return self.values[self.names[self._int(layer, layer.spec.column(role))]]

    # -- task bodies --------------------------------------------------------------
    def run_task(self, layer: Layer, t: int) -> None:
        out = self.values[self.names[self._int(layer, IntCol.OUTPUT)]]
        cols = out.shape[1] // layer.out_parts
        lo, hi = layer.write_part(t) * cols, (layer.write_part(t) + 1) * cols
        TASKS.body(layer.kind)(self, layer, t, out, lo, hi)

    def _embed(self, layer: Layer, t: int, out: Any, lo: int, hi: int) -> None:
        import torch

        p = self.program
        weight = self._arg(layer, "weight")
        for b in range(p.batch):
            out[b, lo:hi] = weight[int(p.tokens[b, int(p.step[b])]), lo:hi].to(torch.float32)

    def _rmsnorm_linear(self, layer: Layer, t: int, out: Any, lo: int, hi: int) -> None:
        import torch

        f32 = torch.float32
        x = self._arg(layer, "input").to(f32)
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._float(layer, FloatCol.EPS))
        xn = xn * self._arg(layer, "weight_norm").to(f32)
        y = xn @ self._arg(layer, "weight_linear")[lo:hi].to(f32).t()
        if self._int(layer, layer.spec.column("bias")) >= 0:
            y = y + self._arg(layer, "bias")[lo:hi].to(f32)
        out[:, lo:hi] = y

    def _linear_with_residual(self, layer: Layer, t: int, out: Any, lo: int, hi: int, x: Any = None) -> None:
        import torch

        f32 = torch.float32
        x = self._arg(layer, "input").to(f32) if x is None else x
        w = self._arg(layer, "weight")[lo:hi].to(f32)
        out[:, lo:hi] = x @ w.t() + self._arg(layer, "residual")[:, lo:hi].to(f32)

    def _silu_mul_linear_with_residual(self, layer: Layer, t: int, out: Any, lo: int, hi: int) -> None:
        import torch

        gate_up = self._arg(layer, "input").to(torch.float32)
        half = self._int(layer, IntCol.K)
        x = torch.nn.functional.silu(gate_up[:, :half]) * gate_up[:, half:]
        self._linear_with_residual(layer, t, out, lo, hi, x)

    def _attention(self, layer: Layer, t: int, out: Any, lo: int, hi: int) -> None:
        import torch

        kv_heads, group = self._int(layer, IntCol.KV_HEADS), self._int(layer, IntCol.GROUP)
        d = self._int(layer, IntCol.HEAD_DIM)
        b, g = divmod(t, kv_heads)
        pos = int(self.program.step[b])
        width = (group + 2) * d
        qkv = self._arg(layer, "input")[b, g * width:(g + 1) * width].to(torch.float32)
        q, k, val = qkv[:group * d].view(group, d), qkv[group * d:(group + 1) * d], qkv[(group + 1) * d:]
        cos = self._arg(layer, "cos")[pos].to(torch.float32)
        sin = self._arg(layer, "sin")[pos].to(torch.float32)

        def rope(x: Any) -> Any:
            return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1) * sin

        q, k = rope(q), rope(k)
        kc, vc = self._arg(layer, "k_cache"), self._arg(layer, "v_cache")
        kc[b, g, pos] = k.to(kc.dtype)
        vc[b, g, pos] = val.to(vc.dtype)
        keys, values = kc[b, g, :pos + 1].to(torch.float32), vc[b, g, :pos + 1].to(torch.float32)
        probs = torch.softmax(q @ keys.t() / d**0.5, dim=-1)
        out[b, g * group * d:(g + 1) * group * d] = (probs @ values).reshape(-1)

    def _screened_logits(self, layer: Layer, t: int, out: Any, lo: int, hi: int) -> None:
        """The exact logits where the screen says a row can be the maximum, -inf elsewhere (every row exact where
        the screen or its bound is not finite, or the bound reaches SCREEN_OVERFLOW):
        PersistentKernel.screened_logits_layer."""
        import torch

        f32 = torch.float32
        x = self._arg(layer, "hidden").to(f32)
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._float(layer, FloatCol.EPS))
        xn = xn * self._arg(layer, "weight_norm").to(f32)
        exact = xn @ self._arg(layer, "weight").to(f32).t()
        screen = self._arg(layer, "input").to(torch.float64)
        bound = self._arg(layer, "row_bound").to(torch.float64)[None] * xn.abs().to(torch.float64).sum(-1, keepdim=True)
        bound = bound + x.shape[1] * SCREEN_UNDERFLOW
        keep = screen + bound >= (screen - bound).max(-1, keepdim=True).values
        trusted = (torch.isfinite(screen) & torch.isfinite(bound) & (bound < SCREEN_OVERFLOW)).all(-1, keepdim=True)
        out[:, lo:hi] = torch.where(keep | ~trusted, exact, torch.full_like(exact, -torch.inf))

    def _argmax(self, layer: Layer, t: int, out: Any, lo: int, hi: int) -> None:
        import torch

        logits = self._arg(layer, "input").to(torch.float32)
        for b in range(self.program.batch):
            out[b, 0] = int(torch.argmax(logits[b]))

    def _sample(self, layer: Layer, t: int, out: Any, lo: int, hi: int) -> None:
        import torch

        logits = self._arg(layer, "input").to(torch.float32)
        temperature, top_p = self._float(layer, FloatCol.TEMPERATURE), self._float(layer, FloatCol.TOP_P)
        top_k, seed = self._int(layer, IntCol.TOP_K), self._int(layer, IntCol.SEED)
        for row in range(self.program.batch):
            scores = logits[row] / temperature
            if top_k:
                kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if top_p < 1.0:
                sorted_probs, idx = torch.sort(probs, descending=True)
                keep = torch.cumsum(sorted_probs, 0) - sorted_probs < top_p
                probs = torch.zeros_like(probs).scatter(0, idx, sorted_probs * keep)
            position = int(self.program.step[row])  # seeded by position, so a run repeats whatever ran before it
            self.generator.manual_seed(seed * 1_000_003 + position * 7919 + row * 104729 + 1)
            out[row, 0] = int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))

    def pick(self, logits: Any) -> Any:
        """The picker layer alone on ``logits`` at the current positions (see PersistentRuntime.pick)."""
        p = self.program
        self.values[p.picker.inputs["input"].name].copy_(logits)
        for task in self.order:
            if p.layers[self.graph.task_layer[task]] is p.picker:
                self.run_task(p.picker, self.graph.task_index[task])
        return self.values[p.picker.output.name][:, 0].to(self.program.tokens.dtype)

    # -- the decode loop ------------------------------------------------------------------
    def active_rows(self) -> list[int]:
        p = self.program
        return [b for b in range(p.batch)
                if int(p.step[b]) + 1 < p.max_seq_length and int(p.tokens[b, int(p.step[b])]) not in
                p.eos_token_ids]

    def _step(self, profile: Any) -> None:
        """One step's tasks in the task graph's order (each task's start and end into ``profile``, where given),
        until a stop."""
        p, graph = self.program, self.graph
        origin = time.perf_counter_ns()
        for task in self.order:
            if self._stop:
                return
            start = time.perf_counter_ns()
            self.run_task(p.layers[graph.task_layer[task]], graph.task_index[task])
            if profile is not None and 3 * task + 2 < profile.numel():
                profile[3 * task] = start - origin
                profile[3 * task + 1] = time.perf_counter_ns() - origin
                profile[3 * task + 2] = 0  # the one worker

    def run(self, max_new_tokens: int | None = None) -> int:
        p = self.program
        picker = self.values[p.picker.output.name]
        profile = p.profiler_tensor
        steps = 0
        self._stop = False
        with shutdown.decoding(self):
            active = self.active_rows()
            while active and (max_new_tokens is None or steps < max_new_tokens) and not self._stop:
                self._step(profile if steps == 0 else None)
                if self._stop:
                    break  # a stopped step is not committed (as the cpu runtime)
                for b in active:
                    pos = int(p.step[b])
                    p.tokens[b, pos + 1] = int(picker[b, 0])
                    p.step[b] = pos + 1
                steps += 1
                self.steps_run += 1
                active = self.active_rows()
        if self._stop:
            shutdown.check_not_stopped()  # stopped by the exit hook: an incomplete result is an error
        return steps


#: the task bodies by LayerSpec kind (the oracle's only per-kind code)
TASKS: TaskBodies = register_task_bodies("reference", {
    "embed": ReferenceRuntime._embed, "rmsnorm_linear": ReferenceRuntime._rmsnorm_linear,
    "attention": ReferenceRuntime._attention, "linear_with_residual": ReferenceRuntime._linear_with_residual,
    "silu_mul_linear_with_residual": ReferenceRuntime._silu_mul_linear_with_residual,
    "argmax": ReferenceRuntime._argmax, "sample": ReferenceRuntime._sample,
    "screened_logits": ReferenceRuntime._screened_logits,
}, declined=SINGLE_DEVICE, where="yirage.reference.persistent (a ReferenceRuntime method, named in its TASKS)")
