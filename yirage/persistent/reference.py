"""The reference PersistentKernel runtime: every task's body in torch, one task at a time.

It walks the task graph exactly as a single worker would (events, trigger
counts, release order), so it checks the graph as well as the math; it is
the oracle the compiled runtimes are compared with, not a fast path.
"""

from __future__ import annotations

import time
from typing import Any

from yirage.persistent.kernel import PersistentKernel
from yirage.persistent.layers import Layer


class ReferenceRuntime:
    def __init__(self, pk: PersistentKernel, config: dict[str, int]) -> None:
        import torch

        assert pk.task_graph is not None
        self.pk, self.graph, self.config = pk, pk.task_graph, config
        self.values: dict[str, Any] = dict(pk.torch_tensors)
        for t in pk.tensors.values():
            if not t.attached:
                dtype = torch.int64 if t.dtype.startswith("int") else torch.float32
                self.values[t.name] = torch.zeros(t.dims, dtype=dtype, device=pk.tokens.device)  # not ambient
        self.order = self.graph.topological_order()
        self.generator = torch.Generator()
        self.steps_run = 0

    def value(self, name: str) -> Any:
        return self.values[name]

    # -- task bodies --------------------------------------------------------------
    def run_task(self, layer: Layer, t: int) -> None:
        import torch

        pk, v = self.pk, self.values
        out = v[layer.output.name]
        f32 = torch.float32
        if layer.kind in ("argmax", "sample"):
            logits = v[layer.inputs["input"].name].to(f32)
            for b in range(pk.batch):
                out[b, 0] = self._pick(layer, logits[b], b)
            return
        cols = out.shape[1] // layer.out_parts
        lo, hi = layer.write_part(t) * cols, (layer.write_part(t) + 1) * cols
        if layer.kind == "embed":
            weight = v[layer.inputs["weight"].name]
            for b in range(pk.batch):
                out[b, lo:hi] = weight[int(pk.tokens[b, int(pk.step[b])]), lo:hi].to(f32)
        elif layer.kind == "rmsnorm_linear":
            x = v[layer.inputs["input"].name].to(f32)
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.params["eps"])
            xn = xn * v[layer.inputs["weight_norm"].name].to(f32)
            y = xn @ v[layer.inputs["weight_linear"].name][lo:hi].to(f32).t()
            if "bias" in layer.inputs:
                y = y + v[layer.inputs["bias"].name][lo:hi].to(f32)
            out[:, lo:hi] = y
        elif layer.kind in ("linear_with_residual", "silu_mul_linear_with_residual"):
            x = v[layer.inputs["input"].name].to(f32)
            if layer.kind == "silu_mul_linear_with_residual":
                half = x.shape[1] // 2
                x = torch.nn.functional.silu(x[:, :half]) * x[:, half:]
            w = v[layer.inputs["weight"].name][lo:hi].to(f32)
            out[:, lo:hi] = x @ w.t() + v[layer.inputs["residual"].name][:, lo:hi].to(f32)
        elif layer.kind == "attention":
            self._attention(layer, t, out)
        else:
            raise AssertionError(layer.kind)

    def _attention(self, layer: Layer, t: int, out: Any) -> None:
        import torch

        v, p = self.values, layer.params
        kv_heads, group, d = p["kv_heads"], p["group"], p["head_dim"]
        b, g = divmod(t, kv_heads)
        pos = int(self.pk.step[b])
        width = (group + 2) * d
        qkv = v[layer.inputs["input"].name][b, g * width:(g + 1) * width].to(torch.float32)
        q, k, val = qkv[:group * d].view(group, d), qkv[group * d:(group + 1) * d], qkv[(group + 1) * d:]
        cos = v[layer.inputs["cos"].name][pos].to(torch.float32)
        sin = v[layer.inputs["sin"].name][pos].to(torch.float32)

        def rope(x: Any) -> Any:
            return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1) * sin

        q, k = rope(q), rope(k)
        kc, vc = v[layer.inputs["k_cache"].name], v[layer.inputs["v_cache"].name]
        kc[b, g, pos] = k.to(kc.dtype)
        vc[b, g, pos] = val.to(vc.dtype)
        keys, values = kc[b, g, :pos + 1].to(torch.float32), vc[b, g, :pos + 1].to(torch.float32)
        probs = torch.softmax(q @ keys.t() / d**0.5, dim=-1)
        out[b, g * group * d:(g + 1) * group * d] = (probs @ values).reshape(-1)

    def _pick(self, layer: Layer, logits: Any, row: int) -> int:
        import torch

        if layer.kind == "argmax":
            return int(torch.argmax(logits))
        p = layer.params
        scores = logits / p["temperature"]
        if p["top_k"]:
            kth = torch.topk(scores, min(p["top_k"], scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p["top_p"] < 1.0:
            sorted_probs, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < p["top_p"]
            probs = torch.zeros_like(probs).scatter(0, idx, sorted_probs * keep)
        position = int(self.pk.step[row])  # seeded by position, so a run repeats whatever ran before it
        self.generator.manual_seed(p["seed"] * 1_000_003 + position * 7919 + row * 104729 + 1)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))

    # -- the decode loop ------------------------------------------------------------------
    def active_rows(self) -> list[int]:
        pk = self.pk
        return [b for b in range(pk.batch)
                if int(pk.step[b]) + 1 < pk.max_seq_length and int(pk.tokens[b, int(pk.step[b])]) not in
                pk.eos_token_ids]

    def run(self, max_new_tokens: int | None = None) -> int:
        pk, graph = self.pk, self.graph
        picker = self.values[pk.layers[-1].output.name]
        profile = pk.profiler_tensor
        steps = 0
        active = self.active_rows()
        while active and (max_new_tokens is None or steps < max_new_tokens):
            origin = time.perf_counter_ns()
            for task in self.order:
                start = time.perf_counter_ns()
                self.run_task(pk.layers[graph.task_layer[task]], graph.task_index[task])
                if profile is not None and steps == 0 and 3 * task + 2 < profile.numel():
                    profile[3 * task] = start - origin
                    profile[3 * task + 1] = time.perf_counter_ns() - origin
                    profile[3 * task + 2] = 0  # the one worker
            for b in active:
                pos = int(pk.step[b])
                pk.tokens[b, pos + 1] = int(picker[b, 0])
                pk.step[b] = pos + 1
            steps += 1
            self.steps_run += 1
            active = self.active_rows()
        return steps
