"""Load a cubin and launch its kernels on torch CUDA tensors through the CUDA driver API.

Kept small on purpose: it runs only where a GPU exists, so every line must be
obviously right. A kernel declares its parameters (tensor dtype and element
count, or a scalar type); each launch checks every tensor's type, device,
dtype, layout, contiguity and storage size before its address reaches the
kernel, and launches on torch's current stream with no host synchronisation
(so a call can be captured into a CUDA graph). Lifetimes follow torch's rule
for its own kernels: the caching allocator reuses a freed tensor's memory only
in stream order, after the launch on the same stream has run. ``CudaKernel`` is
for hand-written kernels; rendered plans go through ``launch.PlanLauncher``,
which uses ``CudaModule.function`` and checks a plan's buffers itself.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from yirage.errors import YirageError
from yirage_backend_cuda.cubin import inspect_cubin
from yirage_backend_cuda.nvrtc import INSTALL, ToolchainError

SCALARS: dict[str, Any] = {"int32": ctypes.c_int32, "int64": ctypes.c_int64, "uint32": ctypes.c_uint32,
                           "float32": ctypes.c_float}
MAX_THREADS = 1024
MAX_GRID_X = 2**31 - 1


class LaunchError(YirageError, ValueError):
    """Arguments or launch geometry a kernel cannot be given; the message says which and what to pass."""


class DriverError(YirageError, RuntimeError):
    """A CUDA driver call that failed; the message names the call and the driver's error."""


@dataclass(frozen=True)
class TensorParam:
    """A pointer parameter: a contiguous torch tensor of ``dtype`` ("float32"...) with exactly ``numel`` elements."""

    dtype: str
    numel: int


@dataclass(frozen=True)
class ScalarParam:
    """A by-value parameter of ``kind`` (a key of SCALARS)."""

    kind: str


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise ToolchainError(f"launching CUDA kernels needs cuda-bindings ({exc}); {INSTALL}") from exc
    return driver


def call(driver: Any, what: str, result: Any) -> Any:
    """Unpack a cuda-bindings ``(status, *values)`` tuple; raise DriverError naming ``what`` on failure."""
    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(status)
        raise DriverError(f"CUDA driver call {what} failed: {status.name}"
                          f" ({text.decode(errors='replace') if text else 'no description'})")
    return values[0] if len(values) == 1 else values


def pack_args(params: Sequence[TensorParam | ScalarParam], args: Sequence[Any], device_index: int) -> list[Any]:
    """The ctypes values a launch passes, after checking each argument against its declared parameter."""
    import torch

    if len(args) != len(params):
        raise LaunchError(f"the kernel takes {len(params)} arguments, got {len(args)}; pass one per parameter")
    values: list[Any] = []
    for i, (param, arg) in enumerate(zip(params, args, strict=True)):
        if isinstance(param, ScalarParam):
            kinds = (int, float) if param.kind == "float32" else (int,)
            if isinstance(arg, bool) or not isinstance(arg, kinds):
                raise LaunchError(f"argument {i} must be a Python {' or '.join(k.__name__ for k in kinds)} "
                                  f"({param.kind}), not {type(arg).__name__}")
            value = SCALARS[param.kind](arg)
            if param.kind != "float32" and value.value != arg:
                raise LaunchError(f"argument {i}={arg!r} does not fit a {param.kind}; pass a value in its range")
            values.append(value)
            continue
        if not isinstance(arg, torch.Tensor):
            raise LaunchError(f"argument {i} must be a torch tensor ({param.dtype}), not {type(arg).__name__}")
        problem = ""
        if arg.dtype != getattr(torch, param.dtype):
            problem = f"has dtype {arg.dtype}, the kernel was built for {param.dtype}: convert it with .to()"
        elif arg.layout != torch.strided:
            problem = f"has layout {arg.layout}; pass a dense (strided) tensor, e.g. .to_dense()"
        elif not arg.is_contiguous():
            problem = f"is not contiguous (strides {tuple(arg.stride())}); pass .contiguous()"
        elif arg.numel() != param.numel:
            problem = f"has {arg.numel()} elements, the kernel indexes exactly {param.numel}; pass the declared shape"
        elif (arg.storage_offset() + arg.numel()) * arg.element_size() > arg.untyped_storage().nbytes():
            problem = "reaches past the end of its storage (a corrupted view); pass .clone()"
        elif arg.device.type != "cuda" or arg.device.index != device_index:
            problem = f"is on {arg.device}, the kernel is loaded on cuda:{device_index}; move it with .to()"
        if problem:
            raise LaunchError(f"argument {i} {problem}")
        values.append(ctypes.c_void_p(arg.data_ptr()))
    return values


def _dims(what: str, dims: Sequence[int], limits: Sequence[int]) -> tuple[int, int, int]:
    dims = tuple(dims) + (1,) * (3 - len(dims))
    if len(dims) != 3 or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= lim
                                 for d, lim in zip(dims, limits, strict=True)):
        raise LaunchError(f"{what} {dims!r} must be 1 to 3 positive ints within {tuple(limits)}")
    return dims  # type: ignore[return-value]


