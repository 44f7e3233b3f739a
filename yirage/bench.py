"""``benchmark_backends``: the same yirage kernel graphs on every backend, timed against torch eager.

Why it exists: a user choosing a backend wants measured figures for this machine, not a table. Each workload is a
small kernel graph (a matmul, RMSNorm + Linear, a SwiGLU gate, an elementwise chain) at a fixed modest size. For
each (backend, workload) the graph is built with ``new_kernel_graph(backend=name)``, compiled (timed apart), run
once and checked against torch in float64 on the same inputs; only a checked graph is timed. Timing interleaves
the backend's call with torch eager's call turn by turn (each turn starts with one untimed call, so the previous
implementation's spinning thread pool is not charged to the next), the figures are medians with p10/p90, and the
ratio is eager median / yirage median (> 1: yirage is faster). Every figure is measured in the call that returns it.

The timing method follows benchmark/timing.py (which yirage cannot import); keep the two alike.
Import-light: torch and the backends' libraries are imported only when the benchmark runs.
"""

from __future__ import annotations

import gc
import math
import numbers
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from yirage.backend import selection
from yirage.errors import UnknownBackendError
from yirage.graph.dtypes import float32
from yirage.runtime.graphs import new_kernel_graph

EPS = 1e-6
RTOL, ATOL_SCALE = 1e-3, 1e-3  # float32 graph vs float64 torch: rtol, atol as a share of max(1, max |ref|)
MIN_SAMPLES = 5  # per cell, even past its time share...
HARD_FACTOR = 2.0  # ...unless the cell has used this many times its share: then one sample is enough
SKIP_BY_DEFAULT = {"reference": "torch eager op by op: the same as the eager column it is compared with"}

#: (done, total, label): called before each (backend, workload) cell starts and once at the end (done == total)
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Workload:
    """A kernel graph builder, the torch function for the same math, and the inputs both take."""

    title: str
    build: Callable[..., Any]  # (graph, *graph inputs) -> the graph tensor to mark as output
    torch_fn: Callable[..., Any]  # (*torch tensors) -> tensor
    shapes: tuple[tuple[int, ...], ...]  # float32 inputs, in the order both take them
    scales: tuple[float, ...]  # each input is randn * scale (weights scaled like a 1/sqrt(fan-in) init)


def _torch_rmsnorm_linear(x: Any, gain: Any, w: Any) -> Any:
    import torch.nn.functional as F

    return F.rms_norm(x, (x.shape[-1],), gain, eps=EPS) @ w


def _torch_swiglu(x: Any, wg: Any, wu: Any) -> Any:
    import torch.nn.functional as F

    return F.silu(x @ wg) * (x @ wu)


def _torch_elementwise(a: Any, bias: Any, b: Any, r: Any) -> Any:
    import torch.nn.functional as F

    return F.gelu(a + bias) * b + r


H, FF = 512, 1408  # hidden size; SwiGLU width (Llama's 8/3 H rounded up to a multiple of 64)

#: decode-sized graphs: 16 to 64 tokens, hidden 512
WORKLOADS: dict[str, Workload] = {
    "matmul": Workload(
        f"matmul X @ W (64x{H} @ {H}x{H})", lambda g, x, w: g.matmul(x, w), lambda x, w: x @ w,
        ((64, H), (H, H)), (1.0, H**-0.5)),
    "rmsnorm_linear": Workload(
        f"RMSNorm + Linear (16x{H} -> {H})",
        lambda g, x, gain, w: g.matmul(g.mul(g.rms_norm(x, (H,), eps=EPS), gain), w), _torch_rmsnorm_linear,
        ((16, H), (H,), (H, H)), (1.0, 0.1, H**-0.5)),
    "swiglu_gate": Workload(
        f"SwiGLU gate silu(X Wg) * (X Wu) (16x{H} -> {FF})",
        lambda g, x, wg, wu: g.mul(g.silu(g.matmul(x, wg)), g.matmul(x, wu)), _torch_swiglu,
        ((16, H), (H, FF), (H, FF)), (1.0, H**-0.5, H**-0.5)),
    "elementwise": Workload(
        "elementwise gelu(a + bias) * b + r (64x1024)",
        lambda g, a, bias, b, r: g.add(g.mul(g.gelu(g.add(a, bias)), b), r), _torch_elementwise,
        ((64, 1024), (1024,), (64, 1024), (64, 1024)), (1.0, 1.0, 1.0, 1.0)),
}


