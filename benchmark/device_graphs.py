"""Mirage-style kernel graphs on each given backend beside torch eager on the same device, in one run.

    python benchmark/device_graphs.py --backends cuda triton [--json out.json]
    python benchmark/device_graphs.py --backends cpu --small      # a smoke run of the same code on the CPU
    python benchmark/device_graphs.py --backends cuda --superoptimize   # also g.superoptimize()'s winner

The graphs are the patterns Mirage's examples fuse (gated MLP, RMSNorm + linear, LoRA, GQA / MHA / MQA decode
attention, a norm after a residual add, Qwen's pre-norm projection with bias, a wide softmax, QK-norm GQA, nGPT's
unit-sphere residual, two routed experts, Chameleon's norm after a projection, a normalized two-layer MLP), at
decode-time shapes. Inputs are made on the CPU (seeded), moved to the backend's torch device once, and both sides
read the same tensors. Each graph's output is first checked against torch eager (float64 on the CPU) and a wrong
graph gets no figure. Timing: implementations interleaved call by call, each call synchronised on the device, median
of ``--calls`` after warm-up; ratio = torch median / yirage median (> 1: yirage is faster); on a device each row
also splits a call into the host's enqueueing and the device's span (events). With ``--superoptimize``
the graph's superoptimized plan (``g.superoptimize()``: fusion plans verified against a float64 oracle and timed on
the device, then the backend's schedule knobs, the winner cached) is timed beside them, with the winning plan named.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    name: str
    shapes: tuple[tuple[int, ...], ...]
    build: Callable[..., Any]  # (g, *inputs) -> output tensor of the graph
    torch: Callable[..., Any]  # (*tensors) -> the same in torch
    int_inputs: tuple[int, ...] = ()  # positions of int inputs (attention lengths)


def _rms(x: Any, eps: float = 1e-6) -> Any:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _attention(q: Any, k: Any, v: Any) -> Any:
    import torch.nn.functional as F

    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q[:, :, None], k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                                          )[:, :, 0]


def cases(small: bool) -> list[Case]:
    h, ff, b = (64, 128, 2) if small else (4096, 11008, 8)
    heads, d, seq = (4, 16, 32) if small else (32, 128, 1024)
    vocab = 512 if small else 32000
    moe = 32 if small else 2048  # each expert's width
    return [
        Case("gated_mlp", ((b, h), (h, ff), (h, ff)),
             lambda g, x, wg, wu: g.mul(g.silu(g.matmul(x, wg)), g.matmul(x, wu)),
             lambda x, wg, wu: (x @ wg) * (1 / (1 + (-(x @ wg)).exp())) * (x @ wu)),
        Case("rmsnorm_linear", ((b, h), (h, h)),
             lambda g, x, w: g.matmul(g.rms_norm(x, (h,)), w), lambda x, w: _rms(x) @ w),
        Case("lora", ((2 * b, h), (h, h), (h, 16), (16, h)),
             lambda g, x, w, a, bb: g.add(g.matmul(x, w), g.matmul(g.matmul(x, a), bb)),
             lambda x, w, a, bb: x @ w + (x @ a) @ bb),
        Case("gqa_decode", ((b, heads, d), (b, heads // 4, seq, d), (b, heads // 4, seq, d)),
             lambda g, q, k, v: g.attention(q, k, v), _attention),
        Case("mha_decode", ((b, heads, d), (b, heads, seq, d), (b, heads, seq, d)),
             lambda g, q, k, v: g.attention(q, k, v), _attention),
        Case("mqa_decode", ((b, heads, d), (b, 1, seq, d), (b, 1, seq, d)),
             lambda g, q, k, v: g.attention(q, k, v), _attention),
        Case("residual_norm", ((b, h), (b, h)),
             lambda g, x, r: g.rms_norm(g.add(x, r), (h,)), lambda x, r: _rms(x + r)),
        Case("qwen_prenorm_bias", ((b, h), (h,), (h, h), (h,)),
             lambda g, x, gain, w, bias: g.add(g.matmul(g.mul(g.rms_norm(x, (h,)), gain), w), bias),
             lambda x, gain, w, bias: (_rms(x) * gain) @ w + bias),
        Case("softmax_vocab", ((b, vocab),), lambda g, x: g.softmax(x, -1), lambda x: x.softmax(-1)),
        Case("qknorm_gqa", ((b, heads, d), (b, heads // 4, seq, d), (b, heads // 4, seq, d)),
             lambda g, q, k, v: g.attention(g.rms_norm(q, (d,)), g.rms_norm(k, (d,)), v),
             lambda q, k, v: _attention(_rms(q), _rms(k), v)),
        Case("ngpt_norm", ((b, h), (b, h), (h,)),
             lambda g, x, a, alpha: _g_unit(g, g.add(x, g.mul(alpha, g.sub(_g_unit(g, a), x)))),
             lambda x, a, alpha: _unit(x + alpha * (_unit(a) - x))),
        Case("moe_two_experts", ((b, h), (h, 1), (h, 1), (h, moe), (h, moe)),
             lambda g, x, r1, r2, w1, w2: g.add(g.mul(g.sigmoid(g.matmul(x, r1)), g.silu(g.matmul(x, w1))),
                                                g.mul(g.sigmoid(g.matmul(x, r2)), g.silu(g.matmul(x, w2)))),
             lambda x, r1, r2, w1, w2: ((x @ r1).sigmoid() * torch_silu(x @ w1)
                                        + (x @ r2).sigmoid() * torch_silu(x @ w2))),
        Case("chameleon_linear_norm", ((b, h), (h, h), (h,)),
             lambda g, x, w, gain: g.mul(g.rms_norm(g.matmul(x, w), (h,)), gain),
             lambda x, w, gain: _rms(x @ w) * gain),
        Case("norm_mlp", ((b, h), (h, h), (h, h)),
             lambda g, x, w1, w2: g.matmul(g.silu(g.matmul(g.rms_norm(x, (h,)), w1)), w2),
             lambda x, w1, w2: torch_silu(_rms(x) @ w1) @ w2),
    ]


def _g_unit(g: Any, x: Any) -> Any:
    """nGPT's normalization onto the unit sphere, in graph ops: x / sqrt(sum(x^2))."""
    return g.div(x, g.sqrt(g.reduction(g.square(x), 1)))