class _ContextPush:
    """Push ``module``'s context on entry, pop it on exit (re-entrant: the driver's context stack holds the state)."""

    __slots__ = ("module",)

    def __init__(self, module: CudaModule) -> None:
        self.module = module

    def __enter__(self) -> None:
        m = self.module
        call(m.driver, "cuCtxPushCurrent", m.driver.cuCtxPushCurrent(m._ctx))

    def __exit__(self, *exc: object) -> None:
        call(self.module.driver, "cuCtxPopCurrent", self.module.driver.cuCtxPopCurrent())


class CudaModule:
    """A cubin loaded into the primary context of torch's device ``device_index`` (shared with torch)."""

    def __init__(self, cubin: bytes, device_index: int, *, driver: Any = None,
                 capability: tuple[int, int] | None = None) -> None:
        """``driver``/``capability`` default to cuda-bindings' driver and torch's view of the device
        (tests inject a recording driver and an arch to run the launch path without a GPU)."""
        import torch

        if driver is None:
            torch.cuda.init()  # torch creates (and owns) the primary context we retain below
            driver = _driver()
        info = inspect_cubin(cubin)
        major, minor = capability or torch.cuda.get_device_capability(device_index)
        sm = int(info.arch[3:].rstrip("af"))
        if sm // 10 != major or sm % 10 > minor:
            raise LaunchError(f"the cubin is for {info.arch} but cuda:{device_index} is sm_{major}{minor}; "
                              f"build it for sm_{major}{minor} (the backend's target() names the device's arch)")
        call(driver, "cuInit", driver.cuInit(0))
        self.device_index = device_index
        self.kernels = info.kernels
        self.driver = driver
        device = call(driver, "cuDeviceGet", driver.cuDeviceGet(device_index))
        self._ctx = call(driver, "cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(device))
        self._push = _ContextPush(self)
        with self.current():
            self._module = call(driver, "cuModuleLoadData", driver.cuModuleLoadData(cubin))

    def current(self) -> Any:
        """A context manager making the module's context current on this thread (driver calls need it). One object
        per module, holding no state (the driver keeps the stack): a class built per call cost every kernel-graph
        call about 10 us of Python."""
        return self._push

    def function(self, name: str) -> Any:
        """The ``CUfunction`` of ``__global__`` ``name``; its arguments are the caller's to check."""
        if name not in self.kernels:
            raise LaunchError(f"the cubin has no kernel {name!r}; it has {', '.join(self.kernels) or 'none'} "
                              "(declare kernels extern \"C\" so their names are not mangled)")
        with self.current():
            return call(self.driver, "cuModuleGetFunction", self.driver.cuModuleGetFunction(self._module,
                                                                                             name.encode()))

    def launchable(self, name: str, groups: int, local: int, renderer: str) -> Any:
        """The ``CUfunction`` of ``name`` once a 1-D launch of ``groups`` blocks of ``local`` threads is known to fit
        it; else LaunchError naming the renderer whose geometry was wrong (``renderer``: who to report it to)."""
        fn = self.function(name)
        limit = self.max_threads(fn)
        if not 1 <= local <= limit or not 1 <= groups <= MAX_GRID_X:
            raise LaunchError(f"kernel {name} is launched with {groups} blocks of {local} threads; it allows "
                              f"1..{limit} threads and 1..{MAX_GRID_X} blocks. A bug in {renderer}: report it")
        return fn

    def max_threads(self, fn: Any) -> int:
        """The most threads a block of ``fn`` may have (its registers and ``__launch_bounds__`` decide)."""
        attr = self.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        return int(call(self.driver, "cuFuncGetAttribute", self.driver.cuFuncGetAttribute(attr, fn)))

    def kernel(self, name: str, params: Sequence[TensorParam | ScalarParam]) -> CudaKernel:
        """The ``__global__`` function ``name`` with its declared parameters."""
        for p in params:
            if isinstance(p, ScalarParam) and p.kind not in SCALARS:
                raise LaunchError(f"scalar kind {p.kind!r} is not one of {', '.join(SCALARS)}")
        return CudaKernel(self, self.function(name), name, tuple(params))


class CudaKernel:
    """One kernel of a CudaModule; call it with arguments, ``grid``, ``block`` and dynamic ``shared_mem``."""

    def __init__(self, module: CudaModule, fn: Any, name: str, params: tuple[TensorParam | ScalarParam, ...]) -> None:
        self.module, self._fn, self.name, self.params = module, fn, name, params
        self._max_threads = module.max_threads(fn)

    def __call__(self, *args: Any, grid: Sequence[int], block: Sequence[int], shared_mem: int = 0) -> None:
        import torch

        g = _dims("grid", grid, (2**31 - 1, 65535, 65535))
        b = _dims("block", block, (MAX_THREADS, MAX_THREADS, 64))
        if b[0] * b[1] * b[2] > self._max_threads:
            raise LaunchError(f"block {b} has {b[0] * b[1] * b[2]} threads; {self.name} allows {self._max_threads}")
        if not isinstance(shared_mem, int) or not 0 <= shared_mem <= 48 * 1024:
            raise LaunchError(f"shared_mem={shared_mem!r} must be 0..49152 bytes (more needs an opt-in attribute)")
        values = pack_args(self.params, args, self.module.device_index)
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        driver = self.module.driver
        stream = driver.CUstream(torch.cuda.current_stream(self.module.device_index).cuda_stream)
        with self.module.current():
            call(driver, "cuLaunchKernel", driver.cuLaunchKernel(self._fn, *g, *b, shared_mem, stream,
                                                                  ctypes.addressof(pointers), 0))
