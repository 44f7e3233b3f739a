"""Fusion: partition a kernel graph into groups, one fused kernel per group.

A node is inlined into its consumer's group when it has exactly one live
consumer and the group can absorb it:

* pointwise ops fuse into pointwise consumers, into the rows of a row op
  (prologue) and into the A operand of a matmul (prologue);
* one anchor (matmul or row op) per group; pointwise consumers over the
  anchor's whole output become its epilogue (``silu(a) * b + r`` is one
  kernel, and so is ``matmul + residual``);
* an RMSNorm reaching a matmul's A operand through multiplications (its
  weight) fuses as a per-row scale applied after the matmul, as in Mirage;
* an RMSNorm that is attention's query or key operand (QK-norm), alone or
  times a gain over the head dim (Qwen3's, Gemma 3's), fuses into the
  attention, which normalizes each query and key row as it reads it;
* embedding and attention are otherwise kernels of their own; RoPE's rotated
  operand and matmul B operands are always read from memory.

Everything else is materialized in a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from yirage.graph.kernel_graph import KernelGraph, Node
from yirage.graph.ops import OPS


@dataclass(frozen=True)
class FusionPolicy:
    """Which inlinings ``partition`` may make. The default (everything allowed) is the fusion of every compile;
    the superoptimizer (yirage.superopt) also tries the others, since the best split depends on the
    shapes and the backend (a prologue recomputed per tile can cost more than a buffer)."""

    chains: bool = True  # pointwise ops into pointwise consumers
    prologue: bool = True  # pointwise ops into a row op's rows or a matmul's A operand
    epilogue: bool = True  # pointwise consumers of a matmul or row op over its whole output
    rms_scale: bool = True  # an RMSNorm into a matmul as a per-row scale, or into attention (QK-norm)

    @property
    def name(self) -> str:
        """"fuse-all", or the inlinings turned off ("no-prologue+no-rms-scale")."""
        off = [f"no-{f.replace('_', '-')}" for f in ("chains", "prologue", "epilogue", "rms_scale")
               if not getattr(self, f)]
        return "+".join(off) or "fuse-all"

    @staticmethod
    def all() -> list[FusionPolicy]:
        """Every policy, the default first."""
        flags = [(a, b, c, d) for a in (True, False) for b in (True, False) for c in (True, False)
                 for d in (True, False)]
        return [FusionPolicy(*f) for f in flags]


DEFAULT_POLICY = FusionPolicy()


@dataclass
class Group:
    root: int
    members: set[int] = field(default_factory=set)
    anchor: int | None = None
    rms: int | None = None  # an rms_norm fused into the anchor matmul as a row scale
    #: QK-norm fused into an attention anchor: node -> its role, "q" / "k" (an rms_norm of that operand) or
    #: "q gain" / "k gain" (the mul of a gain over it, then the operand)
    norms: dict[int, str] = field(default_factory=dict)
    rotary: bool = False  # rotate_half reads are only rendered in pure elementwise kernels


def kind(node: Node) -> str:
    return "input" if node.op == "input" else OPS[node.op].kind


def live_nodes(graph: KernelGraph) -> set[int]:
    live: set[int] = set()
    stack = list(graph.outputs)
    while stack:
        i = stack.pop()
        if i not in live:
            live.add(i)
            stack.extend(graph.nodes[i].inputs)
    return live


def _a_dims(graph: KernelGraph, matmul: Node) -> tuple[int, ...]:
    """The matmul's A operand as its prologue iterates it: batch + (M, K)."""
    return matmul.dims[:-2] + graph.nodes[matmul.inputs[0]].dims[-2:]


def _path_is_multiplicative(graph: KernelGraph, start: int, group: Group, users: dict[int, list[int]]) -> bool:
    """From ``start`` to the group's matmul A operand: only mul, or div as the numerator."""
    current = start
    while len(users[current]) == 1:
        nxt = users[current][0]
        node = graph.nodes[nxt]
        if nxt == group.anchor:
            return node.inputs[0] == current and node.inputs[1] != current
        if nxt not in group.members:
            return False
        if node.op == "mul" or (node.op == "div" and node.inputs[0] == current):
            current = nxt
            continue
        return False
    return False


def _can_inline(graph: KernelGraph, n: Node, c: Node, group: Group, users: dict[int, list[int]],
                policy: FusionPolicy = DEFAULT_POLICY) -> str | None:
    """How ``n`` joins ``c``'s group: "member", "anchor", "rms", a QK-norm role (``Group.norms``), or None
    (``policy`` may forbid each way)."""
    how = _inline_kind(graph, n, c, group, users)
    if how == "anchor" and not policy.epilogue or how in ("rms", *NORM_ROLES) and not policy.rms_scale:
        return None
    if how == "member":
        into_anchor = kind(c) != "pointwise" or group.anchor is not None
        if into_anchor and not policy.prologue or not into_anchor and not policy.chains:
            return None
    return how


