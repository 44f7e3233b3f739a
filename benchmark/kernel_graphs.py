"""yirage's backends (cpu, opencl, ...) vs torch eager and torch.compile on W1-W3 of docs/benchmarks.md, in one run.

    .venv/bin/python benchmark/kernel_graphs.py [--quick] [--json] [--workloads w1 w2 w3] [--backends cpu opencl]
                                                [--busy N]

Every figure is a median of timed calls (p10/p90 beside it) measured in this run, implementations interleaved
turn by turn so drift hits them alike (each turn starts with an untimed call, so no impl is charged for the
previous one's spinning threads). Ratios are peer median / yirage median: > 1 means yirage is faster;
ratios within 1.15x either way print as ties. Each implementation's output is checked against torch eager
before it is timed; one that is wrong (or fails to build) is reported and gets no figure.

``--busy N`` runs everything beside N CPU-bound processes (issue 29's case: ``--busy 1 --workloads w1`` on 2 cores;
yirage's cpu launchers then pick their thread count from measured call times, backends/cpu/.../threads.py).

--backends defaults to every available backend that compiles a float32 kernel graph (probed by compiling one);
the reference backend, torch eager op by op, is the eager column already.
Each backend other than --baseline (default cpu) also gets its ratio against the baseline backend's same impl.
With opencl in the run, W3 also times the OpenCL runtime's own floor (pyopencl enqueue + finish, no yirage code)
on each device of the platform; on PoCL, POCL_DEVICES="pthread basic" lists its in-thread device, which the
opencl backend then uses for small plans (backends/opencl/yirage_backend_opencl/devices.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numba
import torch
import torch.nn.functional as F
from timing import (
    COMPILED,
    EAGER,
    TIE,
    Call,
    Inputs,
    Result,
    busy,
    compiles_kernel_graphs,
    compiling_backends,
    fmt,
    git_revision,
    measure,
    same,
    timed,
    torch_maker,
    verdict,
    yirage_makers,
)

import yirage as yr
from yirage import system

K = N = 4096
EPS = 1e-6
COLD_COPIES = 6  # 6 x 64 MiB weights: each B=1 call streams its weight from DRAM
STREAM_MIB = 256
W2_SHAPES = ((1, 11008), (64, 11008), (1, 4096), (64, 4096))
SUM_T, SUM_KN = "sum(W) (probe)", "sum(W row-major) (probe)"  # STREAM-like read of the very W copies the impls read

def rotate(x: torch.Tensor, g: torch.Tensor, ws: list[torch.Tensor]) -> Inputs:
    """Inputs for call number i: the weight copies in turn, so consecutive calls read different copies."""
    return lambda i: [x, g, ws[i % len(ws)]]


def summed(ws: list[torch.Tensor]) -> Call:
    """STREAM-like probe: read the weight copies in turn, as the W1 impls do."""
    return lambda i: ws[i % len(ws)].sum()


def rms_linear(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # W1's torch peer
    return torch.matmul(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g, w)


def swiglu(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # W2's
    return F.silu(a) * b + r


def add(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # W3's
    return p + q


def dram_bound(reps: int) -> float:
    """STREAM-like read bandwidth in GB/s: torch sum over a 256 MiB float32 tensor."""
    t = torch.ones(STREAM_MIB * 2**18)
    ns = sorted(timed({"sum": lambda i: t.sum()}, reps, 3)[0]["sum"])
    return t.numel() * 4 / statistics.median(ns)


def bench_w1(reps: int, bound: float, backends: list[str], baseline: str) -> list[Result]:
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
                g.mark_output(g.matmul(g.mul(g.rms_norm(X, (K,), eps=EPS), G), g.new_input((K, N), strides=strides)))
            return build

        pre_t, row_major = rotate(x, gvec, w_t), rotate(x, gvec, w_kn)
        probes = {SUM_T: summed(w_nk), SUM_KN: summed(w_kn)}
        makers = {
            **yirage_makers(backends, graph((1, N)), pre_t, "(W pre-transposed)"),
            **yirage_makers(backends, graph(None), row_major, "(W row-major)"),
            EAGER: torch_maker(rms_linear, pre_t, compiled=False),
            COMPILED: torch_maker(rms_linear, pre_t, compiled=True),
        }
        case = f"B={batch} cold ({copies} x 64 MiB W)" if batch == 1 else f"B={batch}"
        n = reps if batch == 1 else max(5, reps * 2 // 3 if batch == 8 else reps // 2)
        results = measure("W1 RMSNorm+Linear", case, makers, rms_linear(*pre_t(0)), n, warmup=max(6, n // 10),
                          probes=probes if batch == 1 else None, baseline=baseline)
        gbps = {r.impl: K * N * 4 / (r.median_us * 1e3) for r in results if r.median_us}  # W bytes per ns
        for r in (r for r in results if r.impl in gbps):
            if batch > 1:
                r.extra["gflops"] = 2 * batch * K * N / (r.median_us or 1) / 1e3
                continue
            r.extra.update(gbps=gbps[r.impl], share_of_bound=gbps[r.impl] / bound)
            if r.impl not in probes and (same_w := gbps.get(SUM_KN if "row-major" in r.impl else SUM_T)):
                r.extra["share_of_sum_same_w"] = gbps[r.impl] / same_w
        out += results
    return out


def bench_w2(reps: int, backends: list[str], baseline: str) -> list[Result]:
    out: list[Result] = []
    for shape in W2_SHAPES:
        a, b, r = (torch.randn(shape) for _ in range(3))

        def build(g: yr.KernelGraph, shape: tuple[int, int] = shape) -> None:
            A, B, R = (g.new_input(shape) for _ in range(3))
            g.mark_output(g.add(g.mul(g.silu(A), B), R))

        args = same([a, b, r])
        makers = {**yirage_makers(backends, build, args), EAGER: torch_maker(swiglu, args, compiled=False),
                  COMPILED: torch_maker(swiglu, args, compiled=True)}
        probes = opencl_kernel_probe(build, [a, b, r]) if "opencl" in backends else {}
        n = reps * 5 if shape[0] == 1 else reps
        out += measure("W2 SwiGLU silu(a)*b+r", str(shape), makers, swiglu(a, b, r), n, warmup=max(10, n // 10),
                       probes=probes, baseline=baseline)
    return out


def bench_w3(reps: int, inner: int, backends: list[str], baseline: str) -> list[Result]:
    p, q = torch.randn(16), torch.randn(16)
    pair = same([p, q])

    def build(g: yr.KernelGraph) -> None:
        g.mark_output(g.add(g.new_input((16,)), g.new_input((16,))))

    makers = {**yirage_makers(backends, build, pair),
              EAGER: torch_maker(add, pair, compiled=False), COMPILED: torch_maker(add, pair, compiled=True)}
    probes = opencl_floor_probes() if "opencl" in backends else {}
    return measure("W3 per-call overhead", "add 16+16", makers, p + q, reps, warmup=max(5, reps // 10), inner=inner,
                   probes=probes, baseline=baseline)


def opencl_kernel_probe(build: Callable[[yr.KernelGraph], None], inputs: list[torch.Tensor]) -> dict[str, Call]:
    """The opencl backend's own kernels for the graph, enqueued on buffers made once and waited for: what the
    device and its compiler take with no yirage call path around them (reads the backend's program object)."""
    import pyopencl as cl

    g = yr.new_kernel_graph(backend="opencl")
    build(g)
    program = g.compile()._run
    outs = {name: torch.empty(dims, dtype=dtype) for name, dims, dtype in program.new_outputs}
    bufs = dict(program.owned_bufs)
    bufs.update({name: program._buffer(t) for name, t in outs.items()})
    bufs.update({name: program._buffer(inputs[index]) for name, index, _ in program.inputs})
    launches = [(program.kernels[step.kernel], step, [bufs[a][0] for a in step.args]) for step in program.steps]

    def call(i: int, keep: Any = (outs, bufs)) -> None:
        for kernel, step, args in launches:  # the kernel objects are the yirage impl's too: set args every time
            kernel.set_args(*args)
            cl.enqueue_nd_range_kernel(program.queue, kernel, (step.global_size,), (step.local,))
        program.queue.finish()

    return {f"opencl kernels alone on {program.device.name.split('-')[0]} (probe)": call}


def opencl_floor_probes() -> dict[str, Call]:
    """The OpenCL runtime's own per-call floor on each device of the platform yirage's opencl backend uses:
    pyopencl enqueue + finish of a 16-element add on buffers made once (no yirage code, no buffer creation)."""
    import numpy as np
    import pyopencl as cl

    probes: dict[str, Call] = {}
    bufs_host = [np.zeros(16, np.float32) for _ in range(3)]
    for dev in cl.get_platforms()[0].get_devices() if cl.get_platforms() else []:
        ctx = cl.Context([dev])
        queue = cl.CommandQueue(ctx)
        kernel = cl.Program(ctx, "__kernel void add(__global float* o, __global const float* a, "
                                 "__global const float* b) { size_t i = get_global_id(0); o[i] = a[i] + b[i]; }"
                            ).build().add
        bufs = [cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.USE_HOST_PTR, hostbuf=h) for h in bufs_host]
        kernel.set_args(*bufs)

        def call(i: int, queue: Any = queue, kernel: Any = kernel, keep: Any = (bufs, bufs_host)) -> None:
            cl.enqueue_nd_range_kernel(queue, kernel, (16,), (16,))
            queue.finish()

        probes[f"pyopencl floor {dev.name.split('-')[0]} (probe)"] = call
    return probes


