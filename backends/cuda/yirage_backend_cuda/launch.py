"""Run a rendered plan on torch CUDA tensors through the driver API, with a CUDA-graph-capturable call path.

``render_source`` puts the launch header (``yirage.codegen.launch``: buffers,
kernels in order, scratch, status checks) on top of the CUDA source, and
``build`` keeps that source in the cache entry beside the cubins, so the entry
alone is enough to load. ``load`` loads the cubin of the device's arch once
per process and device (``Artifact.load_once``) and returns a ``PlanLauncher``.

A call (``launcher(inputs) -> outputs``) checks what only this boundary knows:
each input is on the module's device (``cuda:N``, not just any CUDA device)
and of the dtype its kernels were compiled for. Everything else that makes a
raw address safe (exact tensor type, layout, shape, strides, a storage that
holds the view, no conj/neg bit) is checked by the core's ``Executable``, the
only caller of a backend's ``run``. It allocates outputs, temporaries and
scratch with torch on that device (torch's caching allocator), zeroes scratch
with ``cuMemsetD8Async`` and runs the rendered steps in order on torch's current
stream: kernels through ``cuLaunchKernel``, the renderer's ``Gemm`` steps (large
matmuls) as ``torch.matmul`` (``gemm.py``; or their IEEE fallback kernel).

Kernels set to run as Triton (``languages.py``) are steps too: ``TritonLaunch``
steps (``mixed.TritonRunner``, over the entry's ``kernels.py``) on torch's
current stream, in plan order between the CUDA launches, on the same
outputs and temporaries; their scratch (named ``triton:...``) is allocated and
zeroed like the CUDA scratch, and their status flags are read the same way, so
both languages raise the same errors in both call modes. Triton compiles and
loads a kernel on its first launch: make one call before capturing a graph
(torch's own rule for warm-up), after which its launches are capturable.

Lifetimes: ``tensors`` holds every tensor a kernel reads or writes until the
last launch is enqueued. That is enough because torch's caching allocator is
stream-ordered: a block freed after the call is handed out again only to an
allocation on the same stream (the current stream, where everything was both
allocated and launched), whose own work runs after ours. This is the rule
torch's own kernels rely on. An input the caller made on another stream and
frees early needs ``record_stream``, exactly as with a torch op.

Status checks (embedding ids out of range, attention lengths) write a flag on
the device; reading it needs the host to wait. Two call modes:

* ``launcher(inputs)`` (what ``g(...)``/``exe(...)`` use): when the plan has
  checks, one ``cuStreamSynchronize`` after the launches, then the flags are
  read and a bad input raises IndexError/ValueError, like torch's own index
  checks. A plan without checks never waits.
* ``launcher.capturable()(inputs)``: no host sync and no host read of device
  memory in the call, so it can be captured into a CUDA graph
  (``torch.cuda.graph``) and replayed. Every call writes its flags into
  persistent status buffers owned by the launcher (zeroed once, when
  ``capturable()`` first runs: call it before capturing). Errors are reported
  by ``check_status()`` (waits for the whole context, reads, re-arms the flags)
  or by the next default-mode call, which reads them together with its own (it
  sees the errors of capturable calls ordered before it on its stream). A
  deferred report names the position of the bad entry; the value is not
  re-read, since the inputs may have changed since. Replay is sound because
  launch parameters are fixed per plan (sizes are baked into the kernels) and
  every address a replay uses was allocated during capture from the graph's
  pool, or is an input the caller keeps alive (torch's CUDA graph contract:
  copy new data into the captured input tensors, read the captured outputs).
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from yirage.codegen.cstyle import render
from yirage.codegen.dialects.cuda import DIALECT
from yirage.codegen.launch import C_COMMENT, Check, Gemm, Launch, LaunchHeader, TritonLaunch
from yirage.compiler.kernel_ir import KernelPlan
from yirage.compiler.stages import Artifact
from yirage_backend_cuda.driver import CudaModule, LaunchError, call
from yirage_backend_cuda.gemm import run_gemm, use_cublas
from yirage_backend_cuda.mixed import TRITON_SOURCE_NAME, TritonRunner

SOURCE_NAME = "kernels.cu"


def render_source(plan: KernelPlan, languages: Mapping[str, str] | None = None) -> str:
    """Stage 1: the plan's CUDA C behind one JSON comment line saying how to launch it.

    ``languages`` (plan kernel name -> "cuda" or "triton", ``languages.choose``): when any kernel is "triton",
    the source also holds the Triton module and the metadata of its launches (``mixed.render_mixed``).
    """
    if languages and "triton" in {languages.get(k.name, "cuda") for k in plan.kernels}:
        from yirage_backend_cuda.mixed import render_mixed

        return render_mixed(plan, {k.name: languages.get(k.name, "cuda") for k in plan.kernels})
    rendered = render(plan, DIALECT)
    return LaunchHeader.of(plan, rendered.launches, rendered.scratch, rendered.steps).write(rendered.source, C_COMMENT)


def read_meta(source: str, where: str) -> LaunchHeader:
    """The launch header of a CUDA source; LaunchHeaderError (naming ``where``) when it is missing or damaged."""
    return LaunchHeader.read(source, where, C_COMMENT)


def open_entry(artifact: Artifact, arch: str) -> tuple[LaunchHeader, bytes]:
    """The launch metadata and the ``arch`` cubin of a cache entry the CUDA backend built."""
    cubin = f"kernels.{arch}.cubin"
    if SOURCE_NAME not in artifact.files or cubin not in artifact.files:
        raise LaunchError(f"the compile-cache entry {artifact.directory} holds {', '.join(artifact.files)}, not "
                          f"{SOURCE_NAME} and {cubin}: it was built for another GPU arch or by an older backend; "
                          "delete it so it is rebuilt for this device")
    source = (artifact.directory / SOURCE_NAME).read_text(encoding="utf-8")
    return read_meta(source, str(artifact.directory / SOURCE_NAME)), (artifact.directory / cubin).read_bytes()


def load(artifact: Artifact, device_index: int) -> PlanLauncher:
    """Stage 3: a launcher over the entry's cubin for ``cuda:device_index``'s arch, loaded once per process."""
    return artifact.load_once(lambda: _launcher(artifact, device_index), scope=device_index)


def _launcher(artifact: Artifact, device_index: int) -> PlanLauncher:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    meta, cubin = open_entry(artifact, f"sm_{major}{minor}")
    device = torch.device("cuda", device_index)
    triton = None
    if meta.triton:
        if TRITON_SOURCE_NAME not in artifact.files:
            raise LaunchError(f"the compile-cache entry {artifact.directory} runs kernels as Triton but holds "
                              f"no {TRITON_SOURCE_NAME}: delete it so it is rebuilt")
        triton = TritonRunner(artifact.directory / TRITON_SOURCE_NAME, artifact.key, device,
                              [x.kernel for x in meta.triton]).launch
    return PlanLauncher(meta, CudaModule(cubin, device_index), device,
                        lambda: torch.cuda.current_stream(device_index).cuda_stream, triton)


def status_error(check: Check, status: int, value: str) -> Exception:
    """The exception a nonzero status flag stands for (``status - 1`` is the bad position)."""
    error = IndexError if check.error == "IndexError" else ValueError
    return error(check.message.format(pos=status - 1, value=value))


class PlanLauncher:
    """``run(inputs) -> outputs`` for one plan on one device; see the module docstring for both call modes.

    ``module`` is a loaded ``CudaModule`` (its ``driver`` makes every device call), ``device`` the torch
    device it is on, ``stream()`` the handle of torch's current stream there. ``triton(step, tensors)``
    launches a Triton step on that stream (``mixed.TritonRunner.launch``); needed when the plan has any.
    """

    def __init__(self, meta: LaunchHeader, module: CudaModule, device: Any, stream: Callable[[], int],
                 triton: Callable[[TritonLaunch, list[Any]], None] | None = None) -> None:
        import torch

        self.meta, self.module, self.device, self._stream = meta, module, device, stream
        if meta.triton and triton is None:
            raise LaunchError(f"the plan runs kernels {[x.kernel for x in meta.triton]} as Triton, but the launcher "
                              "was given no Triton runner: load it through the cuda backend (launch.load)")
        self._triton = triton
        self._driver = module.driver
        self._inputs = [(n, i, getattr(torch, d)) for n, i, d in meta.inputs]
        self._n_inputs = len(meta.inputs)
        self._allocs = []  # (name, shape, torch dtype, zeroed): outputs and temps, then scratch
        for name, dims, dtype, role in meta.buffers:
            if role == "output":
                self._allocs.append((name, dims, getattr(torch, dtype), False))
            else:  # temporaries are kept at compute type, flat
                compute = "float32" if dtype in ("float16", "bfloat16") else dtype
                self._allocs.append((name, (max(1, math.prod(dims)),), getattr(torch, compute), False))
        self._checks = [x.check for x in meta.launches + meta.triton if x.check is not None]
        status_names = {c.status for c in self._checks}
        self._allocs += [(s.name, (s.count,), getattr(torch, s.dtype), True) for s in meta.scratch
                         if s.name not in status_names]
        self._status_dtypes = {s.name: getattr(torch, s.dtype) for s in meta.scratch if s.name in status_names}
        if set(self._status_dtypes.values()) - {torch.int32} or len(self._status_dtypes) != len(status_names):
            raise LaunchError(f"status checks {sorted(status_names)} need one int32 scratch buffer each, the metadata "
                              f"declares {meta.scratch}: a renderer this launcher does not match; delete the cache "
                              "entry and report it")
        self._functions: dict[str, tuple[Any, Launch, tuple[Any, ...]]] = {}
        for launch in meta.launches:
            fn = module.launchable(launch.kernel, launch.groups, launch.local,
                                   "yirage's C-family renderer (with the graph: g.to_json())")
            self._functions[launch.kernel] = (fn, launch, (ctypes.c_void_p,) * len(launch.args))
        self._check_steps()
        self._sticky: dict[str, Any] | None = None  # persistent status buffers of capturable calls
        self._lock = threading.Lock()

    def _check_steps(self) -> None:
        """Every step names a kernel of the module or buffers of the call at the GEMM's dtype; every kernel runs."""
        import torch

        meta = self.meta
        dtypes = {n: d for n, _, d in self._inputs}
        dtypes.update({n: d for n, _, d, _ in self._allocs})
        dtypes.update(self._status_dtypes)
        bad = []
        for step in meta.steps:
            if isinstance(step, TritonLaunch):
                kernels = []
                bad += [f"Triton kernel {step.kernel}: {a} is not a buffer of the plan" for a in step.args
                        if a not in dtypes]
            elif isinstance(step, Gemm):
                kernels = [step.fallback] + ([step.epilogue] if step.epilogue else [])
                want = getattr(torch, step.dtype) if step.dtype in ("float32", "float64") else None
                bad += [f"GEMM {step.name}: buffer {n} is {dtypes.get(n, 'not a buffer of the plan')}, not "
                        f"{step.dtype}" for n in (step.a, step.b, step.out)
                        if want is None or dtypes.get(n) is not want]
            else:
                kernels = [step.kernel]
            bad += [f"step kernel {x} is not in the module" for x in kernels if x not in self._functions]
        ran = {x.kernel for x in meta.steps if isinstance(x, Launch)} | {x.fallback for x in meta.steps
                                                                        if isinstance(x, Gemm)}
        bad += [f"kernel {x} is neither a step nor a GEMM's fallback" for x in self._functions if x not in ran]
        if bad:
            raise LaunchError(f"the launch metadata's steps do not match its kernels and buffers ({'; '.join(bad)}): "
                              "a renderer this launcher does not match; delete the cache entry and report it")

    # -- the call --------------------------------------------------------------------------------------
    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        """Run the plan; when it has status checks, wait for it once and raise on bad input."""
        return self._run(inputs, deferred=False)

    def capturable(self) -> CapturableRun:
        """The capturable call path (no host sync or read in a call); call this before capturing."""
        with self._lock:
            if self._sticky is None:
                self._sticky = self._new_sticky()
        return CapturableRun(self)

    def _run(self, inputs: Sequence[Any], *, deferred: bool) -> list[Any]:
        import torch

        tensors = self._gather(inputs)
        drv, stream = self._driver, self._stream()
        for name, shape, dtype, _ in self._allocs:
            tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
        if deferred:
            assert self._sticky is not None  # capturable() made them
            tensors.update(self._sticky)
        else:
            tensors.update({n: torch.empty(1, dtype=d, device=self.device) for n, d in self._status_dtypes.items()})
        with self.module.current():
            for name, _, _, zeroed in self._allocs:
                if zeroed:
                    self._memset(tensors[name], stream)
            if not deferred:
                for name in self._status_dtypes:
                    self._memset(tensors[name], stream)
            skipped = set()  # epilogue kernels of GEMMs whose fallback ran
            for step in self.meta.steps:
                if isinstance(step, TritonLaunch):  # on torch's current stream too, in plan order
                    assert self._triton is not None  # __init__ refuses a plan with Triton steps and no runner
                    self._triton(step, [tensors[a] for a in step.args])
                    continue
                if isinstance(step, Gemm):
                    if use_cublas(step):  # the product by torch's cuBLAS, on this stream
                        run_gemm(step, tensors)
                        continue
                    kernel = step.fallback  # the IEEE kernel computes the whole output, epilogue included
                    skipped.add(step.epilogue)
                elif step.kernel in skipped:
                    continue
                else:
                    kernel = step.kernel
                fn, launch, types = self._functions[kernel]
                pointers = tuple(tensors[a].data_ptr() for a in launch.args)
                call(drv, f"cuLaunchKernel({launch.kernel})", drv.cuLaunchKernel(
                    fn, launch.groups, 1, 1, launch.local, 1, 1, 0, stream, (pointers, types), 0))
            if not deferred and self._checks:  # (capturable calls' flags exist only when there are checks)
                self._raise_bad(tensors, stream)
        return [tensors[name] for name in self.meta.outputs]

    def _gather(self, inputs: Sequence[Any]) -> dict[str, Any]:
        """The inputs by buffer name, after the checks only this boundary can make (device index, dtype)."""
        if len(inputs) != self._n_inputs:
            raise LaunchError(f"the plan takes {self._n_inputs} input(s), got {len(inputs)}; pass one per graph input")
        tensors = {}
        for name, index, dtype in self._inputs:
            t = inputs[index]
            if t.device != self.device:
                raise LaunchError(
                    f"input {index} ({name}) is on {t.device}, but this graph's kernels are loaded on {self.device}: "
                    f"move it with t.to({str(self.device)!r}), or compile the graph for that device (compile a "
                    "g.copy() inside `with torch.cuda.device(...)`)")
            if t.dtype is not dtype:
                raise LaunchError(f"input {index} ({name}) has dtype {t.dtype}; its kernels were compiled for {dtype}: "
                                  f"pass t.to({dtype})")
            tensors[name] = t
        return tensors

    def _memset(self, t: Any, stream: int) -> None:
        """Zero ``t`` on the device, in stream order (capturable; no host copy)."""
        nbytes = t.numel() * t.element_size()
        call(self._driver, "cuMemsetD8Async", self._driver.cuMemsetD8Async(t.data_ptr(), 0, nbytes, stream))

    # -- status --------------------------------------------------------------------------------------
    def _new_sticky(self) -> dict[str, Any]:
        """Zeroed persistent status buffers; refuses to run while torch's stream is being captured."""
        import torch

        drv, stream = self._driver, self._stream()
        sticky = {n: torch.empty(1, dtype=d, device=self.device) for n, d in self._status_dtypes.items()}
        with self.module.current():
            capturing = call(drv, "cuStreamIsCapturing", drv.cuStreamIsCapturing(stream))
            if capturing != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
                raise LaunchError("capturable() was first called while torch's current stream is being captured; "
                                  "call it once before `with torch.cuda.graph(...)` (it zeroes the status buffers "
                                  "the captured calls write into, which needs a synchronize)")
            for t in sticky.values():
                self._memset(t, stream)
            call(drv, "cuStreamSynchronize", drv.cuStreamSynchronize(stream))
        return sticky

    def _read(self, buffers: Sequence[Any], stream: int) -> list[int]:
        """The first element of each int32 buffer: async copies, then one wait on ``stream``."""
        host = (ctypes.c_int32 * max(1, len(buffers)))()
        for i, t in enumerate(buffers):
            call(self._driver, "cuMemcpyDtoHAsync",
                 self._driver.cuMemcpyDtoHAsync(ctypes.addressof(host) + 4 * i, t.data_ptr(), 4, stream))
        call(self._driver, "cuStreamSynchronize", self._driver.cuStreamSynchronize(stream))
        return list(host)[:len(buffers)]

    def _raise_bad(self, tensors: dict[str, Any], stream: int) -> None:
        """Default mode: read this call's flags (and pending capturable ones) with one wait; raise the first."""
        sticky = list(self._sticky or {})
        values = self._read([self._sticky[n] for n in sticky] + [tensors[c.status] for c in self._checks], stream)
        pending = self._deferred_error(dict(zip(sticky, values[:len(sticky)], strict=True)), stream)
        if pending is not None:
            raise pending
        for check, status in zip(self._checks, values[len(sticky):], strict=True):
            if status:
                value = str(int(tensors[check.value_of].reshape(-1)[status - 1])) if check.value_of else ""
                raise status_error(check, status, value)

    def _deferred_error(self, values: dict[str, int], stream: int) -> Exception | None:
        """The error of the first raised sticky flag (flags re-armed with a zeroing memset and a wait), or None."""
        bad = [(c, values[c.status]) for c in self._checks if values.get(c.status)]
        if not bad or self._sticky is None:
            return None
        for name, value in values.items():
            if value:
                self._memset(self._sticky[name], stream)
        call(self._driver, "cuStreamSynchronize", self._driver.cuStreamSynchronize(stream))
        check, status = bad[0]
        error = status_error(check, status, "unknown (checked after a capturable call; not re-read)")
        return type(error)(f"a capturable call had bad input: {error}")

    def check_status(self) -> None:
        """Raise the error of an earlier capturable call, if one had bad input; waits for the whole context."""
        if not self._sticky:  # no checks: nothing to wait for
            return
        drv, stream = self._driver, self._stream()
        with self.module.current():
            call(drv, "cuCtxSynchronize", drv.cuCtxSynchronize())
            names = list(self._sticky)
            values = dict(zip(names, self._read([self._sticky[n] for n in names], stream), strict=True))
            error = self._deferred_error(values, stream)
        if error is not None:
            raise error


