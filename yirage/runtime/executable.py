"""Executable: a kernel graph compiled for one backend, with checked inputs and outputs.

Compiled code reads raw addresses, so every tensor that crosses this boundary
is checked: its exact type (plain tensors and nn.Parameter only: FakeTensor
and other subclasses have no data of their own or logic that raw reads would
skip), dtype, shape, layout, device, sign bit, and a storage that really holds
the view. What a backend's ``run`` returns is checked too, so a plugin's bug
is reported with the plugin's name instead of reaching the user.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from yirage.backend.base import Backend
from yirage.compiler.kernel_ir import KernelPlan
from yirage.errors import BackendError, DeviceMemoryError, NotSupportedError, YirageError
from yirage.graph.kernel_graph import KernelGraph, contiguous_strides

_grad_warned = False  # the autograd warning is given once per process


class InputError(YirageError, ValueError):
    """A tensor passed to a compiled graph that does not match its declaration."""


class BackendOutputError(BackendError, RuntimeError):
    """A backend's compiled ``run`` returned outputs that do not match the graph (a bug in its plugin)."""


#: outputs at least this large (bytes) are checked against the device's free memory before each call
ROOM_CHECK_BYTES = 1 << 28


def _extent(dims: Sequence[int], strides: Sequence[int]) -> int:
    """Offset of the last element of a view, in elements (torch strides are never negative)."""
    return sum((d - 1) * s for d, s in zip(dims, strides, strict=True) if d > 1)


