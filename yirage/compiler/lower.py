"""Lowering: fusion groups -> kernel IR, with the buffers they read and write; then composites -> primitives."""

from __future__ import annotations

import hashlib
import math

from yirage.compiler.decompose import DECOMPOSITIONS, clamp, decompose_plan
from yirage.compiler.fusion import DEFAULT_POLICY, FusionPolicy, Group, partition
from yirage.compiler.kernel_ir import (
    FUNCTIONS,
    Attention,
    Buffer,
    Call,
    Const,
    Embedding,
    Expr,
    Kernel,
    KernelPlan,
    Load,
    Matmul,
    Pointwise,
    Reduction,
    Row,
    Var,
)
from yirage.graph.kernel_graph import KernelGraph, Node, contiguous_strides

#: pointwise graph ops that lower to the IR function of the same name (composites are rewritten later)
_POINTWISE_FN = frozenset(FUNCTIONS) | frozenset(DECOMPOSITIONS)


class _Lowerer:
    def __init__(self, graph: KernelGraph, policy: FusionPolicy = DEFAULT_POLICY) -> None:
        self.graph = graph
        self.policy = policy
        self.buffers: dict[str, Buffer] = {}
        self.buffer_of: dict[int, str] = {}
        for index, node in enumerate(graph.inputs):
            name = f"in{index}"
            self.buffers[name] = Buffer(name, node.dims, node.dtype, node.strides or (), "input", index)
            self.buffer_of[node.id] = name

    def materialize(self, node: Node) -> str:
        outputs = self.graph.outputs
        if node.id in outputs:
            index = outputs.index(node.id)
            name, role = f"out{index}", "output"
        else:
            name, role, index = f"tmp{node.id}", "temp", -1
        self.buffers[name] = Buffer(name, node.dims, node.dtype, contiguous_strides(node.dims), role, index)
        self.buffer_of[node.id] = name
        return name

    # -- expressions -----------------------------------------------------------
    def expr(self, node_id: int, group: Group, replace: dict[int, Expr]) -> Expr:
        """The expression of ``node_id`` inside ``group``; ``replace`` substitutes nodes."""
        if node_id in replace:
            return replace[node_id]
        if node_id not in group.members:
            return Load(self.buffer_of[node_id])
        node = self.graph.nodes[node_id]
        args = [self.expr(i, group, replace) for i in node.inputs]
        if node.op in _POINTWISE_FN:
            return Call(node.op, tuple(args))
        if node.op == "clamp":
            return clamp(args[0], node.attrs["min_val"], node.attrs["max_val"])
        if node.op == "rotary":
            x = self.buffer_of[node.inputs[0]]
            rotated = Load(x, rotate_half=True)
            return Call("add", (Call("mul", (args[0], args[1])), Call("mul", (rotated, args[2]))))
        raise AssertionError(f"{node.op} is not inlinable")  # fusion only inlines the ops above

    # -- kernels ---------------------------------------------------------------
    def lower(self, group: Group) -> Kernel:
        root = self.graph.nodes[group.root]
        out = self.materialize(root)
        name = f"k{len(self.kernels)}"
        anchor = self.graph.nodes[group.anchor] if group.anchor is not None else None
        if anchor is None:
            return Pointwise(name, out, root.dims, self.expr(root.id, group, {}))
        if anchor.op == "matmul":
            return self.lower_matmul(name, out, group, root, anchor)
        if anchor.op in ("rms_norm", "softmax", "reduction"):
            return self.lower_row(name, out, group, root, anchor)
        if anchor.op == "embedding":
            ids, table = (self.graph.nodes[i] for i in anchor.inputs)
            return Embedding(name, out, self.buffer_of[ids.id], self.buffer_of[table.id],
                             math.prod(ids.dims), table.dims[0], table.dims[1])
        if anchor.op == "attention":
            q, k = self.graph.nodes[anchor.inputs[0]], self.graph.nodes[anchor.inputs[1]]
            lengths = self.buffer_of[anchor.inputs[3]] if len(anchor.inputs) > 3 else None
            b, h, d = q.dims
            scale = anchor.attrs["scale"] if anchor.attrs["scale"] is not None else 1.0 / math.sqrt(d)
            q_in, q_eps, q_gain = self.normed(group, "q", q)
            k_in, k_eps, k_gain = self.normed(group, "k", k)
            return Attention(name, out, q_in, k_in, self.buffer_of[anchor.inputs[2]], lengths, b, h, k.dims[1],
                             k.dims[2], d, scale, k_eps, k_gain, q_eps, q_gain)
        raise AssertionError(anchor.op)

    def normed(self, group: Group, side: str, operand: Node) -> tuple[str, float | None, str | None]:
        """Attention's ``side`` ("q" or "k") operand: (the buffer it reads, the fused RMSNorm's eps, the gain's
        buffer), the last two None where nothing is fused (QK-norm: fusion.NORM_ROLES)."""
        roles = {role: self.graph.nodes[i] for i, role in group.norms.items()}
        if side not in roles:
            return self.buffer_of[operand.id], None, None
        rms, gain = roles[side], None
        if f"{side} gain" in roles:
            (w,) = [i for i in roles[f"{side} gain"].inputs if i != rms.id]  # fusion.gain_of
            gain = self.buffer_of[w]
        return self.buffer_of[rms.inputs[0]], float(rms.attrs["eps"]), gain

    def lower_matmul(self, name: str, out: str, group: Group, root: Node, anchor: Node) -> Matmul:
        a_id, b_id = anchor.inputs
        replace: dict[int, Expr] = {}
        row_scale = None
        eps = 0.0
        if group.rms is not None:
            rms = self.graph.nodes[group.rms]
            row_scale = self.expr(rms.inputs[0], group, {})
            replace[rms.id] = row_scale
            eps = rms.attrs["eps"]
        a = self.expr(a_id, group, replace)
        acc: Expr = Var("acc")
        if row_scale is not None:
            acc = Call("mul", (acc, Var("scale")))
        epilogue = self.expr(root.id, group, {anchor.id: acc})
        b = self.graph.nodes[b_id]
        m, k, n = anchor.dims[-2], b.dims[-2], anchor.dims[-1]
        return Matmul(name, out, anchor.dims[:-2], m, n, k, a, self.buffer_of[b_id], epilogue, row_scale, eps)

    def lower_row(self, name: str, out: str, group: Group, root: Node, anchor: Node) -> Row:
        (src,) = anchor.inputs
        x = self.expr(src, group, {})
        space = self.graph.nodes[src].dims
        if anchor.op == "reduction":
            axis = anchor.attrs["dim"] % len(space)
            reductions = (Reduction("r", "sum", x),)
            value: Expr = Var("r")
            per_row = True
        elif anchor.op == "softmax":
            axis = anchor.attrs["dim"] % len(space)
            shifted = Call("exp", (Call("sub", (x, Var("m"))),))
            reductions = (Reduction("m", "max", x), Reduction("s", "sum", shifted))
            value = Call("div", (shifted, Var("s")))
            per_row = False
        else:  # rms_norm over the last dim
            axis = len(space) - 1
            mean = Call("div", (Var("ss"), Const(float(space[-1]))))
            reductions = (Reduction("ss", "sum", Call("square", (x,))),)
            value = Call("mul", (x, Call("rsqrt", (Call("add", (mean, Const(anchor.attrs["eps"]))),))))
            per_row = False
        return Row(name, out, space, axis, reductions, self.expr(root.id, group, {anchor.id: value}), per_row)

    @property
    def kernels(self) -> list[Kernel]:
        return self._kernels

    def plan(self) -> KernelPlan:
        self._kernels: list[Kernel] = []
        for group in partition(self.graph, self.policy):
            self._kernels.append(self.lower(group))
        outputs = []
        for index, node_id in enumerate(self.graph.outputs):
            node = self.graph.nodes[node_id]
            if node.op == "input":  # an input marked as output: copy it
                name = f"out{index}"
                strides = contiguous_strides(node.dims)
                self.buffers[name] = Buffer(name, node.dims, node.dtype, strides, "output", index)
                copy = Pointwise(f"k{len(self._kernels)}", name, node.dims, Load(self.buffer_of[node_id]))
                self._kernels.append(copy)
                outputs.append(name)
            else:
                outputs.append(self.buffer_of[node_id])
        inputs = [f"in{i}" for i in range(len(self.graph.inputs))]
        digest = self.graph.digest
        if self.policy != DEFAULT_POLICY:  # another plan of the same graph: its own digest
            digest = hashlib.sha256(f"{digest} {self.policy.name}".encode()).hexdigest()
        return KernelPlan(digest, self.buffers, self._kernels, inputs, outputs)


def build_plan(graph: KernelGraph, policy: FusionPolicy = DEFAULT_POLICY) -> KernelPlan:
    """Fuse (as ``policy`` allows) and lower ``graph``; it must have at least one output."""
    from yirage.graph.ops import GraphError

    if not graph.outputs:
        raise GraphError("the kernel graph has no outputs: call g.mark_output(t) before running or compiling it")
    return decompose_plan(_Lowerer(graph, policy).plan())
