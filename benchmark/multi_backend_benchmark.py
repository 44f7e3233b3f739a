"""yirage kernel graphs on every selected backend vs torch eager and torch.compile, over a grid of sizes, in one run.

    .venv/bin/python benchmark/multi_backend_benchmark.py --iterations 50 --output results.json --plot results.png
    .venv/bin/python benchmark/multi_backend_benchmark.py --batch-sizes 1 4 8 --seq-lengths 128 512 \\
        --hidden-sizes 768 1024 --dtype float16 --backends cpu opencl

Five workloads (bench_workloads.py), each a yirage kernel graph and the torch code a user would write for it, for
every (batch, seq, hidden) of the grid (tokens = batch * seq rows):
  matmul          X (tokens, H) @ W (H, H)
  rmsnorm_linear  rms_norm(X) * g @ W, W stored (out, in) as nn.Linear keeps it
  gated_mlp       down(silu(X @ Wg) * (X @ Wu)), intermediate = 8/3 H rounded up to 64 (Llama's SwiGLU MLP)
  attention       causal softmax(Q K^T / 8 + mask) V over H / 64 heads of 64 (torch: scaled_dot_product_attention)
  elementwise     gelu(a + bias) * b + r (one fused kernel in yirage)

Method (benchmark/timing.py, shared with kernel_graphs.py): every implementation is first checked against torch
computed in float32 from the same inputs (then rounded to --dtype); one that is wrong or fails to build is
reported and gets no figure. The rest are timed interleaved turn by turn, --iterations samples each after a
short warm-up. Ratios are peer median / yirage median: > 1 means yirage is faster; within 1.15x either way is a
tie. Backends that cannot run here are listed as skipped with the reason yirage gives. The CPU time other
processes took during each case is measured (psutil: machine-wide busy time minus ours); cases where they used
more than 0.25 cores are flagged in the table, the JSON and the chart, as their figures measure the contention.

JSON (--output): {"schema": 1, "command", "config" (machine, versions, revision, sizes, dtype, iterations, warm-up,
"other_cpu_cores" over the run), "tie_below", "ratio", "backends": {"run": [...], "skipped": {name: reason}},
"results": [{"workload", "case", "batch", "seq", "hidden", "impl", "backend" (null for torch), "median_us",
"p10_us", "p90_us", "setup_s", "compile_s", "vs_eager", "vs_compile", "error", "other_cpu_cores"}],
"summary": {workload: {backend: {"vs_eager", "vs_compile", "timed", "cases"}}} (geometric means over the cases
timed)}. Times in µs, null where an impl failed. --plot out.png (or .svg/.pdf) draws one panel per workload
(median time per case, grouped bars per impl, p10-p90 whiskers, log scale) and a panel of each backend's speedup
over torch eager.

The same workloads as pytest-benchmark microbenchmarks (not part of `make test`, whose testpaths is tests/):
    .venv/bin/python -m pytest benchmark/ --benchmark-only
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from bench_workloads import DTYPES, HEAD_DIM, TOLERANCE, WORKLOADS, Shape, case_inputs, makers_for
from timing import (
    COMPILED,
    EAGER,
    TIE,
    OtherLoad,
    Result,
    compiles_kernel_graphs,
    compiling_backends,
    fmt,
    git_revision,
    measure,
    verdict,
)

import yirage as yr
from yirage import system

MAX_ELEMENTS = 2**28  # 1 GiB of float32 in one tensor: more than a benchmark of this kind should allocate
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
BUSY = 0.25  # cores used by other processes during a case above which its figures are flagged as disturbed


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1, with an error that says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive; give an integer >= 1")
    return value


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], dict[str, str]]:
    """The arguments, the backends to run and the skipped ones with their reasons; bad input -> parser.error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=positive_int, default=20, metavar="N",
                        help="timed calls per implementation and case (default 20; medians and p10/p90 over them)")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4], metavar="B")
    parser.add_argument("--seq-lengths", type=positive_int, nargs="+", default=[128], metavar="S")
    parser.add_argument("--hidden-sizes", type=positive_int, nargs="+", default=[256, 512], metavar="H",
                        help=f"multiples of {HEAD_DIM} (attention splits H into heads of {HEAD_DIM})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--backends", nargs="+", metavar="NAME",
                        help="yirage backends (default: every available one that compiles kernel graphs)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out the torch.compile peer (its compiles cost seconds per case)")
    parser.add_argument("--output", type=Path, metavar="results.json", help="write every figure as JSON")
    parser.add_argument("--plot", type=Path, metavar="out.png", help="draw a chart (needs matplotlib)")
    args = parser.parse_args(argv)

    for h in args.hidden_sizes:
        if h % HEAD_DIM:
            parser.error(f"--hidden-sizes {h}: not a multiple of {HEAD_DIM}; attention splits the hidden size into "
                         f"heads of {HEAD_DIM}, so use e.g. {max(HEAD_DIM, round(h / HEAD_DIM) * HEAD_DIM)}")
    for b, s, h in itertools.product(args.batch_sizes, args.seq_lengths, args.hidden_sizes):
        shape = Shape(b, s, h)
        biggest = max(shape.tokens * max(h, shape.inter), b * shape.heads * s * s, h * shape.inter)
        if biggest > MAX_ELEMENTS:
            parser.error(f"--batch-sizes {b} --seq-lengths {s} --hidden-sizes {h}: one tensor of this case has "
                         f"{biggest:,} elements (more than {MAX_ELEMENTS:,}, the 1 GiB float32 limit of this "
                         "benchmark); choose smaller sizes")
    for flag, path, suffixes in (("--output", args.output, (".json",)), ("--plot", args.plot, PLOT_SUFFIXES)):
        if path is not None and not path.resolve().parent.is_dir():
            parser.error(f"{flag} {path}: the directory {path.resolve().parent} does not exist; create it first")
        if path is not None and path.suffix.lower() not in suffixes:
            parser.error(f"{flag} {path}: the file name must end with {' or '.join(suffixes)}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401 - only checked here, before the long run, and imported by plot()
        except ImportError:
            parser.error("--plot needs matplotlib, which is not installed: pip install matplotlib "
                         "(or pip install -e '.[test]'), or leave out --plot")

    names = [k.value for k in yr.BackendType]
    runnable = compiling_backends()
    skipped: dict[str, str] = {}
    for name in names:
        if not yr.is_backend_available(name):
            skipped[name] = yr.get_backend_info(name)["reason"]
        elif name == "reference" and name not in (args.backends or []):
            skipped[name] = "torch eager op by op: the torch eager column already"
        elif name not in runnable and not compiles_kernel_graphs(name):
            skipped[name] = "does not compile kernel graphs"
    for name in args.backends or []:
        if name not in names:
            parser.error(f"--backends {name}: no such backend; the registered ones are {', '.join(names)} "
                         f"(available here: {', '.join(runnable) or 'none'})")
    backends = [n for n in dict.fromkeys(args.backends or runnable) if n not in skipped]
    for name in runnable:
        if name not in backends:
            skipped[name] = "not selected (--backends)"
    if not backends:
        why = "; ".join(f"{n}: {skipped[n]}" for n in args.backends or [])
        parser.error(f"no selected backend can run kernel graphs here ({why}); "
                     f"choose among: {', '.join(runnable) or 'none (install one, e.g. pip install -e backends/cpu)'}")
    return args, backends, skipped


def config(args: argparse.Namespace, backends: list[str], warmup: int) -> dict[str, Any]:
    facts = system.host_facts()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": system.cpu_model(), "physical_cores": facts["physical_cores"],
        "ram_total": facts["ram_total"], "os": facts["os"], "python": facts["python"], "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "yirage": yr.__version__, "yirage_git": git_revision(),
        "backend_info": {b: yr.get_backend_info(b)["reason"] for b in backends},
        "dtype": args.dtype, "iterations": args.iterations, "warmup": warmup, "batch_sizes": args.batch_sizes,
        "seq_lengths": args.seq_lengths, "hidden_sizes": args.hidden_sizes, "workloads": args.workloads,
        "torch_compile": not args.no_compile, "busy_threshold_cores": BUSY,
    }


