"""Dump a model's decode steps (fused PersistentKernel or unfused float64) or a kernel graph's tensors.

A model dump runs a fixed token sequence with teacher forcing: step ``t``
feeds ``ids[:, t]`` at position ``t`` (the fused side overwrites the token
its kernel picked), so both sides see the same inputs at every step even
when one of them would have picked another token; the picked token is
dumped as the sampler's output. Every step runs (the KV caches need it);
only the selected ones are written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from yirage.accuracy.layout import AccuracyError, DumpWriter, Selection
from yirage.accuracy.mapping import (
    FusedKernel,
    check_decoder,
    graph_fused_map,
    graph_op_names,
    llama_fused_map,
    llama_unfused_ops,
)

DEFAULT_STEPS = 4


def prompt_ids(vocab: int, ids: Any = None, steps: int = DEFAULT_STEPS, batch: int = 1, seed: int = 0) -> Any:
    """The token sequence (B, T) to run: ``ids`` (a list, a list of rows or a tensor) or seeded random ids."""
    import torch

    if ids is None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or not isinstance(batch, int) \
                or batch < 1:
            raise AccuracyError(f"steps={steps!r} and batch={batch!r} must be ints >= 1")
        return torch.randint(0, vocab, (batch, steps), generator=torch.Generator().manual_seed(seed))
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):
        raise AccuracyError(f"ids={ids!r} must be token ids: a list of ints or a (batch, len) list of rows") \
            from None
    if t.numel() and (_has_non_int(ids) or t.dtype == torch.bool or t.dtype.is_floating_point
                      or t.dtype.is_complex):  # an empty list is a float tensor: refused below as empty
        raise AccuracyError(f"ids={ids!r} must be int token ids (no floats or booleans, which would be truncated "
                            "or read as 0/1): a list of ints or a (batch, len) list of rows, e.g. [[1, 2], [3, 4]]")
    t = t.to(torch.int64)
    t = t[None] if t.dim() == 1 else t
    if t.dim() != 2 or t.numel() == 0 or int(t.min()) < 0 or int(t.max()) >= vocab:
        raise AccuracyError(f"ids must be a non-empty (batch, len) list of token ids in [0, {vocab}) (the model's "
                            f"vocab_size), got shape {tuple(t.shape)}")
    return t


def _has_non_int(ids: Any) -> bool:
    """A leaf of a nested list that is not an int (a bool is one to Python and to torch.as_tensor, which would
    silently run True as token 1; a float mixed with ints is truncated)."""
    if isinstance(ids, (list, tuple)):
        return any(_has_non_int(x) for x in ids)
    return isinstance(ids, (bool, float))


def _op_groups(kernels: list[FusedKernel]) -> dict[str, list[str]]:
    """Unfused op -> [itself, the fused kernel replacing it]: the names an ops regex is matched against."""
    groups: dict[str, list[str]] = {}
    for k in kernels:
        for op in k.replaces:
            groups[op] = [op, k.name]
    return groups


def dump_model(model_path: str | os.PathLike[str], output: str | os.PathLike[str], backend: Any = "cpu",
               unfused: bool = False, tokens: Any = None, mode: str = "all", ops: str | None = None,
               ids: Any = None, steps: int = DEFAULT_STEPS, batch: int = 1, seed: int = 0, dtype: Any = None,
               model: Any = None) -> Path:
    """Dump every selected decode step of a Llama-family model; returns the dump directory.

    Fused (default): LlamaModel.build_decoder's PersistentKernel on ``backend``, one step per call, every
    fused kernel's activation inputs and output read back by name. ``unfused=True``: yirage.accuracy.unfused
    (torch float64, op by op). ``tokens`` selects steps ("all" or e.g. [0, 2]), ``mode`` input/output/all,
    ``ops`` a regex over op names (an unfused op also matches by the name of the fused kernel replacing it,
    a fused kernel by the names of the ops it replaces). ``model``: an already loaded LlamaModel.
    """
    import torch

    from yirage.engine import load_model

    selection = Selection(mode, tokens, ops)
    if model is None:  # the fused dump decodes on the backend: its weights and caches live there
        from yirage.backend.selection import resolve
        from yirage.models.placement import Placement

        placement = None if unfused else Placement.of_backend(resolve(backend, "dump_model(backend=...)",
                                                                      need="persistent"))
        model = load_model(model_path, dtype, placement)
    c = model.config
    seq = prompt_ids(c.vocab, ids, steps, batch, seed)
    b, n = seq.shape
    if selection.tokens is not None and max(selection.tokens) >= n:
        raise AccuracyError(f"tokens={list(selection.tokens)} selects steps past the {n} token steps this dump runs "
                            f"(0..{n - 1}); pick steps below {n} or run more (steps=, or longer ids)")
    kernels = llama_fused_map(c)
    meta = {"source": "model", "model": str(model_path), "dtype": str(dtype or "checkpoint"), "mode": mode,
            "tokens": "all" if selection.tokens is None else list(selection.tokens), "ops": ops,
            "ids": seq.tolist()}
    if unfused:
        from yirage.accuracy.unfused import UnfusedLlama

        groups = _op_groups(kernels)
        writer = DumpWriter(output, {**meta, "kind": "unfused", "backend": "torch-float64",
                                     "op_order": llama_unfused_ops(c.layers)})
        golden = UnfusedLlama(model, b, n)
        for t in range(n):
            def record(op: str, inputs: list[Any], outputs: list[Any], t: int = t) -> None:
                if selection.wants_token(t) and selection.wants_op(groups.get(op, [op])):
                    for io, values in (("input", inputs), ("output", outputs)):
                        if selection.wants_io(io):
                            for k, value in enumerate(values):
                                writer.write(t, op, io, k, value)
            golden.step(seq[:, t:t + 1], t, record)
        return writer.close()

    model.reset_cache(b, n + 1)
    token_buf = torch.zeros(b, n + 1, dtype=torch.int64, device=model.device)
    token_buf[:, :n] = seq
    step = torch.zeros(b, dtype=torch.int64, device=model.device)
    pk = model.build_decoder(step, token_buf, backend=backend, eos_token_id=None)
    check_decoder(kernels, pk)
    writer = DumpWriter(output, {**meta, "kind": "fused", "backend": pk.backend.name,
                                 "map": [k.to_json() for k in kernels]})
    for t in range(n):
        current = token_buf[:, t:t + 1].clone()
        pk(max_new_tokens=1)
        if t + 1 < n:
            token_buf[:, t + 1] = seq[:, t + 1]  # teacher forcing: the next step reads the given token
        if not selection.wants_token(t):
            continue
        for layer, kernel in zip(pk.layers, kernels, strict=True):
            if not selection.wants_op([kernel.name, *kernel.replaces]):
                continue
            if selection.wants_io("input"):
                for k, (role, _) in enumerate(kernel.inputs):
                    name = layer.inputs[role].name
                    writer.write(t, kernel.name, "input", k, current if name == "tokens" else pk.read(name), role)
            if selection.wants_io("output"):
                writer.write(t, kernel.name, "output", 0, pk.read(kernel.name), "output")
    return writer.close()


def dump_graph(graph: Any, inputs: list[Any], output: str | os.PathLike[str], backend: Any = "cpu",
               unfused: bool = False, mode: str = "all", ops: str | None = None) -> Path:
    """Dump a kernel graph as token 0: fused on ``backend`` (one entry per fusion group: its external inputs and
    output) or unfused (``unfused=True``: every op on its own, torch float64, yirage.reference.graph's ops)."""
    import torch

    from yirage.compiler.fusion import partition
    from yirage.graph.ops import OPS

    selection = Selection(mode, None, ops)
    if len(inputs) != len(graph.inputs):
        raise AccuracyError(f"the graph has {len(graph.inputs)} inputs but {len(inputs)} tensors were passed")
    groups = partition(graph)
    kernels, externals = graph_fused_map(graph, groups)
    names = graph_op_names(graph)
    meta = {"source": "graph", "model": f"kernel graph {graph.digest[:16]}", "dtype": "graph", "mode": mode,
            "tokens": [0], "ops": ops}
    values: dict[int, Any] = {}
    if unfused:
        writer = DumpWriter(output, {**meta, "kind": "unfused", "backend": "torch-float64",
                                     "op_order": [names[n.id] for n in graph.nodes if n.op != "input"]})
        owner = {op: [op, k.name] for k in kernels for op in k.replaces}
        for node, t in zip(graph.inputs, inputs, strict=True):
            values[node.id] = t.to(torch.float64) if node.dtype.is_float else t
        for node in graph.nodes:
            if node.op == "input":
                continue
            args = [values[i] for i in node.inputs]
            values[node.id] = OPS[node.op].reference(*args, **node.attrs)
            if selection.wants_op(owner.get(names[node.id], [names[node.id]])):
                _write_io(writer, selection, names[node.id], args, values[node.id])
        return writer.close()

    wide = graph.copy()  # every group's result as an output: group roots are materialized anyway
    for group in groups:
        if group.root not in wide.outputs:
            wide.outputs.append(group.root)
    if [sorted(g.members) for g in partition(wide)] != [sorted(g.members) for g in groups]:
        raise AccuracyError("reading every fused kernel's output would change the graph's fusion groups; dump the "
                            "graph's outputs only (compare its marked outputs) or report this graph as a bug")
    results = wide.run(list(inputs), backend=backend)
    values = {node.id: t for node, t in zip(graph.inputs, inputs, strict=True)}
    values.update(dict(zip(wide.outputs, results, strict=True)))
    writer = DumpWriter(output, {**meta, "kind": "fused", "backend": str(getattr(backend, "name", backend)),
                                 "map": [k.to_json() for k in kernels]})
    for kernel, ext, group in zip(kernels, externals, groups, strict=True):
        if selection.wants_op([kernel.name, *kernel.replaces]):
            _write_io(writer, selection, kernel.name, [values[i] for i in ext], values[group.root],
                      [r for r, _ in kernel.inputs])
    return writer.close()


def _write_io(writer: DumpWriter, selection: Selection, op: str, inputs: list[Any], output: Any,
              roles: list[str] | None = None) -> None:
    if selection.wants_io("input"):
        for k, value in enumerate(inputs):
            writer.write(0, op, "input", k, value, roles[k] if roles else "")
    if selection.wants_io("output"):
        writer.write(0, op, "output", 0, output, "output")
