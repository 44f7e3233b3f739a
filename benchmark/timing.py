"""Timing and comparison helpers shared by the kernel-graph benchmarks (kernel_graphs.py, multi_backend_benchmark.py
and the pytest-benchmark files), so every benchmark measures and states ratios the same way.

Every figure is a median of timed calls (p10/p90 beside it) measured in the same run, implementations interleaved
turn by turn so drift hits them alike. Ratios are peer median / yirage median: > 1 means yirage is faster; ratios
within TIE either way are ties. Each implementation is checked against a torch reference before it is timed.
"""

from __future__ import annotations

import contextlib
import gc
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

import yirage as yr

TIE = 1.15
SETTLE = 1  # untimed calls each time the benchmark switches to another impl (see timed)
EAGER, COMPILED = "torch eager", "torch.compile"

Call = Callable[[int], Any]  # call number -> output; the number picks the weight copy for cold runs
Maker = Callable[[], tuple[Call, float | None]]  # builds an impl: (call, yirage compile seconds or None)
Inputs = Callable[[int], list[torch.Tensor]]


@dataclass
class Result:
    workload: str
    case: str
    impl: str
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    setup_s: float | None = None  # build + compile + first call
    backend: str | None = None  # the yirage backend of a yirage impl; None for torch impls and probes
    variant: str = ""  # what tells a workload's yirage impls of one backend apart, e.g. "(W row-major)"
    extra: dict[str, float] = field(default_factory=dict)  # compile_s, gbps, share_of_bound, gflops, vs_*
    # vs_baseline: the baseline backend's median for the same variant / this median (> 1: this backend faster)
    error: str | None = None


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """``n`` competing CPU-bound processes while the block runs (a compile, a browser, a second model)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=30)


def percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, round(q * (len(sorted_ns) - 1)))] / 1e3


def timed(impls: dict[str, Call], reps: int, warmup: int, inner: int = 1, settle: int = SETTLE
          ) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Per-call nanoseconds of each impl, and its minor page faults per timed call (counted outside the timed
    window); one sample = `inner` calls, impls take turns sample by sample. Each turn starts with `settle`
    untimed calls: the previous impl's runtime threads (torch's and numba's OpenMP pools, PoCL's workers) spin
    for a while after its last call and would otherwise be charged to whoever runs next. Impl j's call numbers
    are rep * (settle + inner) + j + k: with rotated weights every impl visits every copy, and consecutive calls
    differ."""
    samples: dict[str, list[int]] = {name: [] for name in impls}
    faults = dict.fromkeys(impls, 0.0)
    gc.collect()
    gc.disable()
    try:
        for rep in range(warmup + reps):
            for j, (name, fn) in enumerate(impls.items()):
                base = rep * (settle + inner) + j
                for k in range(settle):
                    fn(base + k)
                base += settle
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter_ns()
                for k in range(inner):
                    fn(base + k)
                elapsed = time.perf_counter_ns() - start
                if rep >= warmup:
                    samples[name].append(elapsed // inner)
                    faults[name] += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (reps * inner)
    finally:
        gc.enable()
    return samples, faults


def measure(workload: str, case: str, makers: dict[str, Maker], ref: torch.Tensor, reps: int, warmup: int,
            inner: int = 1, probes: dict[str, Call] | None = None, baseline: str | None = None,
            rtol: float = 1e-3, atol_scale: float = 1e-3) -> list[Result]:
    """Build each impl, run it once and check it against `ref` (within rtol, and atol = atol_scale * max |ref|
    but at least atol_scale), then time those that passed; a failure becomes a Result with an error. `probes`
    (reference measurements, not impls) are timed alongside, unchecked. A yirage impl of a backend other than
    `baseline` is also compared with the baseline's impl of its variant."""
    ready: dict[str, Call] = {}
    results = {name: Result(workload, case, name) for name in [*makers, *(probes or {})]}
    for name, make in makers.items():
        if isinstance(make, YirageMaker):
            results[name].backend, results[name].variant = make.backend, make.variant
    for name, make in makers.items():
        res, start = results[name], time.perf_counter()
        try:
            fn, compile_s = make()
            out = fn(0)
            res.setup_s = time.perf_counter() - start
            torch.testing.assert_close(out, ref, rtol=rtol, atol=atol_scale * max(1.0, float(ref.abs().max())))
        except Exception as exc:  # noqa: BLE001 - a broken impl is reported, the others still run
            res.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            continue
        if compile_s is not None:
            res.extra["compile_s"] = compile_s
        ready[name] = fn
    ready.update(probes or {})
    samples, faults = timed(ready, reps, warmup, inner)
    for name, ns in samples.items():
        ns.sort()
        res = results[name]
        res.extra["page_faults_per_call"] = faults[name]
        res.median_us, res.p10_us, res.p90_us = statistics.median(ns) / 1e3, percentile(ns, 0.1), percentile(ns, 0.9)
    base_us = {r.variant: r.median_us for r in results.values() if r.backend == baseline and r.median_us}
    for res in results.values():
        if res.backend is not None and res.median_us:
            for peer, key in ((EAGER, "vs_eager"), (COMPILED, "vs_compile")):
                if peer in results and (peer_us := results[peer].median_us) is not None:
                    res.extra[key] = peer_us / res.median_us
            if res.backend != baseline and (peer_us := base_us.get(res.variant)) is not None:
                res.extra["vs_baseline"] = peer_us / res.median_us
    return list(results.values())


@dataclass(frozen=True)
class YirageMaker:
    """Builds one yirage impl: the kernel graph `build` makes, compiled for `backend`."""

    backend: str
    variant: str
    build: Callable[[yr.KernelGraph], None]
    inputs: Inputs

    def __call__(self) -> tuple[Call, float | None]:
        g = yr.new_kernel_graph(backend=self.backend)
        self.build(g)
        exe = g.compile()
        return (lambda i: exe(self.inputs(i))[0]), exe.compile_seconds


def yirage_makers(backends: list[str], build: Callable[[yr.KernelGraph], None], inputs: Inputs,
                  variant: str = "") -> dict[str, Maker]:
    """One impl per backend, named `yirage[<backend>] <variant>`."""
    return {f"yirage[{b}] {variant}".rstrip(): YirageMaker(b, variant, build, inputs) for b in backends}


def compiles_kernel_graphs(name: str) -> bool:
    """Whether backend `name` compiles a float32 kernel graph, asked through yirage's public API: compile one.

    (yirage exports no query for a backend's kernel dtypes; this probe is what a user can do.)"""
    g = yr.new_kernel_graph(backend=name)
    g.mark_output(g.add(g.new_input((1,)), g.new_input((1,))))
    try:
        g.compile()
    except (yr.NotSupportedError, yr.BackendUnavailableError):
        return False
    return True


def compiling_backends() -> list[str]:
    """The available backends that compile float32 kernel graphs, in the registry's order; not the reference
    backend (torch eager op by op: the eager column already)."""
    return [k.value for k in yr.get_available_backends() if k.value != "reference" and compiles_kernel_graphs(k.value)]


def torch_maker(fn: Callable[..., torch.Tensor], inputs: Inputs, compiled: bool) -> Maker:
    def make() -> tuple[Call, float | None]:
        f = torch.compile(fn, dynamic=False) if compiled else fn
        return (lambda i: f(*inputs(i))), None
    return make


def same(ins: list[torch.Tensor]) -> Inputs:
    return lambda i: ins


def git_revision() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent, check=False).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def verdict(ratio: float | None, ours: str = "yirage", theirs: str = "peer") -> str:
    if ratio is None:
        return "-"
    word = "tie" if 1 / TIE < ratio < TIE else (ours if ratio >= TIE else theirs)
    return f"{ratio:.2f}x {word}"


