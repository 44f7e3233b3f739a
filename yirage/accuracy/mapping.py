"""Fused kernel -> the original ops it replaces, and where its inputs and outputs live among theirs.

Every fused kernel of a dump records ``replaces`` (the unfused ops it stands for, in order) and, for
each activation input and for its output, a *source*: which unfused op tensors, combined how, hold
the same values. ``compare`` assembles the golden tensor from those sources, so a fused kernel is
matched to the unfused run by construction, never by guessing from names.

Sources combine ``parts`` (each ``[op, io, index]``) with ``combine``: "single" (one part), "concat"
(along the last dim) or "qkv_grouped" (q, k, v projections regrouped per kv head as the fused QKV
layout keeps them: ``[q heads of g | k_g | v_g]`` for each kv head g).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from yirage.accuracy.layout import AccuracyError

COMBINES = ("single", "concat", "qkv_grouped")


@dataclass(frozen=True)
class Source:
    parts: tuple[tuple[str, str, int], ...]
    combine: str = "single"
    params: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"parts": [list(p) for p in self.parts], "combine": self.combine, "params": dict(self.params)}

    @classmethod
    def from_json(cls, data: Any) -> Source:
        try:
            parts = tuple((str(op), str(io), int(k)) for op, io, k in data["parts"])
            source = cls(parts, str(data.get("combine", "single")), tuple(sorted(dict(data.get("params", {})).items())))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise AccuracyError(f"a source in the dump's map is malformed ({data!r}); dump again") from None
        if source.combine not in COMBINES or not parts:
            raise AccuracyError(f"a source in the dump's map combines {source.combine!r} over {len(parts)} parts; "
                                f"expected one of {COMBINES} over at least one part; dump again")
        return source

    def label(self) -> str:
        return "+".join(f"{op}.{io}.{k}" for op, io, k in self.parts)


def one(op: str, io: str = "output", index: int = 0) -> Source:
    return Source(((op, io, index),))


@dataclass(frozen=True)
class FusedKernel:
    """One fused kernel: its name (the tensor it writes), kind, replaced ops, input sources and output source."""

    name: str
    kind: str
    replaces: tuple[str, ...]
    inputs: tuple[tuple[str, Source], ...]  # (role, source) for every activation input, in dump order
    output: Source

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "replaces": list(self.replaces),
                "inputs": [{"role": r, **s.to_json()} for r, s in self.inputs], "output": self.output.to_json()}

    @classmethod
    def from_json(cls, data: Any) -> FusedKernel:
        try:
            return cls(str(data["name"]), str(data["kind"]), tuple(str(x) for x in data["replaces"]),
                       tuple((str(i["role"]), Source.from_json(i)) for i in data["inputs"]),
                       Source.from_json(data["output"]))
        except (KeyError, TypeError):
            raise AccuracyError(f"a fused kernel entry of the dump's map is malformed ({data!r}); dump again") \
                from None


def combine(source: Source, arrays: list[np.ndarray]) -> np.ndarray:
    """The golden tensor of ``source`` from its parts' arrays."""
    if source.combine == "single":
        return arrays[0]
    if source.combine == "concat":
        return np.concatenate(arrays, axis=-1)
    q, k, v = arrays
    p = dict(source.params)
    kv_heads, group, d = p["kv_heads"], p["group"], p["head_dim"]
    pieces = []
    for g in range(kv_heads):
        pieces += [q[..., g * group * d:(g + 1) * group * d], k[..., g * d:(g + 1) * d], v[..., g * d:(g + 1) * d]]
    return np.concatenate(pieces, axis=-1)


# -- the Llama decode step (yirage.models.llama.LlamaModel.build_decoder) ------------------------------------
def llama_unfused_ops(layers: int) -> list[str]:
    """The unfused decode step's ops in execution order (Hugging Face module names, without ``model.``)."""
    ops = ["embed_tokens"]
    for i in range(layers):
        p = f"layers.{i}."
        ops += [p + "input_layernorm", p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj",
                p + "self_attn.rotary_emb", p + "self_attn.attention", p + "self_attn.o_proj",
                p + "attn_residual_add", p + "post_attention_layernorm", p + "mlp.gate_proj", p + "mlp.up_proj",
                p + "mlp.act_mul", p + "mlp.down_proj", p + "mlp_residual_add"]
    return ops + ["norm", "lm_head", "sampler"]