def _check_duration(duration_seconds: Any) -> float:
    if isinstance(duration_seconds, bool) or not isinstance(duration_seconds, numbers.Real):
        raise ValueError(f"duration_seconds must be a number of seconds, got {type(duration_seconds).__name__} "
                         f"{duration_seconds!r}; pass e.g. benchmark_backends(duration_seconds=10)")
    value = float(duration_seconds)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"duration_seconds is {value}, not a finite time; pass a positive number of seconds "
                         "such as 10")
    if value <= 0:
        raise ValueError(f"duration_seconds is {value:g}, but the benchmark needs a positive time to measure in; "
                         "pass a positive number of seconds such as 10 (it is split over backends x workloads)")
    return value


def _chosen_workloads(workloads: Sequence[str] | None) -> list[str]:
    if workloads is None:
        return list(WORKLOADS)
    names = [workloads] if isinstance(workloads, str) else list(workloads)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        what = f"unknown workload(s) {', '.join(map(repr, unknown))}" if unknown else "no workload was named"
        raise ValueError(f"{what}; pick from {', '.join(WORKLOADS)} (or pass workloads=None for all)")
    return list(dict.fromkeys(names))


def _chosen_backends(backends: Sequence[Any] | None) -> tuple[list[str], dict[str, str]]:
    """Backend names to report on (the registry's order, or the order given) and those skipped on purpose.

    Unknown names raise UnknownBackendError (the registry's message lists what exists); a named backend is run
    even if it is skipped by default."""
    reg = selection.registry()
    if backends is None:
        names = reg.names()
        skipped = {n: why for n, why in SKIP_BY_DEFAULT.items() if n in names}
        return [n for n in names if n not in skipped], skipped
    requested = [backends] if isinstance(backends, (str, selection.BackendType)) else list(backends)
    if not requested:
        raise ValueError("backends=[] names no backend; pass names such as ['cpu'] (see `python -m yirage info`) "
                         "or backends=None for every backend")
    names = []
    for item in requested:
        key = selection._normalize(item)
        if key == "auto":
            key = selection.resolve("auto", need="kernel_graphs").name
        elif key not in reg:
            raise UnknownBackendError("benchmark_backends(backends=...): " + reg._unknown_message(key))
        names.append(key)
    return list(dict.fromkeys(names)), {}


def _percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, round(q * (len(sorted_ns) - 1)))] / 1e3


def _stats(ns: list[int]) -> dict[str, float]:
    ns = sorted(ns)
    return {"median_us": statistics.median(ns) / 1e3, "p10_us": _percentile(ns, 0.1), "p90_us": _percentile(ns, 0.9)}


def _time_pair(ours: Callable[[], Any], eager: Callable[[], Any], share_s: float) -> tuple[list[int], list[int]]:
    """Per-call nanoseconds of both, taking turns; at least MIN_SAMPLES each, stopping after ``share_s``, and
    after HARD_FACTOR * share_s even with fewer samples (one at least)."""
    mine: list[int] = []
    theirs: list[int] = []
    start = time.perf_counter()
    soft, hard = start + share_s, start + HARD_FACTOR * share_s
    gc.collect()
    gc.disable()
    try:
        while True:
            for fn, out in ((ours, mine), (eager, theirs)):
                fn()  # settle: see the module docstring
                t0 = time.perf_counter_ns()
                fn()
                out.append(time.perf_counter_ns() - t0)
            now = time.perf_counter()
            if now >= hard or (now >= soft and len(mine) >= MIN_SAMPLES):
                return mine, theirs
    finally:
        gc.enable()


