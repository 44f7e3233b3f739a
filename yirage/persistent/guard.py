"""Checks on the torch tensors a PersistentKernel hands to compiled code as raw addresses.

Compiled runtimes reach attached tensors (weights, KV caches, RoPE tables)
and the meta tensors (step, tokens) through ``data_ptr()`` and a row-major
layout they assume. A strided or broadcast view, a tensor subclass without
real storage (FakeTensor), a negated/conjugate view, or a tensor replaced in
place after building (``set_``, ``resize_``) would make them read or write
memory that is not the tensor's. ``check_tensor`` refuses such tensors when
they are handed over; ``Snapshot`` records what was handed over and is
re-checked before every compiled run, so an in-place replacement is an error,
not a use-after-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from yirage.persistent.layers import LayerError

REBUILD = ("compiled code holds the old address: do not replace tensors in place (set_, resize_, "
           "storage swaps) after building; rebuild the PersistentKernel (InferEngine: reset_cache) instead")


def byte_range(t: Any) -> tuple[int, int]:
    """[first, last) byte addresses a contiguous tensor covers."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_tensor(t: Any, what: str, device_type: str, written: bool = False) -> None:
    """Refuse a tensor compiled code cannot address safely; ``what`` names it in the error."""
    import torch

    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise LayerError(f"{what}: expected a plain torch.Tensor, got {type(t).__module__}.{type(t).__name__}; "
                         "compiled code reads real memory, so pass a materialised tensor (not a FakeTensor or "
                         "other subclass)")
    if t.device.type != device_type:
        raise LayerError(f"{what}: the tensor is on {t.device}; this backend reads {device_type} tensors "
                         f"(move it with .to({device_type!r}))")
    if t.layout != torch.strided:
        raise LayerError(f"{what}: layout {t.layout} is not supported; pass a dense tensor (.to_dense())")
    if t.is_neg() or t.is_conj():
        raise LayerError(f"{what}: a lazily negated/conjugated view would be read without its sign; "
                         "materialise it with .resolve_neg().resolve_conj() (or .clone())")
    if written and t.requires_grad:
        raise LayerError(f"{what}: requires_grad=True, but decoding writes it in place and does not track "
                         "gradients; pass a plain buffer (.detach() or torch.zeros(...))")
    if not t.is_contiguous() or any(s == 0 for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        raise LayerError(f"{what}: shape {tuple(t.shape)} strides {t.stride()} is not contiguous row-major "
                         "(a transposed, sliced or expanded view); pass .contiguous() (for meta tensors: a fresh "
                         "torch.zeros(...) buffer you keep)")
    if t.numel() and (t.storage_offset() + t.numel()) * t.element_size() > t.untyped_storage().nbytes():
        raise LayerError(f"{what}: the tensor reaches past the end of its storage "
                         f"({t.untyped_storage().nbytes()} bytes); pass a fresh contiguous tensor (.clone())")


def refuse_dispatch_modes(action: str) -> None:
    """Refuse to build or run compiled code under a torch dispatch mode (FakeTensorMode, ...).

    Under such a mode every tensor the runtime creates or touches goes
    through the mode (fake or meta tensors without real memory), while the
    compiled code reads and writes raw addresses.
    """
    import torch

    count = getattr(torch._C, "_len_torch_dispatch_stack", None)
    if count is None or not count():
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    raise LayerError(f"{action} while the torch dispatch mode {type(mode).__name__ if mode else '(unknown)'} is "
                     "active: compiled code reads and writes real memory, which tensors under such a mode (e.g. "
                     "FakeTensorMode) do not have; call it outside FakeTensorMode (or any other dispatch mode)")


def check_disjoint(tensors: Iterable[tuple[str, Any, bool]]) -> None:
    """Tensors compiled code writes (flag True) must not share bytes with any other handed-over tensor."""
    # meta tensors own no memory, so nothing can alias them (only a backend whose device is meta, a test double for
    # device placement, gets them past check_tensor)
    items = [(name, byte_range(t), written) for name, t, written in tensors if t.numel() and not t.is_meta]
    for i, (name, (lo, hi), written) in enumerate(items):
        if not written:
            continue
        for j, (other, (olo, ohi), _) in enumerate(items):
            if i != j and lo < ohi and olo < hi:
                raise LayerError(f"{name!r} overlaps {other!r} in memory, and decoding writes {name!r}; "
                                 "give each of them its own buffer (.clone())")


class Snapshot:
    """What compiled code was given: address, shape, strides, dtype and storage size of each tensor.

    It keeps a reference to every tensor and to the storage each one had
    when handed over (``untyped_storage()``), for as long as the snapshot
    (the compiled runtime) lives. So a tensor whose storage is swapped out
    (``set_``) by another thread while a run is in flight keeps the old
    memory alive: the run finishes in memory nobody else owns, and the next
    ``verify()`` raises, naming the tensor. Cost: a few attribute reads per
    tensor, once per compiled run.

    Not defensible: resizing a storage in place (``untyped_storage().resize_``
    or ``resize_`` that grows a tensor) concurrently with a run reallocates
    the very memory the run is using; the next ``verify()`` reports it, but
    the run in flight may already have touched freed memory. Do not mutate
    handed-over tensors from another thread while the kernel runs.
    """

    def __init__(self, named: Iterable[tuple[str, Any]]) -> None:
        self.entries = [(name, t, self._state(t)) for name, t in named]
        self.storages = [t.untyped_storage() for _, t, _ in self.entries]  # keeps the handed-over memory alive
        self.needs = [(t.storage_offset() + t.numel()) * t.element_size() if t.numel() else 0
                      for _, t, _ in self.entries]

    @staticmethod
    def _state(t: Any) -> tuple[Any, ...]:
        return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device

    def verify(self) -> None:
        """Every tensor as handed over, its storage still as large. Runs before every compiled run (a short
        prompt's generate runs two or three): a few attribute reads per tensor, about 1 us. The storage asked
        is the one kept: a storage swapped out (``set_``) moves ``data_ptr``, one resized in place is this one."""
        state = self._state
        for (name, t, was), storage, need in zip(self.entries, self.storages, self.needs, strict=True):
            now = state(t)
            if now != was:
                fields = ("address", "shape", "strides", "dtype", "device")
                changed = ", ".join(f"{f} {tuple(a) if f == 'shape' else a} -> {tuple(b) if f == 'shape' else b}"
                                    for f, a, b in zip(fields, was, now, strict=True) if a != b)
                raise LayerError(f"tensor {name!r} changed after the PersistentKernel was built ({changed}); "
                                 + REBUILD)
            if storage.nbytes() < need:
                raise LayerError(f"tensor {name!r}: its storage shrank to {storage.nbytes()} bytes, "
                                 f"it needs {need}; " + REBUILD)


def token_out_of_range(row: int, token: int) -> LayerError:
    """What every compiled runtime raises when its decode found a token id outside the embed table."""
    return LayerError(f"tokens[{row}, step[{row}]] = {token} is not a row of the embed table; decoding stopped "
                      "before reading it (tokens/step hold the steps completed). Keep token ids within the "
                      "embed table (the picker's logits must not be wider than it)")