class Executable:
    """Call with a list of torch tensors (one per graph input); returns the outputs as a list.

    Inputs must be plain ``torch.Tensor`` objects or ``nn.Parameter`` with real storage, laid out as
    declared. Compiled graphs do not propagate autograd: inputs with ``requires_grad=True`` are read
    as constants (as ``t.detach()`` would be), the outputs never require grad, and yirage warns once
    per process (UserWarning). Pass ``t.detach()`` to say you know.
    """

    def __init__(self, graph: KernelGraph, plan: KernelPlan, backend: Backend,
                 run: Callable[[Sequence[Any]], list[Any]], compile_seconds: float) -> None:
        import torch

        self.graph = graph
        self.plan = plan
        self.backend = backend
        self.compile_seconds = compile_seconds
        self._run = run
        self._device = torch.device(backend.torch_device).type  # "cuda:1" compares as "cuda"
        self._checks = []
        for index, node in enumerate(graph.inputs):
            big = tuple(i for i, d in enumerate(node.dims) if d > 1)
            strides = node.strides or contiguous_strides(node.dims)
            self._checks.append((index, node.label, node.dims, node.dtype.torch, node.dtype.name,
                                 big, tuple(strides[i] for i in big)))
        self._outs = [(torch.Size(n.dims), n.dtype.torch) for n in graph.output_nodes]
        #: bytes of the outputs a call allocates, when large enough to check against free memory first
        out_bytes = sum(math.prod(n.dims) * n.dtype.itemsize for n in graph.output_nodes)
        self._big_outputs = out_bytes if out_bytes >= ROOM_CHECK_BYTES else 0
        self._fast_ok, self._call = _specialize(self, graph)

    def _slow(self, inputs: Sequence[Any]) -> list[Any]:
        """Anything the specialized guard did not accept: check it all, then run with plain tensors."""
        import torch

        self.check(inputs)  # raises with the precise cause
        inputs = _plain(inputs)
        out = self._run(inputs)
        if type(out) is not list or len(out) != len(self._outs):
            raise self._bad_outputs(out)
        for o, (dims, dtype) in zip(out, self._outs, strict=True):
            if type(o) is not torch.Tensor or o.dtype is not dtype or o.shape != dims or \
                    o.device.type != self._device:
                raise self._bad_outputs(out)
        return out

    def check(self, inputs: Sequence[Any]) -> None:
        """Raise InputError naming the first input compiled code cannot read safely, and the fix."""
        import torch

        if not isinstance(inputs, (list, tuple)):
            raise InputError(f"inputs must be a list of torch tensors, got {type(inputs).__name__}")
        _check_no_dispatch_mode()
        if len(inputs) != len(self._checks):
            raise InputError(
                f"the graph has {len(self._checks)} input(s) but {len(inputs)} tensor(s) were passed; "
                "pass one tensor per g.new_input(...), in declaration order"
            )
        for (index, label, dims, dtype, dtype_name, big, strides), t in zip(self._checks, inputs, strict=True):
            what = f"input {index} ({label})"
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                raise InputError(_subclass_message(what, t))
            if _functorch_wrapped(t):
                raise InputError(
                    f"{what} is wrapped by a torch.func transform (torch.vmap, torch.func.grad, jacrev...): it has "
                    "no storage of its own, and compiled kernels read raw memory and record no gradients. Call "
                    "the graph outside the transform, on the whole batch at once (declare the batched shape "
                    "with new_input)")
            if t.is_meta:
                raise InputError(f"{what} is a meta tensor: it has a shape but no data; pass a tensor with "
                                 f"real storage on {self._device!r}")
            if t.is_conj():
                raise InputError(f"{what} is a conjugate view, which compiled code would read unconjugated; "
                                 "pass t.resolve_conj()")
            if t.is_neg():
                raise InputError(f"{what} is a negative view (from t._neg_view() or the .imag of a conjugate), "
                                 "whose sign compiled code would not apply; pass t.resolve_neg()")
            if t.layout != torch.strided:
                raise InputError(f"{what} has layout {t.layout}; pass a dense tensor (e.g. t.to_dense())")
            if t.dtype != dtype:
                raise InputError(
                    f"{what} has dtype {t.dtype}, but the graph declares {dtype_name}; pass t.to(torch.{dtype_name})"
                )
            if tuple(t.shape) != dims:
                raise InputError(f"{what} has shape {tuple(t.shape)}, but the graph declares {dims}")
            got = t.stride()
            if tuple(got[i] for i in big) != strides:
                raise InputError(
                    f"{what} has strides {got}, but the graph declares "
                    f"{self.graph.inputs[index].strides}; pass t.contiguous() (or a tensor laid out as declared), "
                    "or declare its layout with new_input(..., strides=...)"
                )
            if t.device.type != self._device:
                raise InputError(
                    f"{what} is on device {t.device}, but backend {self.backend.name!r} "
                    f"reads {self._device} tensors; pass t.to({self._device!r})"
                )
            _check_memory(what, t)

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        if self._big_outputs:
            self._check_room()
        return self._call(inputs)  # see _specialize: the guarded fast path, else _slow

    def _check_room(self) -> None:
        """Refuse a call whose outputs alone exceed the device's free memory, before anything is allocated (a
        broadcast such as (2**17, 1) + (1, 2**17) declares 64 GiB; allocating it would swap or meet the OOM
        killer). Backends that cannot report their memory are not checked."""
        try:
            free = self.backend.memory_info().free
        except NotSupportedError:  # the backend cannot tell: nothing to compare against
            return
        if free is not None and self._big_outputs > free:
            shapes = ", ".join(str(tuple(dims)) for dims, _ in self._outs)
            raise DeviceMemoryError(
                f"the graph's outputs ({shapes}) need {self._big_outputs / 2**30:.1f} GiB, but backend "
                f"{self.backend.name!r} reports {free / 2**30:.1f} GiB free on its device; check the shapes (a "
                "broadcast of a column and a row makes their product), or compute it in pieces")

    def capturable(self) -> Executable:
        """The same graph through the backend's graph-capturable call path (no host sync or read in a call).

        Inputs are still checked on the host first. Bad input found on the device (an out-of-range id)
        is recorded there and raised by ``check_status()`` or the next ordinary call, not by the call.
        """
        make = getattr(self._run, "capturable", None)
        if make is None:
            raise NotSupportedError(f"backend {self.backend.name!r} has no capturable call path; call the "
                                    "executable directly (backends with one: cuda)")
        return Executable(self.graph, self.plan, self.backend, make(), self.compile_seconds)

    def check_status(self) -> None:
        """Raise the bad-input error an earlier capturable call recorded on the device, if any."""
        check = getattr(self._run, "check_status", None)
        if check is not None:
            check()

    def _bad_outputs(self, out: Any) -> BackendOutputError:
        """Say which output is wrong, and which backend and plugin made it."""
        import torch

        expected = ", ".join(f"{tuple(dims)} {str(dtype).removeprefix('torch.')}" for dims, dtype in self._outs)
        if type(out) is not list:
            problem = (f"returned {type(out).__name__} {repr(out)[:80]}, but run must return a list of "
                       f"{len(self._outs)} tensor(s)")
        elif len(out) != len(self._outs):
            problem = f"returned {len(out)} output(s), but the graph has {len(self._outs)}"
        else:
            k, o = next(((k, o) for k, (o, (dims, dtype)) in enumerate(zip(out, self._outs, strict=True)) if not (
                type(o) is torch.Tensor and o.dtype is dtype and o.shape == dims
                and o.device.type == self._device)), (0, out[0]))
            got = (f"{type(o).__name__} {tuple(o.shape)} {str(o.dtype).removeprefix('torch.')} on {o.device}"
                   if isinstance(o, torch.Tensor) else f"a {type(o).__name__}")
            problem = f"returned output {k} as {got}"
        return BackendOutputError(
            f"backend {self.backend.name!r} (from {plugin_of(self.backend)}) {problem}; graph "
            f"{self.plan.digest[:12]} declares outputs [{expected}] on {self._device!r}. This is a bug in "
            "the plugin: report it to its authors, and compile with another backend meanwhile "
            "(e.g. g.compile('reference'))"
        )

    def __repr__(self) -> str:
        return f"<Executable {self.plan.digest[:12]} on {self.backend.name}: {len(self.plan.kernels)} kernel(s)>"


