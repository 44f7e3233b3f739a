"""yirage's CPU backend vs torch eager and torch.compile on W1-W3 of shared/BENCHMARKS.md, in one run.

    .venv/bin/python benchmark/kernel_graphs.py [--quick] [--json] [--workloads w1 w2 w3]

Every figure is a median of timed calls (p10/p90 beside it) measured in this run, implementations interleaved
call by call so drift hits them alike. Ratios are peer median / yirage median: > 1 means yirage is faster;
ratios within 1.15x either way print as ties. Each implementation's output is checked against torch eager
before it is timed; one that is wrong (or fails to build) is reported and gets no figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numba
import torch
import torch.nn.functional as F

import yirage as yr
from yirage import system

TIE = 1.15
K = N = 4096
EPS = 1e-6
COLD_COPIES = 6  # 6 x 64 MiB weights: each B=1 call streams its weight from DRAM
STREAM_MIB = 256
W2_SHAPES = ((1, 11008), (64, 11008), (1, 4096), (64, 4096))
EAGER, COMPILED = "torch eager", "torch.compile"

Call = Callable[[int], Any]  # call number -> output; the number picks the weight copy for cold runs


@dataclass
class Result:
    workload: str
    case: str
    impl: str
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    setup_s: float | None = None  # build + compile + first call
    extra: dict[str, float] = field(default_factory=dict)  # compile_s, gbps, share_of_bound, gflops, vs_*
    error: str | None = None


def percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, round(q * (len(sorted_ns) - 1)))] / 1e3


def timed(impls: dict[str, Call], reps: int, warmup: int, inner: int = 1) -> dict[str, list[int]]:
    """Per-call nanoseconds of each impl; one sample = `inner` calls, impls take turns sample by sample."""
    samples: dict[str, list[int]] = {name: [] for name in impls}
    counter = 0
    gc.collect()
    gc.disable()
    try:
        for rep in range(warmup + reps):
            for name, fn in impls.items():
                start = time.perf_counter_ns()
                for _ in range(inner):
                    fn(counter)
                    counter += 1
                elapsed = time.perf_counter_ns() - start
                if rep >= warmup:
                    samples[name].append(elapsed // inner)
    finally:
        gc.enable()
    return samples


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, float(ref.abs().max()))
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3 * scale)


def prepare(workload: str, case: str, makers: dict[str, Callable[[], tuple[Call, float | None]]],
            ref: torch.Tensor) -> tuple[dict[str, Call], dict[str, Result]]:
    """Build each impl, run it once, check it against `ref`; failures become Results with an error."""
    ready: dict[str, Call] = {}
    results: dict[str, Result] = {}
    for name, make in makers.items():
        res = results[name] = Result(workload, case, name)
        start = time.perf_counter()
        try:
            fn, compile_s = make()
            out = fn(0)
            res.setup_s = time.perf_counter() - start
            close(out, ref)
        except Exception as exc:  # noqa: BLE001 - a broken impl is reported, the others still run
            res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            continue
        if compile_s is not None:
            res.extra["compile_s"] = compile_s
        ready[name] = fn
    return ready, results


def measure(workload: str, case: str, makers: dict[str, Callable[[], tuple[Call, float | None]]],
            ref: torch.Tensor, reps: int, warmup: int, inner: int = 1) -> list[Result]:
    ready, results = prepare(workload, case, makers, ref)
    for name, ns in timed(ready, reps, warmup, inner).items():
        ns.sort()
        res = results[name]
        res.median_us, res.p10_us, res.p90_us = statistics.median(ns) / 1e3, percentile(ns, 0.1), percentile(ns, 0.9)
    for res in results.values():
        if res.impl.startswith("yirage") and res.median_us:
            for peer, key in ((EAGER, "vs_eager"), (COMPILED, "vs_compile")):
                if results[peer].median_us:
                    res.extra[key] = results[peer].median_us / res.median_us
    return list(results.values())


def yirage_maker(build: Callable[[yr.KernelGraph], None], inputs: Callable[[int], list[torch.Tensor]]
                 ) -> Callable[[], tuple[Call, float | None]]:
    def make() -> tuple[Call, float | None]:
        g = yr.new_kernel_graph(backend="cpu")
        build(g)
        exe = g.compile()
        return (lambda i: exe(inputs(i))[0]), exe.compile_seconds
    return make


def torch_maker(fn: Callable[..., torch.Tensor], inputs: Callable[[int], list[torch.Tensor]],
                compiled: bool) -> Callable[[], tuple[Call, float | None]]:
    def make() -> tuple[Call, float | None]:
        f = torch.compile(fn, dynamic=False) if compiled else fn
        return (lambda i: f(*inputs(i))), None
    return make


def rotate(x: torch.Tensor, g: torch.Tensor, ws: list[torch.Tensor]) -> Callable[[int], list[torch.Tensor]]:
    """Inputs for call number i: the weight copies in turn, so consecutive calls read different copies."""
    return lambda i: [x, g, ws[i % len(ws)]]


def same(ins: list[torch.Tensor]) -> Callable[[int], list[torch.Tensor]]:
    return lambda i: ins


def rms_linear(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g, w)


def swiglu(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b + r


def add(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p + q


def dram_bound(reps: int) -> float:
    """STREAM-like read bandwidth in GB/s: torch sum over a 256 MiB float32 tensor."""
    t = torch.ones(STREAM_MIB * 2**18)
    ns = sorted(timed({"sum": lambda i: t.sum()}, reps, 3)["sum"])
    return t.numel() * 4 / statistics.median(ns)


def bench_w1(reps: int, bound: float) -> list[Result]:
    out: list[Result] = []
    for batch in (1, 8, 64):
        copies = COLD_COPIES if batch == 1 else 1
        x, gvec = torch.randn(batch, K), torch.randn(K)
        w_nk = [torch.randn(N, K) / K**0.5 for _ in range(copies)]  # nn.Linear layout
        w_t = [w.t() for w in w_nk]  # the same memory viewed as (K, N), strides (1, K)
        w_kn = [w.t().contiguous() for w in w_nk]  # row-major (K, N) copies

        def graph(strides: tuple[int, int] | None, b: int = batch) -> Callable[[yr.KernelGraph], None]:
            def build(g: yr.KernelGraph) -> None:
                X, G = g.new_input((b, K)), g.new_input((K,))
                W = g.new_input((K, N), strides=strides) if strides else g.new_input((K, N))
                g.mark_output(g.matmul(g.mul(g.rms_norm(X, (K,), eps=EPS), G), W))
            return build

        pre_t, row_major = rotate(x, gvec, w_t), rotate(x, gvec, w_kn)
        makers = {
            "yirage (W pre-transposed)": yirage_maker(graph((1, N)), pre_t),
            "yirage (W row-major)": yirage_maker(graph(None), row_major),
            EAGER: torch_maker(rms_linear, pre_t, compiled=False),
            COMPILED: torch_maker(rms_linear, pre_t, compiled=True),
        }
        case = f"B={batch} cold ({copies} x 64 MiB W)" if batch == 1 else f"B={batch}"
        n = reps if batch == 1 else max(5, reps * 2 // 3 if batch == 8 else reps // 2)
        results = measure("W1 RMSNorm+Linear", case, makers, rms_linear(*pre_t(0)), n, warmup=max(6, n // 10))
        for res in results:
            if res.median_us:
                if batch == 1:
                    res.extra["gbps"] = K * N * 4 / (res.median_us * 1e3)
                    res.extra["share_of_bound"] = res.extra["gbps"] / bound
                res.extra["gflops"] = 2 * batch * K * N / (res.median_us * 1e3)
        out += results
        del w_nk, w_t, w_kn
    return out


def bench_w2(reps: int) -> list[Result]:
    out: list[Result] = []
    for shape in W2_SHAPES:
        a, b, r = (torch.randn(shape) for _ in range(3))

        def build(g: yr.KernelGraph, shape: tuple[int, int] = shape) -> None:
            A, B, R = (g.new_input(shape) for _ in range(3))
            g.mark_output(g.add(g.mul(g.silu(A), B), R))

        args = same([a, b, r])
        makers = {"yirage": yirage_maker(build, args), EAGER: torch_maker(swiglu, args, compiled=False),
                  COMPILED: torch_maker(swiglu, args, compiled=True)}
        n = reps * 5 if shape[0] == 1 else reps
        out += measure("W2 SwiGLU silu(a)*b+r", str(shape), makers, swiglu(a, b, r), n, warmup=max(10, n // 10))
    return out


def bench_w3(reps: int, inner: int) -> list[Result]:
    p, q = torch.randn(16), torch.randn(16)
    pair = same([p, q])

    def build(g: yr.KernelGraph) -> None:
        g.mark_output(g.add(g.new_input((16,)), g.new_input((16,))))

    makers: dict[str, Callable[[], tuple[Call, float | None]]] = {"yirage": yirage_maker(build, pair)}
    makers[EAGER] = torch_maker(add, pair, compiled=False)
    makers[COMPILED] = torch_maker(add, pair, compiled=True)
    return measure("W3 per-call overhead", "add 16+16", makers, p + q, reps, warmup=max(5, reps // 10), inner=inner)


def config() -> dict[str, Any]:
    facts = system.host_facts()
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = f"not initialized (preference {numba.config.THREADING_LAYER})"
    return {
        "cpu_model": system.cpu_model(), "physical_cores": facts["physical_cores"],
        "logical_cores": facts["logical_cores"], "caches": facts["caches"], "python": facts["python"],
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(), "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(), "numba_config_threads": numba.config.NUMBA_NUM_THREADS,
        "numba_threading_layer": layer, "yirage": yr.__version__,
    }


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def verdict(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    word = "tie" if 1 / TIE < ratio < TIE else ("yirage" if ratio >= TIE else "peer")
    return f"{ratio:.2f}x {word}"


def print_tables(cfg: dict[str, Any], bound: float | None, results: list[Result]) -> None:
    print("configuration: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    if bound is not None:
        print(f"DRAM read bound (torch sum over {STREAM_MIB} MiB, median): {bound:.1f} GB/s")
    print(f"ratios = peer median / yirage median (>1: yirage faster); within {TIE}x = tie; times in µs\n")
    head = (f"{'case':<24} {'impl':<26} {'median':>9} {'p10':>9} {'p90':>9} {'setup s':>8} "
            f"{'eager/yr':>13} {'compile/yr':>13}  note")
    for workload in dict.fromkeys(r.workload for r in results):
        print(f"== {workload} ==\n{head}\n{'-' * len(head)}")
        for r in (r for r in results if r.workload == workload):
            if r.error:
                print(f"{r.case:<24} {r.impl:<26} FAILED: {r.error[:200]}")
                continue
            e = r.extra
            note = f"{e['gbps']:.1f} GB/s = {e['share_of_bound']:.0%} of bound" if "gbps" in e else ""
            note = note or (f"{e['gflops']:.1f} GFLOP/s" if "gflops" in e else "")
            if "compile_s" in e:
                note += f"{'; ' if note else ''}yirage compile {e['compile_s']:.2f} s"
            print(f"{r.case:<24} {r.impl:<26} {fmt(r.median_us):>9} {fmt(r.p10_us):>9} {fmt(r.p90_us):>9} "
                  f"{fmt(r.setup_s, '.2f'):>8} {verdict(e.get('vs_eager')):>13} "
                  f"{verdict(e.get('vs_compile')):>13}  {note}")
        print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run, not a measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--workloads", nargs="+", choices=("w1", "w2", "w3"), default=["w1", "w2", "w3"])
    args = parser.parse_args(argv)
    torch.set_num_threads(system.host_facts()["physical_cores"] or torch.get_num_threads())
    torch.manual_seed(0)
    w1_reps, w2_reps, w3_reps, w3_inner = (8, 20, 10, 50) if args.quick else (60, 200, 100, 200)
    bound = dram_bound(5 if args.quick else 30) if "w1" in args.workloads else None
    results: list[Result] = []
    if "w1" in args.workloads:
        results += bench_w1(w1_reps, bound or 0.0)
    if "w2" in args.workloads:
        results += bench_w2(w2_reps)
    if "w3" in args.workloads:
        results += bench_w3(w3_reps, w3_inner)
    cfg = config()  # after the runs: numba's threading layer is known once a parallel kernel ran
    if args.json:
        json.dump({"config": cfg, "dram_bound_gbps": bound, "tie_below": TIE, "quick": args.quick,
                   "results": [asdict(r) for r in results]}, sys.stdout, indent=1)
        print()
    else:
        print_tables(cfg, bound, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
