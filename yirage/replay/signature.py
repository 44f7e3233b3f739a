"""Input signatures: what makes two calls of a replay engine interchangeable, and the checks behind them.

A recorded plan owns buffers laid out for one set of shapes and dtypes on one
device and backend, so the cache key is exactly that (the *signature*), plus
whether fusion was on when the entry was made. Everything a plan would copy
into its buffers is checked here first: copying would silently convert a
wrong dtype or move a tensor across devices, so those are errors instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from yirage.errors import YirageError

#: what each cache entry runs; see FusedInferEngine's docstring for what they mean on each target
MODES = ("fusion", "graph_replay", "eager")


class ReplayError(YirageError, ValueError):
    """A call or setting a replay engine cannot serve; the message names the cause and the fix."""


@dataclass(frozen=True)
class Signature:
    """Shapes and dtypes of a call's tensors (after bucketing), their device and the backend that runs them."""

    tensors: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype name)
    device: str
    backend: str

    def text(self) -> str:
        parts = [f"{name}[{','.join(map(str, shape))}]:{dtype}" for name, shape, dtype in self.tensors]
        return f"{' '.join(parts)} on {self.device} ({self.backend})"


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def check_plain_tensor(t: Any, what: str, device: str) -> None:
    """A real, dense torch tensor on ``device`` (a type such as "cpu"); anything else raises ReplayError."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise ReplayError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        kind = type(t)
        raise ReplayError(f"{what} is a {kind.__module__}.{kind.__qualname__} (a torch.Tensor subclass): the engine "
                          "copies real memory into its buffers; pass a plain tensor (t.as_subclass(torch.Tensor) if "
                          "it holds its own data, or a plain copy), outside FakeTensorMode and torch.compile tracing")
    if t.is_meta:
        raise ReplayError(f"{what} is a meta tensor: it has a shape but no data; pass a tensor with real storage")
    if t.layout != torch.strided:
        raise ReplayError(f"{what} has layout {t.layout}; pass a dense tensor (e.g. t.to_dense())")
    if t.device.type != device:
        raise ReplayError(f"{what} is on {t.device}, but this engine runs on {device!r} tensors; pass "
                          f"t.to({device!r})")


def check_buckets(buckets: Any) -> tuple[int, ...] | None:
    """None, or strictly increasing positive batch sizes (a call's batch is padded up to the next one)."""
    if buckets is None:
        return None
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) or not buckets:
        raise ReplayError(f"batch_buckets must be None or a non-empty sequence of batch sizes such as (1, 2, 4, 8), "
                          f"got {buckets!r}")
    out = tuple(buckets)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in out) or list(out) != sorted(set(out)):
        raise ReplayError(f"batch_buckets must be strictly increasing positive ints such as (1, 2, 4, 8), got "
                          f"{buckets!r}")
    return out


def bucket_for(batch: int, buckets: tuple[int, ...] | None) -> int:
    """The batch size a call of ``batch`` rows runs at: the smallest bucket that holds it (itself without any)."""
    if buckets is None:
        return batch
    for size in buckets:
        if size >= batch:
            return size
    raise ReplayError(f"a batch of {batch} rows is larger than the largest of batch_buckets={buckets}; add a "
                      f"bucket >= {batch} (e.g. batch_buckets={(*buckets, _next_power_of_two(batch))}) or split the "
                      "batch")


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def check_flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ReplayError(f"{what} must be True or False, got {value!r}")
    return value


def check_count(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ReplayError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value
