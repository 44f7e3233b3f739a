"""yirage multi-backend demo: the same kernel graphs on every available backend.

Builds three LLM building blocks as kernel graphs (RMSNorm + Linear, a
SwiGLU gate with residual, decode attention with GQA), runs them on each
selected backend, checks every output against the float64 torch reference,
and prints the median time beside torch eager measured in the same run.

    python demo/demo_multi_backend.py                       # the default backend
    python demo/demo_multi_backend.py --backend all --iterations 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import yirage as yr
from yirage.testing.oracle import assert_matches_reference


def rms_linear(batch: int, hidden: int, out: int) -> tuple[yr.KernelGraph, list[Any], Callable[[], Any]]:
    g = yr.new_kernel_graph()
    x, gw = g.new_input((batch, hidden)), g.new_input((hidden,))
    w = g.new_input((hidden, out), strides=(1, hidden))  # the weight stored (out, hidden), as in nn.Linear
    g.mark_output(g.matmul(g.mul(g.rms_norm(x, (hidden,)), gw), w))
    tx, tg, tw = torch.randn(batch, hidden), torch.randn(hidden), torch.randn(out, hidden)
    eager = lambda: torch.nn.functional.linear(torch.nn.functional.rms_norm(tx, (hidden,), tg, 1e-6), tw)  # noqa: E731
    return g, [tx, tg, tw.t()], eager


def swiglu(batch: int, width: int) -> tuple[yr.KernelGraph, list[Any], Callable[[], Any]]:
    g = yr.new_kernel_graph()
    a, b, r = (g.new_input((batch, width)) for _ in range(3))
    g.mark_output(g.add(g.mul(g.silu(a), b), r))
    ta, tb, tr = (torch.randn(batch, width) for _ in range(3))
    return g, [ta, tb, tr], lambda: torch.nn.functional.silu(ta) * tb + tr


def attention(batch: int, heads: int, kv_heads: int, seq: int, dim: int) -> tuple[yr.KernelGraph, list[Any], Any]:
    g = yr.new_kernel_graph()
    q = g.new_input((batch, heads, dim))
    k, v = g.new_input((batch, kv_heads, seq, dim)), g.new_input((batch, kv_heads, seq, dim))
    g.mark_output(g.attention(q, k, v))
    tq, tk, tv = torch.randn(batch, heads, dim), torch.randn(batch, kv_heads, seq, dim), torch.randn(
        batch, kv_heads, seq, dim)

    def eager() -> Any:
        kk, vv = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (tk, tv))
        return torch.nn.functional.scaled_dot_product_attention(tq[:, :, None], kk, vv)[:, :, 0]

    return g, [tq, tk, tv], eager


def median_us(fn: Callable[[], Any], iterations: int) -> float:
    fn()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="default",
                        help="a backend name, 'auto', 'all' (every available one) or 'default'")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--skip-persistent", action="store_true",
                        help="accepted for compatibility; the PersistentKernel demo is demo/generate.py")
    args = parser.parse_args(argv)

    if args.backend == "all":
        names = [b.value for b in yr.get_available_backends()]
    elif args.backend == "default":
        names = [yr.get_backend().value]
    else:
        names = [yr.set_backend(args.backend).value]
    print(f"yirage demo on: {', '.join(names)} (host: {yr.get_backend_info('reference')['device']['name']})")

    cases = {
        "rmsnorm+linear (1x4096 -> 4096)": rms_linear(1, 4096, 4096),
        "rmsnorm+linear (16x1024 -> 2816)": rms_linear(16, 1024, 2816),
        "swiglu+residual (64x11008)": swiglu(64, 11008),
        "decode attention (4x32 heads, 8 kv, 512 ctx)": attention(4, 32, 8, 512, 128),
    }
    print(f"{'workload':<46}{'backend':<11}{'kernels':>8}{'yirage µs':>12}{'torch µs':>11}{'torch/yirage':>14}")
    for title, (graph, inputs, eager) in cases.items():
        torch_us = median_us(eager, args.iterations)
        for name in names:
            try:
                exe = graph.compile(name)
            except yr.NotSupportedError as exc:
                print(f"{title:<46}{name:<11}  skipped: {exc}")
                continue
            assert_matches_reference(graph, inputs, name)  # a wrong result never gets a time
            ours = median_us(lambda exe=exe, inputs=inputs: exe(inputs), args.iterations)
            fused = "op/op" if name == "reference" else str(len(exe.plan.kernels))  # reference runs op by op
            print(f"{title:<46}{name:<11}{fused:>8}{ours:>12.0f}{torch_us:>11.0f}"
                  f"{torch_us / ours:>13.2f}x")
    print("All outputs matched the float64 torch reference. Ratios under 1.15x are ties on this noisy machine.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