def _specialize(exe: Executable, graph: KernelGraph) -> tuple[Callable[[Any], bool], Callable[[Any], list[Any]]]:
    """The per-call guard, generated for this graph: straight-line checks with the dims, dtypes and byte
    counts written in, so a small graph's call costs a few attribute reads. (On W3's 16-element add, these
    checks cost +0.35 us over the old, weaker guard as generated code, +1.4 us as a loop over spec tuples.)
    Returns ``fast_ok(inputs) -> bool`` and ``call(inputs) -> outputs``. ``run`` gets a fresh list of the
    checked tensors, so a caller's list changed by another thread after the check cannot reach it.

    Accepted without ``check``: exactly torch.Tensor or nn.Parameter (FakeTensor and other subclasses fail),
    strided, the declared dtype, shape and strides, no autograd, no sign bit, on the backend's device, not
    wrapped by a torch.func transform (vmap, grad: no storage), with a non-null storage that holds the whole
    view. Outputs: a list of exactly the declared tensors.
    """
    import torch

    device = exe._device
    on_device = (lambda v: f"{v}.is_cpu") if device == "cpu" else (lambda v: f"{v}.device.type == DEV")
    env: dict[str, Any] = {"__name__": __name__, "T": torch.Tensor, "P": torch.nn.Parameter, "S": torch.strided,
                           "DEV": device, "run": exe._run, "slow": exe._slow, "bad": exe._bad_outputs,
                           "MODES": torch._C._len_torch_dispatch_stack,
                           "WRAPPED": getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                                              lambda t: False)}
    conds = ["not MODES()"]  # a dispatch mode (FakeTensorMode) would hand run() fake outputs to write into
    for k, node in enumerate(graph.inputs):
        t, dims = f"t{k}", node.dims
        env[f"D{k}"] = node.dtype.torch
        strides = node.strides or contiguous_strides(dims)
        big = [i for i, d in enumerate(dims) if d > 1]
        if [strides[i] for i in big] == [contiguous_strides(dims)[i] for i in big]:
            layout = [f"{t}.is_contiguous()"]
        else:
            layout = [f"(s{k} := {t}.stride())[{big[0]}] == {strides[big[0]]}"]
            layout += [f"s{k}[{i}] == {strides[i]}" for i in big[1:]]
        need = (_extent(dims, strides) + 1) * node.dtype.itemsize  # bytes from the storage offset on
        conds.append(" and ".join([
            f"(type({t}) is T or type({t}) is P)", f"{t}.layout is S", f"{t}.dtype is D{k}", f"{t}.shape == {dims!r}",
            f"not {t}.requires_grad", f"not {t}.is_neg()", *layout, on_device(t), f"not WRAPPED({t})",
            f"{t}.untyped_storage().nbytes() >= {t}.storage_offset() * {node.dtype.itemsize} + {need}",
            f"{t}.data_ptr()",
        ]))
    outs = [f"len(out) == {len(graph.outputs)}"]
    for k, node in enumerate(graph.output_nodes):
        env[f"O{k}"] = node.dtype.torch
        outs.append(f"type(o{k} := out[{k}]) is T and o{k}.dtype is O{k} and o{k}.shape == {node.dims!r} "
                    f"and {on_device(f'o{k}')}")
    n = len(graph.inputs)
    names = ", ".join(f"t{k}" for k in range(n))
    unpack = f"{names}, = inputs" if n else "pass"
    source = f"""
def fast_ok(inputs):
    if (type(inputs) is list or type(inputs) is tuple) and len(inputs) == {n}:
        {unpack}
        return bool({" and ".join(conds)})
    return False

def call(inputs):
    if (type(inputs) is list or type(inputs) is tuple) and len(inputs) == {n}:
        {unpack}
        if {" and ".join(conds)}:
            out = run([{names}])
            if type(out) is list and {" and ".join(outs)}:
                return out
            raise bad(out)
    return slow(inputs)
"""
    exec(compile(source, f"<yirage guard {graph.digest[:12]}>", "exec"), env)  # noqa: S102 - our own text
    return env["fast_ok"], env["call"]