def llama_fused_map(config: Any) -> list[FusedKernel]:
    """The fused kernels of LlamaModel.build_decoder (greedy), in execution order, for ``config``."""
    qkv_params = (("group", config.group), ("head_dim", config.head_dim), ("kv_heads", config.kv_heads))
    kernels = [FusedKernel("x0", "embed", ("embed_tokens",), (("input", one("embed_tokens", "input")),),
                           one("embed_tokens"))]
    for i in range(config.layers):
        p = f"layers.{i}."
        q, k, v = (p + f"self_attn.{x}_proj" for x in "qkv")
        qkv = Source(((q, "output", 0), (k, "output", 0), (v, "output", 0)), "qkv_grouped", qkv_params)
        kernels += [
            FusedKernel(f"qkv{i}", "rmsnorm_linear", (p + "input_layernorm", q, k, v),
                        (("input", one(p + "input_layernorm", "input")),), qkv),
            FusedKernel(f"attn{i}", "attention", (p + "self_attn.rotary_emb", p + "self_attn.attention"),
                        (("input", qkv),), one(p + "self_attn.attention")),
            FusedKernel(f"x{i}_mid", "linear_with_residual", (p + "self_attn.o_proj", p + "attn_residual_add"),
                        (("input", one(p + "self_attn.o_proj", "input")),
                         ("residual", one(p + "attn_residual_add", "input"))), one(p + "attn_residual_add")),
            FusedKernel(f"gate_up{i}", "rmsnorm_linear",
                        (p + "post_attention_layernorm", p + "mlp.gate_proj", p + "mlp.up_proj"),
                        (("input", one(p + "post_attention_layernorm", "input")),),
                        Source(((p + "mlp.gate_proj", "output", 0), (p + "mlp.up_proj", "output", 0)), "concat")),
            FusedKernel(f"x{i + 1}", "silu_mul_linear_with_residual",
                        (p + "mlp.act_mul", p + "mlp.down_proj", p + "mlp_residual_add"),
                        (("input", Source(((p + "mlp.act_mul", "input", 0), (p + "mlp.act_mul", "input", 1)),
                                          "concat")),
                         ("residual", one(p + "mlp_residual_add", "input"))), one(p + "mlp_residual_add")),
        ]
    kernels += [FusedKernel("logits", "rmsnorm_linear", ("norm", "lm_head"), (("input", one("norm", "input")),),
                            one("lm_head")),
                FusedKernel("next_token", "argmax", ("sampler",), (("input", one("sampler", "input")),),
                            one("sampler"))]
    return kernels


def check_decoder(kernels: list[FusedKernel], pk: Any) -> None:
    """The built PersistentKernel must have exactly the layers the map describes (kind, output, input roles)."""
    layers = list(pk.layers)
    if len(layers) != len(kernels):
        raise AccuracyError(f"the decoder has {len(layers)} layers but the Llama map describes {len(kernels)}; "
                            "LlamaModel.build_decoder changed: update yirage/accuracy/mapping.py to match")
    for layer, kernel in zip(layers, kernels, strict=True):
        roles = tuple(r for r, t in layer.inputs.items() if not t.attached or t.name == "tokens")
        got = (layer.kind, layer.output.name, roles)
        want = (kernel.kind, kernel.name, tuple(r for r, _ in kernel.inputs))
        if got != want:
            raise AccuracyError(f"decoder layer {layer.index} is {got} (kind, output, activation inputs) but the "
                                f"Llama map expects {want}; update yirage/accuracy/mapping.py to match "
                                "LlamaModel.build_decoder")


# -- kernel graphs (fusion groups of yirage.compiler.fusion) ------------------------------------------------
def graph_op_names(graph: Any) -> dict[int, str]:
    """A unique op name per non-input node: its label and op, e.g. ``t3.matmul`` or ``h.rms_norm``."""
    return {n.id: f"{n.label}.{n.op}" if n.label == f"t{n.id}" else f"{n.label}#{n.id}.{n.op}"
            for n in graph.nodes if n.op != "input"}


def graph_fused_map(graph: Any, groups: list[Any]) -> tuple[list[FusedKernel], list[list[int]]]:
    """One FusedKernel per fusion group, and each group's external input node ids (in first-use order)."""
    names = graph_op_names(graph)
    kernels, externals = [], []
    for g, group in enumerate(groups):
        members = sorted(group.members)
        inputs: list[tuple[str, Source]] = []
        ext: list[int] = []
        for m in members:
            for pos, i in enumerate(graph.nodes[m].inputs):
                if i not in group.members and i not in ext:
                    ext.append(i)
                    inputs.append((f"in{len(ext) - 1}", one(names[m], "input", pos)))
        anchor = graph.nodes[group.anchor].op if group.anchor is not None else "pointwise"
        kernels.append(FusedKernel(f"kernel{g}.{graph.nodes[group.root].label}", f"fused_{anchor}",
                                   tuple(names[m] for m in members), tuple(inputs), one(names[group.root])))
        externals.append(ext)
    return kernels, externals
