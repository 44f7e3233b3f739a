"""The cpu backend's prompt projections against torch's, per weight format and prompt row count, on this machine.

    python benchmark/prompt_rows.py [--formats f32 bf16 q8_0 q4_0 bf16x] [--rows 4 16 32 64 128 256 512]
                                    [--shapes 960x576 576x576 3072x576 576x1536] [--rounds 7]

For each format and row count: the tiles (prompt_linear's kernels, YIRAGE_CPU_PROMPT_TILES=always) and torch's
dequantize- or widen-then-GEMM (``prefill.torch_linear``) over the shapes (default: one SmolLM2-135M layer's four
projections: fused QKV, o_proj, fused gate/up, down_proj) summed, the two sides taking turns round by round (which
goes first alternates), medians; then what the backend's policy (``YIRAGE_CPU_PROMPT_TILES``; by default the
measured choice, timed into and read from the compile cache as a prefill's would be) picks for each shape.
``bf16x`` is ``prompt_dtype="bfloat16"``: rounded activations on bf16 matrices (bf16 dot products against torch's
bf16 GEMM). The header names the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

FORMATS = ("f32", "bf16", "q8_0", "q4_0", "bf16x")
SMOLLM2 = ("960x576", "576x576", "3072x576", "576x1536")


def weight(fmt: str, n: int, k: int, gen: Any) -> Any:
    import torch

    from yirage.quant import quantize

    w = torch.randn(n, k, generator=gen) * 0.05
    if fmt in ("q8_0", "q4_0"):
        return quantize(w, fmt)
    return w if fmt == "f32" else w.bfloat16()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS[:4]), choices=FORMATS)
    p.add_argument("--rows", nargs="+", type=int, default=[4, 16, 32, 64, 128, 256, 512])
    p.add_argument("--shapes", nargs="+", default=list(SMOLLM2), help="N x K of each matrix (default: SmolLM2's)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    import torch

    import yirage as yr
    from yirage.models.prefill import torch_linear
    from yirage.system import cpu_flags, cpu_model

    if not yr.is_backend_available("cpu"):
        print("prompt_rows: the cpu backend is not available here", file=sys.stderr)
        return 2
    from yirage_backend_cpu import prompt_rows
    from yirage_backend_cpu.prompt_linear import PromptLinear

    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    vector = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "f16c"))
    print(f"CPU {cpu_model()} ({', '.join(vector)}); {torch.get_num_threads()} torch threads; shapes "
          f"{' '.join(args.shapes)} summed; medians of {args.rounds}, interleaved")
    print(f"{'format':<7}{'rows':>6}{'tiles ms':>11}{'torch ms':>11}{'tiles/torch':>13}  "
          f"choice ({prompt_rows.ENV}={os.environ.get(prompt_rows.ENV, 'measure')})")
    tiles_always, measured = PromptLinear(prompt_rows.Fixed(prompt_rows.CAPS)), PromptLinear()
    gen = torch.Generator().manual_seed(0)
    for fmt in args.formats:
        ws = [weight(fmt, n, k, gen) for n, k in shapes]
        x_dtype = torch.bfloat16 if fmt == "bf16x" else torch.float32
        kind = "bf16 x" if fmt == "bf16x" else fmt
        for m in args.rows:
            if m > prompt_rows.CAPS[kind]:
                print(f"{fmt:<7}{m:>6}{'-':>11}{'-':>11}{'-':>13}  torch (above the tiles' cap)")
                continue
            xs = [torch.randn(m, k, generator=gen).to(x_dtype) for _, k in shapes]
            sides = {"tiles": lambda x, w: tiles_always(x, w), "torch": torch_linear}
            if any(tiles_always(x, w) is None for x, w in zip(xs, ws, strict=True)):
                print(f"{fmt:<7}{m:>6}  the tiles cannot take these matrices here (bf16x needs AVX512-BF16)")
                break
            times: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(args.rounds + 1):  # round 0: compiled, repacked and touched, not timed
                for side, run in list(sides.items())[:: 1 if r % 2 else -1]:
                    start = time.perf_counter()
                    for x, w in zip(xs, ws, strict=True):
                        run(x, w)
                    if r:
                        times[side].append(time.perf_counter() - start)
            ours, theirs = (statistics.median(times[s]) * 1e3 for s in sides)
            picked = ["tiles" if measured(x, w) is not None else "torch" for x, w in zip(xs, ws, strict=True)]
            print(f"{fmt:<7}{m:>6}{ours:>11.3f}{theirs:>11.3f}{ours / theirs:>13.2f}  {' '.join(picked)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