def _check_no_dispatch_mode() -> None:
    """Compiled code writes real memory; under a dispatch mode torch would allocate fake or meta outputs."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if torch._C._len_torch_dispatch_stack():
        modes = ", ".join(type(m).__name__ for m in _get_current_dispatch_mode_stack()) or "a dispatch mode"
        raise InputError(f"a compiled graph was called while a torch dispatch mode is active ({modes}): compiled "
                         "kernels read and write real memory, and tensors made under the mode have none. Call the "
                         "graph outside the mode (e.g. outside FakeTensorMode), or use g.compile('reference') there")


def _subclass_message(what: str, t: Any) -> str:
    kind = type(t)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if kind.__name__ == "FakeTensor":
        return (f"{what} is a FakeTensor (made under torch._subclasses.FakeTensorMode or while torch.compile "
                "traces): it has a shape but no data, and compiled graphs read real memory; call the graph on "
                "real tensors, outside FakeTensorMode")
    if kind.__name__ == "FunctionalTensor":
        return (f"{what} is a FunctionalTensor (from functionalization inside torch.compile or torch.func): "
                "compiled graphs read raw memory and cannot see its pending updates; call the graph on real "
                "tensors, outside the transform")
    return (f"{what} is a {name}, a torch.Tensor subclass: compiled graphs read raw memory and would skip its "
            "__torch_function__/__torch_dispatch__ logic, so only plain tensors and nn.Parameter are accepted; "
            "pass t.as_subclass(torch.Tensor) if it holds its own data, or a plain copy")


def _functorch_wrapped(t: Any) -> bool:
    """A tensor torch.vmap or torch.func's autodiff wrapped (a BatchedTensor or TensorWrapper: no storage)."""
    import torch

    functorch = getattr(torch._C, "_functorch", None)
    wrapped = getattr(functorch, "is_functorch_wrapped_tensor", None)
    return bool(wrapped is not None and wrapped(t))


def _check_memory(what: str, t: Any) -> None:
    """A storage that holds every element the view can reach, with a real data pointer."""
    import torch

    is_functional = getattr(torch, "_is_functional_tensor", None)
    if is_functional is not None and is_functional(t):
        raise InputError(f"{what} is a functional tensor (functionalization wrapper) with no storage of its own; "
                         "call the graph on real tensors, outside the transform")
    need = (t.storage_offset() + _extent(t.shape, t.stride()) + 1) * t.element_size()
    have = t.untyped_storage().nbytes()
    if have < need:
        raise InputError(
            f"{what} needs {need} bytes of storage (offset {t.storage_offset()}, shape {tuple(t.shape)}, strides "
            f"{t.stride()}) but its storage holds {have} (it was shrunk or freed, e.g. with "
            "untyped_storage().resize_()); compiled code would read past its end: pass a tensor whose storage "
            "holds all of its elements"
        )
    if not t.data_ptr():
        raise InputError(f"{what} has no data (its data pointer is null); pass a tensor with real storage")


def _plain(inputs: Sequence[Any]) -> list[Any]:
    """Checked inputs as plain tensors; ``requires_grad`` ones are read as constants, with one warning."""
    global _grad_warned
    if not _grad_warned and any(t.requires_grad for t in inputs):
        _grad_warned = True
        warnings.warn(
            "yirage compiled graphs do not propagate autograd: inputs with requires_grad=True are read as "
            "constants and the outputs do not require grad (no gradient will flow back through them). "
            "Pass t.detach() to silence this warning; it is given once per process",
            UserWarning, stacklevel=_user_stacklevel(),
        )
    return [t.detach() for t in inputs]  # detach also turns an nn.Parameter into a plain tensor


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside yirage, counted from our caller, so warnings point at user code."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "yirage":
        frame, level = frame.f_back, level + 1
    return level


def plugin_of(backend: Backend) -> str:
    """The plugin that provides ``backend``, for error messages."""
    from yirage.backend.selection import registry

    try:
        record = registry().origin(backend.name)
    except YirageError:  # a Backend object the current registry does not know
        return f"module {type(backend).__module__}"
    return f"plugin {record.name!r}, distribution {record.distribution} {record.version}"