class CapturableRun:
    """``run(inputs) -> outputs`` with no host sync and no host read: capturable into a CUDA graph.

    Bad input (ids out of range, bad attention lengths) is recorded on the device and raised by
    ``check_status()`` or by the next default-mode call of the same launcher.
    """

    def __init__(self, launcher: PlanLauncher) -> None:
        self.launcher = launcher

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        return self.launcher._run(inputs, deferred=True)

    def check_status(self) -> None:
        """See ``PlanLauncher.check_status``."""
        self.launcher.check_status()


def capturable(executable: Any) -> Callable[[Sequence[Any]], list[Any]]:
    """The capturable call path of a graph compiled for cuda: ``capturable(g.compile("cuda"))(inputs)``.

    Inputs are checked by the executable first (host-side only: capturable too). The returned
    callable has ``check_status()``.
    """
    run = getattr(executable, "_run", None)  # the core keeps the backend's run private (see the report)
    if not isinstance(run, PlanLauncher):
        raise TypeError(f"capturable() needs an executable compiled with backend='cuda' (g.compile('cuda')), got "
                        f"{executable!r}")
    path = run.capturable()

    def checked(inputs: Sequence[Any]) -> list[Any]:
        executable.check(inputs)
        return path([t.detach() for t in inputs])

    checked.check_status = path.check_status  # type: ignore[attr-defined]
    return checked
