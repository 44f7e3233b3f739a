"""g.superoptimize() against the default fusion, torch eager and torch.compile, on Mirage-style graphs, in one run.

    python benchmark/superoptimize.py --backend cpu [--small] [--budget 60] [--json out.json]
    python benchmark/superoptimize.py --backend cuda [--no-torch-compile]

The graphs are benchmark/device_graphs.py's 14 (gated MLP, RMSNorm + linear, LoRA, GQA / MHA / MQA decode attention,
a norm after a residual add, Qwen's pre-norm projection with bias, a wide softmax, QK-norm GQA, nGPT's unit-sphere
residual, two routed experts, Chameleon's norm after a projection, a normalized MLP). Per graph: the search runs
first (its time and winner are printed; a cache hit takes no time: pass ``--fresh`` to search again), then the
default compile, the superoptimized graph, torch eager and torch.compile (where it compiles) are timed interleaved
call by call, each call synchronized on the device, median of ``--calls``. A winner that is the default plan with
the default schedule ("=default") is the same program: it is timed through the default's executable. Every
implementation's output is checked against torch in float64 first; a wrong one gets no figure. Ratios are against
torch eager measured in the same run (< 1: faster than torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_graphs import Case, cases, time_interleaved  # noqa: E402 - this directory's sibling


def run(case: Case, backend: str, device: Any, calls: int, budget: float, fresh: bool,
        compiled: bool = True) -> dict[str, Any]:
    import torch

    import yirage as yr

    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(s, generator=gen, dtype=torch.float64) / math.sqrt(s[-1] if len(s) > 1 else 1)
            for s in case.shapes]
    g = yr.new_kernel_graph()
    g.mark_output(case.build(g, *[g.new_input(s) for s in case.shapes]))
    inputs = [t.float().to(device) for t in host]
    row: dict[str, Any] = {"graph": case.name, "backend": backend}
    start = time.perf_counter()
    try:
        best = g.superoptimize(backend=backend, time_budget_s=budget, use_cached_graphs=not fresh)
        default = g.compile(backend)
    except yr.YirageError as exc:
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    row.update(search_s=time.perf_counter() - start, winner=best.report.winner, from_cache=best.report.from_cache,
               note=best.report.note)
    # the search kept the default plan and schedule: the same program, timed through the default's executable (two
    # compiles of one plan were seen 10-75% apart on a CPU, an artifact of where each one's memory lies)
    same = (best.executable.plan.digest, best.executable.plan.schedule) == (default.plan.digest, default.plan.schedule)
    row["same_program"] = same
    impls = {"default": lambda: default(inputs)[0], "superopt": (lambda: default(inputs)[0]) if same else
             (lambda: best(inputs)[0]),
             "torch": lambda: case.torch(*inputs)}
    if compiled:
        try:
            compiled_torch = torch.compile(case.torch)
            compiled_torch(*inputs)
            impls["torch.compile"] = lambda f=compiled_torch: f(*inputs)
        except Exception as exc:  # noqa: BLE001 - torch.compile unavailable here: reported, the rest still measured
            row["torch.compile"] = f"did not compile: {type(exc).__name__}"
    want = case.torch(*host)
    for name, fn in list(impls.items()):
        err = float((fn().cpu().double() - want).abs().max() / (want.abs().max() + 1e-30))
        if not err <= 1e-3:
            row[f"{name}_error"] = f"wrong result: max |err| / max |want| = {err:.3g}"
            del impls[name]
    row.update(time_interleaved(impls, device, calls))
    return row


def main(argv: list[str] | None = None) -> int:
    import torch

    import yirage as yr
    from yirage.backend.selection import resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--budget", type=float, default=60.0, help="search time budget per graph, seconds")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--fresh", action="store_true", help="search again instead of reading cached winners")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--no-torch-compile", action="store_true",
                        help="skip the torch.compile peer (its compile takes tens of seconds per graph on a GPU)")
    args = parser.parse_args(argv)
    try:
        device = torch.device(resolve(args.backend, "--backend", need="kernel_graphs").torch_device)
    except yr.YirageError as exc:
        print(f"{args.backend}: {exc}")
        return 2
    print(f"backend {args.backend} ({device}), {os.cpu_count()} cores; times: median of {args.calls} interleaved calls")
    cols = ("default", "superopt", "torch", "torch.compile")
    print(f"{'graph':18} {'search s':>8}  {'winner':40} " + " ".join(f"{c + ' us':>16}" for c in cols)
          + "  superopt/torch  superopt/default", flush=True)
    rows = []
    for case in cases(args.small):  # each row printed as it is measured: a run cut short still shows its rows
        r = run(case, args.backend, device, args.calls, args.budget, args.fresh, not args.no_torch_compile)
        rows.append(r)
        if "error" in r:
            print(f"{r['graph']:18} ERROR {r['error'][:160]}", flush=True)
            continue
        cells = " ".join(f"{r[c + '_us']:16.1f}" if c + "_us" in r else f"{'-':>16}" for c in cols)
        ratio = (f"{r['superopt_us'] / r['torch_us']:14.2f}x  {r['superopt_us'] / r['default_us']:15.2f}x"
                 if {"superopt_us", "torch_us", "default_us"} <= r.keys() else "")
        cached = (" (cached)" if r["from_cache"] else "") + (" =default" if r.get("same_program") else "")
        print(f"{r['graph']:18} {r['search_s']:8.1f}  {(r['winner'] + cached)[:40]:40} {cells}  {ratio}", flush=True)
        for key in [k for k in r if k.endswith("_error")]:
            print(f"{'':18} {key[:-6]}: {r[key]}", flush=True)
        if r.get("note"):  # the search's own remarks: the budget spent, a winner that did not hold
            print(f"{'':18} note: {r['note'][:200]}", flush=True)
    full = [r for r in rows if {"superopt_us", "torch_us", "default_us"} <= r.keys()]
    if full:
        print(f"median superopt/torch eager: {statistics.median(r['superopt_us'] / r['torch_us'] for r in full):.2f}x"
              f"; median superopt/default: {statistics.median(r['superopt_us'] / r['default_us'] for r in full):.2f}x"
              f" over {len(full)} graphs")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if any(k.endswith("_error") for r in rows for k in r) or any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