class OtherLoad:
    """CPU the rest of the machine used while a measurement ran, in cores: machine-wide busy time (steal included)
    minus this process's and its children's. On a 2-core machine one busy neighbour turns every 2-thread barrier
    into a wait for the next scheduler tick (figures in multiples of 4 ms), so a figure taken beside one is noise.
    """

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._start = self._snapshot()

    def _own(self) -> float:
        total = 0.0
        for proc in [self._me, *self._me.children(recursive=True)]:  # torch.compile's compile workers
            try:
                t = proc.cpu_times()
            except psutil.Error:  # a child that ended meanwhile: its time is gone from both sides
                continue
            total += t.user + t.system
        return total

    def _snapshot(self) -> tuple[float, float, float]:
        t = psutil.cpu_times()
        busy = t.user + t.nice + t.system + sum(getattr(t, key, 0.0) for key in ("irq", "softirq", "steal"))
        return time.perf_counter(), busy, self._own()

    def cores(self) -> float | None:
        """Cores' worth of CPU used by others since this object was made (or since the last call); None for a
        window under half a second, where the kernel's 10 ms accounting ticks would dominate the figure."""
        end = self._snapshot()
        (t0, busy0, own0), (t1, busy1, own1) = self._start, end
        self._start = end
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0) if t1 - t0 >= 0.5 else None