def record(name: str, shape: Shape, r: Result, others: float | None) -> dict[str, Any]:
    return {"workload": name, "case": shape.label, "batch": shape.batch, "seq": shape.seq, "hidden": shape.hidden,
            "impl": r.impl, "backend": r.backend, "median_us": r.median_us, "p10_us": r.p10_us, "p90_us": r.p90_us,
            "setup_s": r.setup_s, "compile_s": r.extra.get("compile_s"), "vs_eager": r.extra.get("vs_eager"),
            "vs_compile": r.extra.get("vs_compile"), "error": r.error, "other_cpu_cores": others}


def busy_cases(records: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(workload, case) -> cores other processes used while it ran, for the cases above BUSY."""
    return {(r["workload"], r["case"]): r["other_cpu_cores"] for r in records
            if r["other_cpu_cores"] is not None and r["other_cpu_cores"] > BUSY}


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summarize(records: list[dict[str, Any]], backends: list[str]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per workload and backend, the geometric means over the grid of vs_eager and vs_compile, and how many cases
    ran ("timed") out of how many there were ("cases"): a failed case has no ratio to average."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for wl in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == wl]
        out[wl] = {}
        for b in backends:
            mine = [r for r in rows if r["backend"] == b]
            out[wl][b] = {key: geomean([r[key] for r in mine if r[key]]) for key in ("vs_eager", "vs_compile")}
            out[wl][b].update(timed=sum(r["median_us"] is not None for r in mine), cases=len(mine))
    return out


def print_table(cfg: dict[str, Any], records: list[dict[str, Any]], skipped: dict[str, str],
                summary: dict[str, dict[str, dict[str, float | None]]]) -> None:
    print(f"{cfg['cpu_model']}, {cfg['physical_cores']} cores, torch {cfg['torch']}, yirage {cfg['yirage']} "
          f"({cfg['yirage_git']}), {cfg['dtype']}, {cfg['iterations']} timed calls per impl and case")
    for name, why in skipped.items():
        print(f"  skipped {name}: {why}")
    print(f"ratios = peer median / yirage median (>1: yirage faster); within {TIE}x = tie; times in µs\n")
    head = f"{'case':<22} {'impl':<16} {'median':>10} {'p10':>10} {'p90':>10} {'setup s':>8} " \
           f"{'eager/yr':>14} {'compile/yr':>14}  note"
    busy = busy_cases(records)
    for wl in dict.fromkeys(r["workload"] for r in records):
        print(f"== {wl}: {WORKLOADS[wl].title} ==\n{head}\n{'-' * len(head)}")
        for r in (r for r in records if r["workload"] == wl):
            if r["error"]:
                print(f"{r['case']:<22} {r['impl']:<16} FAILED: {r['error'][:200]}")
                continue
            note = f"busy machine: others used {cores:.1f} cores" if (cores := busy.get((wl, r["case"]))) else ""
            print(f"{r['case']:<22} {r['impl']:<16} {fmt(r['median_us']):>10} {fmt(r['p10_us']):>10} "
                  f"{fmt(r['p90_us']):>10} {fmt(r['setup_s'], '.2f'):>8} {verdict(r['vs_eager']):>14} "
                  f"{verdict(r['vs_compile']):>14}  {note}".rstrip())
        print()
    if busy or (cfg["other_cpu_cores"] or 0) > BUSY:
        print(f"WARNING: other processes used {fmt(cfg['other_cpu_cores'], '.1f')} cores on average during the run "
              f"and more than {BUSY} cores during {len(busy)} of {len({(r['workload'], r['case']) for r in records})} "
              "cases (marked 'busy machine'); figures taken beside them measure the contention, not the code: "
              "rerun on a quiet machine\n")
    print("geometric mean over the grid of eager/yr (compile/yr):")
    for wl, per_backend in summary.items():
        cells = [f"{b} {verdict(v['vs_eager'])} ({fmt(v['vs_compile'], '.2f')}x)"
                 + (f" over {v['timed']} of {v['cases']} cases" if v["timed"] != v["cases"] else "")
                 for b, v in per_backend.items()]
        print(f"  {wl:<16} " + "; ".join(cells))


def _si(value: float, _pos: object = None) -> str:
    """Tick label without exponents: 2, 50, 1k, 20k, 3M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _log_axis(ax: Any, axis: str = "y") -> None:
    """Log scale with ticks at 1, 2, 3, 5 x 10^k labelled as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    getattr(ax, f"set_{axis}scale")("log")
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    target.set_major_formatter(FuncFormatter(_si))
    target.set_minor_formatter(NullFormatter())
    ax.grid(axis=axis, which="major", alpha=0.35)
    ax.set_axisbelow(True)


def plot(path: Path, cfg: dict[str, Any], records: list[dict[str, Any]], backends: list[str],
         summary: dict[str, dict[str, dict[str, float | None]]]) -> None:
    """One panel per workload (median time per case, grouped bars per impl, p10-p90 whiskers, log scale) and a
    panel of each backend's geometric-mean speedup over torch eager per workload (bars up from 1: faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [f"yirage[{b}]" for b in backends] + [EAGER] + ([COMPILED] if cfg["torch_compile"] else [])
    palette = plt.get_cmap("tab10")
    colors = {impl: palette(i) for i, impl in enumerate(impls[: len(backends)])}
    colors.update({EAGER: "#555555", COMPILED: "#aaaaaa"})
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    busy = busy_cases(records)
    ncols = min(3, len(workloads) + 1)
    nrows = math.ceil((len(workloads) + 1) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.4 * nrows + 1.2), squeeze=False,
                             layout="constrained")
    flat = list(axes.flat)
    width = 0.8 / len(impls)
    for ax, wl in zip(flat, workloads, strict=False):
        rows = [r for r in records if r["workload"] == wl]
        cases = list(dict.fromkeys(r["case"] for r in rows))
        for j, impl in enumerate(impls):
            for c, case in enumerate(cases):
                r = next((r for r in rows if r["case"] == case and r["impl"] == impl), None)
                x = c - 0.4 + width * (j + 0.5)
                if r is not None and r["median_us"] is None:  # failed the check or the build: say so in place
                    ax.annotate("failed", (x, 0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                                textcoords="offset points", ha="center", va="bottom", rotation=90, fontsize=7,
                                color=colors[impl])
                if r is None or r["median_us"] is None:
                    continue
                ax.bar(x, r["median_us"], width, color=colors[impl], label=impl if c == 0 else None,
                       yerr=[[r["median_us"] - r["p10_us"]], [r["p90_us"] - r["median_us"]]], capsize=2,
                       error_kw={"elinewidth": 0.8, "ecolor": "#222222"})
        _log_axis(ax)
        labels = [c.replace(" ", "\n", 1) + (f"\nBUSY ({busy[wl, c]:.1f} cores)" if (wl, c) in busy else "")
                  for c in cases]
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        for tick, case in zip(ax.get_xticklabels(), cases, strict=True):
            if (wl, case) in busy:
                tick.set_color("#c00000")
        ax.set_ylabel("median time per call (µs)")
        ax.set_title(WORKLOADS[wl].title, fontsize=11, fontweight="bold")
    ax = flat[len(workloads)]
    width = 0.8 / len(backends)
    for j, b in enumerate(backends):
        for w, wl in enumerate(workloads):
            ratio = summary[wl][b]["vs_eager"]
            if ratio is None:
                continue
            x = w - 0.4 + width * (j + 0.5)
            ax.bar(x, ratio - 1, width, bottom=1, color=colors[f"yirage[{b}]"], zorder=2)
            ax.annotate(f"{ratio:.2f}" if ratio < 10 else f"{ratio:.0f}", (x, ratio), ha="center", fontsize=7,
                        xytext=(0, 2 if ratio >= 1 else -2), textcoords="offset points",
                        va="bottom" if ratio >= 1 else "top")
    ax.axhspan(1 / TIE, TIE, color="#bbbbbb", alpha=0.45, label=f"tie: within {TIE}x", zorder=1)
    ax.axhline(1.0, color="#222222", linewidth=1, zorder=3)
    _log_axis(ax)
    ratios = [v["vs_eager"] for per in summary.values() for v in per.values() if v["vs_eager"]] or [1.0]
    ax.set_ylim(min(0.5, min(ratios) / 1.5), max(2.0, max(ratios) * 2.5))  # room for the labels and the legend
    ax.set_xticks(range(len(workloads)), [wl.replace("_", "\n") for wl in workloads], fontsize=8)
    ax.set_ylabel("torch eager time / yirage time\n(> 1: yirage faster)")
    ax.set_title("speedup over torch eager (geometric mean over sizes)", fontsize=11, fontweight="bold")
    ax.legend(fontsize=8, loc="best")
    for extra_ax in flat[len(workloads) + 1:]:
        extra_ax.axis("off")
    handles, labels = flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(impls), frameon=False, fontsize=10)
    fig.suptitle(f"yirage kernel graphs vs torch on {cfg['cpu_model']} ({cfg['physical_cores']} cores), "
                 f"{cfg['dtype']}: median of {cfg['iterations']} calls, whiskers p10-p90\n"
                 f"yirage {cfg['yirage']} @ {cfg['yirage_git']} · torch {cfg['torch']} · {cfg['date']}"
                 + (f"\nBUSY MACHINE: other processes used more than {BUSY} cores during {len(busy)} of "
                    f"{len({(r['workload'], r['case']) for r in records})} cases (red labels), "
                    f"{cfg['other_cpu_cores']:.1f} on average over the run: such figures measure the contention"
                    if busy or (cfg["other_cpu_cores"] or 0) > BUSY else ""), fontsize=12)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args, backends, skipped = parse_args(argv)
    run_load = OtherLoad()
    torch.set_num_threads(system.host_facts()["physical_cores"] or torch.get_num_threads())
    torch.manual_seed(0)
    warmup = max(2, args.iterations // 10)
    rtol = TOLERANCE[args.dtype]
    shapes = [Shape(*p) for p in itertools.product(args.batch_sizes, args.seq_lengths, args.hidden_sizes)]
    records: list[dict[str, Any]] = []
    total = len(args.workloads) * len(shapes)
    for n, (name, shape) in enumerate(itertools.product(args.workloads, shapes), 1):
        print(f"[{n}/{total}] {name} {shape.label}", file=sys.stderr, flush=True)
        workload = WORKLOADS[name]
        inputs, ref = case_inputs(workload, shape, args.dtype)
        makers = makers_for(workload, shape, args.dtype, backends, inputs, not args.no_compile)
        load = OtherLoad()
        results = measure(workload.title, shape.label, makers, ref, args.iterations, warmup, rtol=rtol,
                          atol_scale=rtol)
        others = load.cores()
        records += [record(name, shape, r, others) for r in results]
    cfg = config(args, backends, warmup)
    cfg["other_cpu_cores"] = run_load.cores()  # the whole run: a case under half a second has no figure of its own
    summary = summarize(records, backends)
    print_table(cfg, records, skipped, summary)
    if args.output is not None:
        doc = {"schema": 1, "command": sys.argv if argv is None else ["multi_backend_benchmark.py", *argv],
               "config": cfg, "tie_below": TIE, "ratio": "peer median / yirage median (> 1: yirage faster)",
               "backends": {"run": backends, "skipped": skipped}, "results": records, "summary": summary}
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.output}")
    if args.plot is not None:
        plot(args.plot, cfg, records, backends, summary)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