def _cell(backend: str, workload: Workload, share_s: float, seed: int) -> tuple[dict[str, Any], float]:
    """Build, compile, check and time one workload on one backend: (its figures, seconds spent timing).

    A graph that fails to build, compile or run, or gives a wrong result, is reported in "error", untimed."""
    import torch

    cell: dict[str, Any] = {"median_us": None, "p10_us": None, "p90_us": None, "samples": 0,
                            "eager_median_us": None, "eager_p10_us": None, "eager_p90_us": None,
                            "vs_eager": None, "compile_s": None, "max_abs_error": None, "error": None}
    gen = torch.Generator().manual_seed(seed)
    host = [torch.randn(s, generator=gen) * k for s, k in zip(workload.shapes, workload.scales, strict=True)]
    ref = workload.torch_fn(*[t.double() for t in host])  # the oracle on the CPU, in float64
    device = torch.device(selection.registry().get(backend).torch_device)
    inputs = [t.to(device) for t in host]  # both sides read the backend's device

    def synced(fn: Callable[[], Any]) -> Callable[[], Any]:  # a call ends when its device work has
        return fn if device.type == "cpu" else lambda: (fn(), torch.accelerator.synchronize(device))
    stage = "building the graph"
    try:
        g = new_kernel_graph(backend=backend)
        g.mark_output(workload.build(g, *[g.new_input(s, dtype=float32) for s in workload.shapes]))
        stage = "compiling"
        started = time.perf_counter()
        exe = g.compile()
        cell["compile_s"] = time.perf_counter() - started
        stage = "the first run"
        out = exe(inputs)[0].cpu()
        cell["max_abs_error"] = float((out.double() - ref).abs().max())
        stage = "checking against torch float64"
        torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL_SCALE * max(1.0, float(ref.abs().max())))
    except Exception as exc:  # noqa: BLE001 - a graph that fails or is wrong is reported; the others still run
        cell["error"] = f"{stage}: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        return cell, 0.0
    started = time.perf_counter()
    mine, theirs = _time_pair(synced(lambda: exe(inputs)), synced(lambda: workload.torch_fn(*inputs)), share_s)
    timing_s = time.perf_counter() - started
    cell.update(_stats(mine), samples=len(mine))
    eager = _stats(theirs)
    cell.update({f"eager_{k}": v for k, v in eager.items()})
    cell["vs_eager"] = eager["median_us"] / cell["median_us"]
    return cell, timing_s


def _cpu_seconds() -> tuple[float, float, float]:
    """(now, machine-wide busy CPU seconds, this process's and its children's CPU seconds)."""
    import psutil

    t = psutil.cpu_times()
    busy = sum(getattr(t, key, 0.0) for key in ("user", "nice", "system", "irq", "softirq", "steal"))
    me = psutil.Process()
    own = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # a child that ended meanwhile: its time is gone from both sides
            continue
        own += times.user + times.system
    return time.perf_counter(), busy, own


def _other_load(start: tuple[float, float, float]) -> float | None:
    """Cores' worth of CPU the rest of the machine used since ``start``: on a small machine a busy neighbour
    makes every multi-threaded call wait for the scheduler, so figures taken beside one are noise. None for a
    window under half a second (the kernel's 10 ms accounting ticks would dominate)."""
    (t0, busy0, own0), (t1, busy1, own1) = start, _cpu_seconds()
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0) if t1 - t0 >= 0.5 else None