def _unit(x: Any) -> Any:
    return x / x.square().sum(-1, keepdim=True).sqrt()


def torch_silu(x: Any) -> Any:
    import torch.nn.functional as F

    return F.silu(x)


def sync(device: Any) -> None:
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def time_interleaved(impls: dict[str, Callable[[], Any]], device: Any, calls: int) -> dict[str, float]:
    """``{name}_us``: the median of ``calls`` timed calls of each implementation, interleaved call by call and each
    synchronised on the device, after 3 warm-up rounds (cuBLAS handles, caches). The order is shuffled every round
    (seeded): a call pays for what the call before it left behind (on a CPU, torch's OpenMP threads still spinning
    for a while), so no implementation may always follow the same one.

    On a device, also ``{name}_host_us`` (the call's return, before the synchronisation: what the host spent
    enqueueing) and ``{name}_device_us`` (device events recorded around the call on the current stream: the
    device's span from the first launch to the last, idle gaps the host left included), so that a slow graph
    tells launch overhead from slow kernels."""
    import torch

    times: dict[str, list[float]] = {k: [] for k in impls}
    host: dict[str, list[float]] = {k: [] for k in impls}
    span: dict[str, list[float]] = {k: [] for k in impls}
    on_device = device.type != "cpu"
    for _ in range(3):
        for fn in impls.values():
            fn()
    order = list(impls.items())
    shuffle = random.Random(0).shuffle
    for _ in range(calls):
        shuffle(order)
        for name, fn in order:
            sync(device)
            if on_device:
                first, last = (torch.Event(device=device, enable_timing=True) for _ in range(2))
                first.record()
            start = time.perf_counter()
            fn()
            enqueued = time.perf_counter()
            if on_device:
                last.record()
            sync(device)
            times[name].append((time.perf_counter() - start) * 1e6)
            if on_device:
                host[name].append((enqueued - start) * 1e6)
                span[name].append(first.elapsed_time(last) * 1e3)
    out = {f"{k}_us": statistics.median(v) for k, v in times.items() if v}
    out.update({f"{k}_host_us": statistics.median(v) for k, v in host.items() if v})
    out.update({f"{k}_device_us": statistics.median(v) for k, v in span.items() if v})
    return out


