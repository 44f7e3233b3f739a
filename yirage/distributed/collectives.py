"""The collectives a tensor-parallel decode step calls between layers, with errors that name rank and layer.

Each helper runs one torch.distributed collective on the process group
``init_world`` created, waits for it at most the group's timeout, and turns a
failure into a DistributedError naming this rank, the caller's label
("layer 7 o_proj all-reduce") and, when it can tell, the rank that is gone.
To tell, the surviving ranks check in under a key for the failed collective in
the rendezvous store and wait a short grace period: ranks that never check in
died or are stuck before that collective. (Every rank issues the same
collectives in the same order, so a per-process counter names the collective.)
After such an error the process group is unusable: the rank should exit, and
torchrun then stops the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from yirage.distributed.world import DistributedError, _Group, current_group

#: longest wait (s) for the surviving ranks to check in after a failed collective (a quarter of the timeout
#: when that is shorter): enough for peers that saw the same failure, short beside any useful timeout
GRACE_S = 5.0
#: seconds per slice of a wait that can be interrupted (``stop=``): how late a stopped rank notices
SLICE_S = 0.1


def _check_label(label: Any) -> str:
    if not isinstance(label, str) or not label.strip():
        raise DistributedError(f"label={label!r}: pass a short description of the collective, e.g. 'layer 7 o_proj "
                               "all-reduce', so a failure says where it happened")
    return label


def _tensor(tensor: Any, what: str, label: str) -> Any:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise DistributedError(f"{label}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise DistributedError(f"{label}: {what} {tuple(tensor.shape)} is not contiguous (strides "
                               f"{tensor.stride()}); collectives move raw buffers: pass tensor.contiguous()")
    return tensor


def _missing_ranks(group: _Group, seq: int) -> str:
    """After collective ``seq`` failed: which ranks did not check in within the grace period."""
    me, n = group.world.rank, group.world.world_size
    grace = min(GRACE_S, max(0.5, group.timeout_s / 4))
    key = f"alive/{seq}/"
    try:
        group.store.set(key + str(me), "1")
        pending = [r for r in range(n) if r != me]
        deadline = time.monotonic() + grace
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if not group.store.check([key + str(r)])]
            if pending:
                time.sleep(0.05)
    except (RuntimeError, OSError) as exc:  # the store went away with the rank that served it
        host = f"{group.world.master_addr}:{group.world.master_port}"
        return (f"the rendezvous store at {host} is unreachable too ({type(exc).__name__}); the rank serving it "
                "(rank 0, unless torchrun's agent serves it) has probably died")
    if not pending:
        return "every other rank saw the failure too (a network problem, or a mismatch between the ranks' calls)"
    which = ", ".join(map(str, pending))
    return (f"rank{'s' if len(pending) > 1 else ''} {which} did not answer within {grace:g} s: "
            f"{'they' if len(pending) > 1 else 'it'} died or {'are' if len(pending) > 1 else 'is'} stuck before "
            "this collective (see that rank's log)")


class CollectiveInterrupted(DistributedError):
    """A collective abandoned because the run was asked to stop (Ctrl-C) while it waited for the other ranks."""


def _wait(work: Any, timeout: float, stop: Callable[[], bool] | None) -> None:
    """``work.wait`` for at most ``timeout`` s; with ``stop``, in slices of SLICE_S that re-check it."""
    from datetime import timedelta

    if stop is None:
        work.wait(timeout=timedelta(seconds=timeout))
        return
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=max(0.001, min(SLICE_S, left))))
            return
        except RuntimeError as exc:  # gloo: "Operation timed out!"; the collective goes on and can be waited again
            if "timed out" not in str(exc).lower() or left <= SLICE_S:
                raise
        if stop():
            raise CollectiveInterrupted("stopped while waiting for the other ranks")


def _run(label: str, start: Any, timeout_s: float | None, stop: Callable[[], bool] | None = None) -> None:
    """Start a collective (``start()`` returns its Work), wait at most the timeout, explain a failure.

    ``stop``: checked between slices of the wait (a decode interrupted by Ctrl-C stops waiting for its peers).
    """
    group = current_group()
    if group.broken:
        raise DistributedError(f"{group.world}: {label}: the process group is out of step ({group.broken}); stop "
                               "every rank and start the run again")
    group.calls += 1
    seq = group.calls
    timeout = group.timeout_s if timeout_s is None else float(timeout_s)
    try:
        work = start()
        _wait(work, timeout, stop)
    except CollectiveInterrupted as exc:
        group.broken = f"{label} was interrupted"
        raise CollectiveInterrupted(f"{group.world}: {label} was interrupted (the run was stopped, e.g. by Ctrl-C) "
                                    "while waiting for the other ranks; the ranks are out of step now: stop every "
                                    "rank and start the run again") from exc
    except RuntimeError as exc:  # DistBackendError / DistNetworkError / gloo's timeout are RuntimeErrors
        timed_out = "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower()
        how = f"timed out after {timeout:g} s" if timed_out else "failed: a peer closed the connection"
        raise DistributedError(
            f"{group.world}: {label} {how}; {_missing_ranks(group, seq)}. The run cannot go on: stop every rank "
            f"(torchrun does when one exits with an error); raise YIRAGE_DIST_TIMEOUT if a rank is just slow. "
            f"[{group.collective}: {type(exc).__name__}: {str(exc)[:300]}]") from exc


def all_reduce_(tensor: Any, label: str, timeout_s: float | None = None, stop: Callable[[], bool] | None = None
                ) -> Any:
    """Sum ``tensor`` over the ranks, in place (row-parallel O and down projections); returns it.

    ``stop``: a callable checked while waiting (in slices); True abandons the wait with CollectiveInterrupted.
    """
    import torch.distributed as dist

    label = _check_label(label)
    tensor = _tensor(tensor, "the tensor", label)
    if not tensor.is_floating_point():
        raise DistributedError(f"{label}: all_reduce_ sums partial results: pass a float tensor, got {tensor.dtype}")
    _run(label, lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True), timeout_s, stop)
    return tensor


def all_gather_parts(parts: list[Any], tensor: Any, label: str, timeout_s: float | None = None,
                     stop: Callable[[], bool] | None = None) -> list[Any]:
    """Every rank's ``tensor`` into ``parts`` (one preallocated tensor per rank, rank order). Unlike
    all_gather_rows the shapes are not exchanged first: the caller guarantees one shape on every rank (a
    compiled decode step, whose buffers are fixed when it is built)."""
    import torch.distributed as dist

    label = _check_label(label)
    tensor = _tensor(tensor, "the tensor", label)
    n = current_group().world.world_size
    if len(parts) != n or any(p.shape != tensor.shape or p.dtype != tensor.dtype or not p.is_contiguous()
                              for p in parts):
        raise DistributedError(f"{label}: all_gather_parts needs {n} contiguous tensors shaped like the input "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
    _run(label, lambda: dist.all_gather(parts, tensor, async_op=True), timeout_s, stop)
    return parts


def all_gather_rows(tensor: Any, label: str, dim: int = 0, timeout_s: float | None = None) -> Any:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order (all ranks pass the same shape)."""
    import torch
    import torch.distributed as dist

    label = _check_label(label)
    tensor = _tensor(tensor, "the tensor", label)
    n = current_group().world.world_size
    if not 1 <= tensor.dim() <= 7 or not -tensor.dim() <= dim < tensor.dim():
        raise DistributedError(f"{label}: all_gather_rows takes a tensor of 1 to 7 dims and a dim inside it, got "
                               f"shape {tuple(tensor.shape)} and dim={dim}")
    shape = torch.tensor([tensor.dim(), *tensor.shape, *[0] * (7 - tensor.dim())], dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(n)]
    _run(label + " (shapes)", lambda: dist.all_gather(shapes, shape, async_op=True), timeout_s)
    differ = [r for r, s in enumerate(shapes) if not torch.equal(s, shape)]
    if differ:
        got = {r: tuple(shapes[r][1:1 + int(shapes[r][0])].tolist()) for r in range(n)}
        raise DistributedError(f"{current_group().world}: {label}: the ranks pass tensors of different shapes "
                               f"{got}; all_gather_rows needs one shape on every rank (pad the last shard)")
    parts = [torch.empty_like(tensor) for _ in range(n)]
    _run(label, lambda: dist.all_gather(parts, tensor, async_op=True), timeout_s)
    return torch.cat(parts, dim=dim)