def _summary(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ratios = [c["vs_eager"] for c in cells.values() if c["vs_eager"]]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    return {"vs_eager_geomean": geomean, "workloads_ok": len(ratios), "workloads_failed": len(cells) - len(ratios)}


def benchmark_backends(duration_seconds: float = 10, backends: Sequence[str] | None = None, *,
                       workloads: Sequence[str] | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Run the same yirage kernel graphs on every available backend for about ``duration_seconds`` and compare
    each with torch eager on the same inputs.

    ``duration_seconds`` is the timing budget, split evenly over (available backend x workload) cells; each cell
    takes at least MIN_SAMPLES samples unless that would exceed twice its share. Compile time is EXCLUDED from
    the budget and reported separately (``compile_s`` per cell, ``compile_seconds`` in total), as are the
    float64 correctness check and torch's import: the call takes about ``duration_seconds`` (at most ~2x) plus
    those. ``backends``: names to run (default: every discovered backend; the reference backend is skipped
    unless named, being torch eager op by op). ``workloads``: a subset of WORKLOADS' names. ``progress``:
    called as progress(done, total, label) before each cell and at the end.

    Returns a JSON-serialisable dict::

        {"duration_seconds": float,            # as requested
         "timing_seconds": float,              # spent timing (the budgeted part)
         "compile_seconds": float,             # spent compiling, all cells
         "wall_seconds": float,                # the whole call
         "other_load_cores": float | None,     # CPU others used meanwhile, in cores (> ~0.25: figures are noisy)
         "cpu_count": int,
         "torch": {"version": str, "threads": int},
         "workloads": {wl: {"title": str, "shapes": [[int, ...], ...]}},
         "backends": {name: {"available": bool, "reason": str,     # the backend's probe
                             "workloads": {wl: {"median_us", "p10_us", "p90_us": float | None,
                                                "samples": int,
                                                "eager_median_us", "eager_p10_us", "eager_p90_us": float | None,
                                                "vs_eager": float | None,   # eager median / yirage median
                                                "compile_s": float | None, "max_abs_error": float | None,
                                                "error": str | None}},   # {} when unavailable
                             "summary": {"vs_eager_geomean": float | None,
                                         "workloads_ok": int, "workloads_failed": int}}},
         "skipped": {name: reason}}             # available backends not run on purpose

    Raises ValueError for a duration that is not a positive finite number, an empty ``backends`` or unknown
    ``workloads``, and UnknownBackendError for a backend name no plugin provides.
    """
    duration = _check_duration(duration_seconds)
    wl_names = _chosen_workloads(workloads)
    names, skipped = _chosen_backends(backends)
    wall_start = time.perf_counter()
    import torch

    reg = selection.registry()
    result: dict[str, Any] = {
        "duration_seconds": duration, "timing_seconds": 0.0, "compile_seconds": 0.0, "wall_seconds": 0.0,
        "other_load_cores": None, "cpu_count": os.cpu_count() or 1,
        "torch": {"version": str(torch.__version__), "threads": torch.get_num_threads()},
        "workloads": {w: {"title": WORKLOADS[w].title, "shapes": [list(s) for s in WORKLOADS[w].shapes]}
                      for w in wl_names},
        "backends": {}, "skipped": skipped,
    }
    runnable = []
    for name in names:
        avail = reg.get(name).availability()
        result["backends"][name] = {"available": avail.ok, "reason": avail.reason, "workloads": {},
                                    "summary": _summary({})}
        if avail.ok:
            runnable.append(name)
    cells = [(b, w) for b in runnable for w in wl_names]
    share = duration / max(1, len(cells))
    load_start = _cpu_seconds()
    for done, (backend, wl) in enumerate(cells):
        if progress is not None:
            progress(done, len(cells), f"{backend} {wl}")
        cell, timing_s = _cell(backend, WORKLOADS[wl], share, seed=list(WORKLOADS).index(wl))
        result["compile_seconds"] += cell["compile_s"] or 0.0
        result["timing_seconds"] += timing_s
        result["backends"][backend]["workloads"][wl] = cell
    for name in runnable:
        result["backends"][name]["summary"] = _summary(result["backends"][name]["workloads"])
    if progress is not None:
        progress(len(cells), len(cells), "done")
    result["other_load_cores"] = _other_load(load_start)
    result["wall_seconds"] = time.perf_counter() - wall_start
    return result