def run_case(case: Case, backend: str, device: Any, calls: int, superoptimize: bool = False,
             profile: Path | None = None) -> dict[str, Any]:
    import torch

    import yirage as yr

    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(s, generator=gen, dtype=torch.float64) / math.sqrt(s[-1] if len(s) > 1 else 1)
            for s in case.shapes]
    g = yr.new_kernel_graph()
    g.mark_output(case.build(g, *[g.new_input(s) for s in case.shapes]))
    inputs = [t.float().to(device) for t in host]
    row: dict[str, Any] = {"graph": case.name, "backend": backend}
    try:
        compiled = g.compile(backend)
        (out,) = compiled(inputs)
    except yr.YirageError as exc:
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    want = case.torch(*host)
    err = float((out.cpu().double() - want).abs().max() / (want.abs().max() + 1e-30))
    row["max_rel_err"] = err
    if not err <= 1e-3:
        return {**row, "error": f"wrong result: max |err| / max |want| = {err:.3g}"}
    impls = {"yirage": lambda: compiled(inputs), "torch": lambda: case.torch(*inputs)}
    if superoptimize:
        best = g.superoptimize(backend=backend, time_budget_s=30.0)
        row["superopt_plan"] = best.report.winner
        impls["superopt"] = lambda: best(inputs)
    row.update(time_interleaved(impls, device, calls))
    if profile is not None:
        from profiling import file_label, profile_table

        profile_table(lambda: [compiled(inputs) for _ in range(5)], profile / f"{file_label(backend)}-{case.name}.txt",
                      device.type, f"5 calls of {case.name} on {backend}")
    row["torch_over_yirage"] = row["torch_us"] / row["yirage_us"]
    if superoptimize:
        row["torch_over_superopt"] = row["torch_us"] / row["superopt_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    import torch

    import yirage as yr
    from yirage.backend.selection import resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", required=True)
    parser.add_argument("--calls", type=int, default=50, help="timed calls per implementation (median)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--superoptimize", action="store_true", help="also time g.superoptimize()'s winner")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also profile 5 calls of each graph (torch.profiler) into DIR/<backend>-<graph>.txt")
    args = parser.parse_args(argv)
    rows = []
    for name in args.backends:
        try:
            device = torch.device(resolve(name, "--backends", need="kernel_graphs").torch_device)
        except yr.YirageError as exc:
            rows.append({"graph": "*", "backend": name, "error": str(exc)})
            continue
        rows += [run_case(case, name, device, args.calls, args.superoptimize, args.profile)
                 for case in cases(args.small)]
    print(f"{'graph':18} {'backend':8} {'yirage us':>10} {'torch us':>10} {'torch/yirage':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['graph']:18} {r['backend']:8} ERROR {r['error'][:160]}")
        else:
            extra = (f"  superoptimized {r['superopt_us']:.1f} us ({r['torch_over_superopt']:.2f}x torch, "
                     f"plan {r['superopt_plan']})") if "superopt_us" in r else ""
            split = (f"  host/device us: yirage {r['yirage_host_us']:.1f}/{r['yirage_device_us']:.1f}, torch "
                     f"{r['torch_host_us']:.1f}/{r['torch_device_us']:.1f}") if "yirage_host_us" in r else ""
            print(f"{r['graph']:18} {r['backend']:8} {r['yirage_us']:10.1f} {r['torch_us']:10.1f} "
                  f"{r['torch_over_yirage']:11.2f}x{split}{extra}")
    ratios = [r["torch_over_yirage"] for r in rows if "torch_over_yirage" in r]
    if ratios:
        print(f"median torch/yirage over {len(ratios)} graphs: {statistics.median(ratios):.2f}x")
    superopt = [r["torch_over_superopt"] for r in rows if "torch_over_superopt" in r]
    if superopt:
        print(f"median torch/superoptimized over {len(superopt)} graphs: {statistics.median(superopt):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("wrong result" in r.get("error", "") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