def argmax_shards(logits: Any, vocab_start: int, label: str, valid: int | None = None,
                  timeout_s: float | None = None) -> tuple[Any, Any]:
    """(value, global index) of the largest logit over every rank's vocabulary shard, as ``torch.argmax`` would
    give on the full logits: ties go to the lowest index and a NaN wins (the first NaN), since each rank takes its
    shard's first maximum and the ranks hold ascending vocabulary ranges.

    ``logits``: (..., shard width) for the vocabulary rows ``vocab_start`` .. ; ``valid``: how many leading
    columns are real (the rest pad the last shard; default all). Returns float64 values and int64 indices
    of shape ``logits.shape[:-1]``.
    """
    import torch
    import torch.distributed as dist

    label = _check_label(label)
    logits = _tensor(logits, "the logits", label)
    width = int(logits.shape[-1]) if logits.dim() else 0
    valid = width if valid is None else valid
    if logits.dim() < 1 or not logits.is_floating_point() or not 0 <= valid <= width or vocab_start < 0:
        raise DistributedError(f"{label}: argmax_shards needs float logits (..., shard width) with 0 <= valid <= "
                               f"width and vocab_start >= 0; got {tuple(logits.shape)} {logits.dtype}, "
                               f"valid={valid}, vocab_start={vocab_start}")
    lead = tuple(logits.shape[:-1])
    if valid == 0:  # an empty last shard: loses to every real logit, -inf included (its index is the largest)
        local = torch.stack([torch.full(lead, float("-inf"), dtype=torch.float64),
                             torch.full(lead, float(vocab_start), dtype=torch.float64)], -1)
    else:
        real = logits[..., :valid]
        idx = torch.argmax(real, dim=-1)
        val = torch.gather(real, -1, idx[..., None])[..., 0]
        local = torch.stack([val.to(torch.float64), (idx + vocab_start).to(torch.float64)], -1).contiguous()
    parts = [torch.empty_like(local) for _ in range(current_group().world.world_size)]
    _run(label, lambda: dist.all_gather(parts, local, async_op=True), timeout_s)
    stacked = torch.stack(parts)  # (ranks, ..., 2)
    winner = torch.argmax(stacked[..., 0], dim=0, keepdim=True)  # first NaN, else first (lowest-rank) maximum
    best = torch.gather(stacked, 0, winner[..., None].expand(1, *lead, 2))[0]
    return best[..., 0], best[..., 1].to(torch.int64)