def _inline_kind(graph: KernelGraph, n: Node, c: Node, group: Group, users: dict[int, list[int]]) -> str | None:
    kn, kc = kind(n), kind(c)
    root = graph.nodes[group.root]
    if group.anchor is not None and graph.nodes[group.anchor].op == "attention":
        return _into_attention(graph, n, c, group, users)
    if kn == "pointwise":
        if n.op == "rotary" and (group.anchor is not None or kc != "pointwise"):
            return None  # RoPE's rotated read only exists in elementwise kernels
        if kc == "pointwise":
            if c.op == "rotary" and c.inputs[0] == n.id:
                return None  # rotate_half reads its operand at another index: keep it in memory
            return "member"
        if kc == "row":
            return "member"
        if kc == "matmul":
            is_a = c.inputs[0] == n.id and c.inputs[1] != n.id
            return "member" if is_a and n.dims == _a_dims(graph, c) else None
        return None
    if kn in ("row", "matmul"):
        if kc == "pointwise" and group.anchor is None and not group.rotary and c.dims == n.dims == root.dims:
            if c.op == "rotary" and c.inputs[0] == n.id:
                return None
            return "anchor"
        if (
            n.op == "rms_norm"
            and group.rms is None
            and group.anchor is not None
            and graph.nodes[group.anchor].op == "matmul"
            and (c.id == group.anchor or c.id in group.members)
            and n.dims == _a_dims(graph, graph.nodes[group.anchor])
            and _path_is_multiplicative(graph, n.id, group, users)
        ):
            return "rms"
    return None


NORM_ROLES = ("q", "k", "q gain", "k gain")


def _into_attention(graph: KernelGraph, n: Node, c: Node, group: Group, users: dict[int, list[int]]) -> str | None:
    """An attention kernel reads buffers; what it takes in is the RMSNorm of its query or key operand: the operand
    itself, or the norm under a gain mul that is the operand (``gain_of``). Its role (``Group.norms``) or None."""
    attention = graph.nodes[group.anchor]
    if c.id == group.anchor:
        if n.id not in attention.inputs[:2] or attention.inputs.count(n.id) != 1:
            return None  # the values, or an operand read twice (q = k): kept in memory
        side = "q" if attention.inputs[0] == n.id else "k"
        if n.op == "mul" and gain_of(graph, n, users) is not None:
            return f"{side} gain"
    elif group.norms.get(c.id, "").endswith(" gain"):
        side = group.norms[c.id][0]
    else:
        return None
    return side if n.op == "rms_norm" and side not in group.norms.values() else None


def gain_of(graph: KernelGraph, mul: Node, users: dict[int, list[int]]) -> tuple[Node, Node] | None:
    """(the RMSNorm, the gain) where ``mul`` is ``rms_norm(k) * w`` (either order) with ``w`` over the last dim
    only (shape (D,), or 1s then D) and the norm read by nothing else; else None."""
    if mul.op != "mul" or mul.inputs[0] == mul.inputs[1]:
        return None
    for norm_id, w_id in (mul.inputs, mul.inputs[::-1]):
        norm, w = graph.nodes[norm_id], graph.nodes[w_id]
        over_last = w.dims[-1:] == mul.dims[-1:] and all(d == 1 for d in w.dims[:-1])
        alone = users[norm_id] == [mul.id] and norm_id not in graph.outputs
        if norm.op == "rms_norm" and norm.dims == mul.dims and over_last and alone:
            return norm, w
    return None


def partition(graph: KernelGraph, policy: FusionPolicy = DEFAULT_POLICY) -> list[Group]:
    """Groups in execution order (by root id: nodes are topologically ordered)."""
    live = live_nodes(graph)
    users = {i: [u for u in us if u in live] for i, us in graph.consumers().items()}
    outputs = set(graph.outputs)
    group_of: dict[int, Group] = {}
    groups: list[Group] = []
    for n in reversed(graph.nodes):
        if n.op == "input" or n.id not in live:
            continue
        group: Group | None = None
        how = None
        if n.id not in outputs and len(users[n.id]) == 1:
            c = graph.nodes[users[n.id][0]]
            candidate = group_of.get(c.id)
            if candidate is not None:
                how = _can_inline(graph, n, c, candidate, users, policy)
                if how is not None:
                    group = candidate
        if group is None:
            group = Group(root=n.id, rotary=n.op == "rotary")
            groups.append(group)
            if kind(n) != "pointwise":
                group.anchor = n.id
        elif how == "anchor":
            group.anchor = n.id
        elif how == "rms":
            group.rms = n.id
        elif how in NORM_ROLES:
            group.norms[n.id] = how
        group.members.add(n.id)
        group.rotary = group.rotary or n.op == "rotary"
        group_of[n.id] = group
    return sorted(groups, key=lambda g: g.root)