def config(backends: list[str]) -> dict[str, Any]:
    facts = system.host_facts()
    nconfig: Any = numba.config
    try:
        layer: str = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = f"not initialized (preference {nconfig.THREADING_LAYER})"
    return {
        "cpu_model": system.cpu_model(), "physical_cores": facts["physical_cores"],
        "logical_cores": facts["logical_cores"], "caches": facts["caches"], "python": facts["python"],
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(), "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(), "numba_config_threads": nconfig.NUMBA_NUM_THREADS,
        "numba_threading_layer": layer, "yirage": yr.__version__, "yirage_git": git_revision(),
        "yirage_backends": {b: yr.get_backend_info(b)["reason"] for b in backends},
        "POCL_DEVICES": os.environ.get("POCL_DEVICES", "(unset: PoCL's default device only)"),
    }


def print_tables(cfg: dict[str, Any], bound: float | None, results: list[Result], quick: bool,
                 baseline: str) -> None:
    print("configuration: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    if bound is not None:
        print(f"DRAM read bound (STREAM-like torch sum over one {STREAM_MIB} MiB tensor, median): {bound:.1f} GB/s; "
              "the sum(W) probe rows read the very weight copies W1 reads, interleaved with the impls")
    print(f"ratios = peer median / yirage median (>1: yirage faster); within {TIE}x = tie; times in µs"
          + (" (--quick: a smoke run, not a measurement)" if quick else ""))
    print(f"{baseline}/yr = the {baseline} backend's median for the same impl / this backend's median "
          f"(>1: this backend faster)\n")
    head = (f"{'case':<24} {'impl':<34} {'median':>9} {'p10':>9} {'p90':>9} {'setup s':>8} "
            f"{'eager/yr':>13} {'compile/yr':>13} {baseline + '/yr':>16}  note")
    for workload in dict.fromkeys(r.workload for r in results):
        print(f"== {workload} ==\n{head}\n{'-' * len(head)}")
        for r in (r for r in results if r.workload == workload):
            if r.error:
                print(f"{r.case:<24} {r.impl:<34} FAILED: {r.error[:200]}")
                continue
            e, notes = r.extra, []
            if "gbps" in e:
                notes.append(f"{e['gbps']:.1f} GB/s = {e['share_of_bound']:.0%} of bound" + (
                    f", {e['share_of_sum_same_w']:.0%} of sum(same W)" if "share_of_sum_same_w" in e else ""))
            notes += [f"{e['gflops']:.1f} GFLOP/s"] if "gflops" in e else []
            # fresh pages on every call: an allocator state that comes and goes between runs (bimodal figures)
            faults = e.get("page_faults_per_call", 0)
            notes += [f"{faults:.0f} page faults/call"] if faults >= 1 else []
            notes += [f"yirage compile {e['compile_s']:.2f} s"] if "compile_s" in e else []
            note = "; ".join(notes)
            vs_base = verdict(e.get("vs_baseline"), r.backend or "yirage", baseline)
            print(f"{r.case:<24} {r.impl:<34} {fmt(r.median_us):>9} {fmt(r.p10_us):>9} {fmt(r.p90_us):>9} "
                  f"{fmt(r.setup_s, '.2f'):>8} {verdict(e.get('vs_eager')):>13} "
                  f"{verdict(e.get('vs_compile')):>13} {vs_base:>16}  {note}".rstrip())
        print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run, not a measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--workloads", nargs="+", choices=("w1", "w2", "w3"), default=["w1", "w2", "w3"])
    parser.add_argument("--backends", nargs="+", metavar="NAME",
                        help="yirage backends to run (default: every available one that compiles kernel graphs)")
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="run beside N CPU-bound processes")
    parser.add_argument("--baseline", default="cpu", metavar="NAME",
                        help="the backend the others are also compared with (default: cpu; '-' if it is not run)")
    args = parser.parse_args(argv)
    compiling = compiling_backends()
    backends: list[str] = args.backends or compiling
    if not backends:
        parser.error("no available backend compiles kernel graphs: install one, e.g. pip install -e backends/cpu")
    for name in backends:
        if not yr.is_backend_available(name):
            try:
                why = yr.get_backend_info(name)["reason"]
            except yr.UnknownBackendError:
                why = "no such backend"
            parser.error(f"--backends {name}: {why}; choose among the available ones: {', '.join(compiling)}")
        if not compiles_kernel_graphs(name):
            parser.error(f"--backends {name}: this backend does not compile kernel graphs; "
                         f"choose among: {', '.join(compiling)}")
    torch.set_num_threads(system.host_facts()["physical_cores"] or torch.get_num_threads())
    torch.manual_seed(0)
    w1_reps, w2_reps, w3_reps, w3_inner = (8, 20, 10, 50) if args.quick else (90, 300, 150, 200)
    bound = dram_bound(5 if args.quick else 30) if "w1" in args.workloads else None
    base = args.baseline
    benches: dict[str, Callable[[], list[Result]]] = {
        "w1": lambda: bench_w1(w1_reps, bound or 0.0, backends, base), "w2": lambda: bench_w2(w2_reps, backends, base),
        "w3": lambda: bench_w3(w3_reps, w3_inner, backends, base)}
    with busy(args.busy):
        results = [res for name, bench in benches.items() if name in args.workloads for res in bench()]
    cfg = {**config(backends), "busy_processes": args.busy}  # after the runs: numba's threading layer is known
    if args.json:
        json.dump({"config": cfg, "dram_bound_gbps": bound, "tie_below": TIE, "quick": args.quick,
                   "baseline_backend": base, "results": [asdict(r) for r in results]}, sys.stdout, indent=1)
        print()
    else:
        print_tables(cfg, bound, results, args.quick, base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
