"""What one grid-wide barrier of the cuda megakernel costs, by grid size: the number that bounds its step time.

    python benchmark/grid_barrier.py [--blocks 132 264 528 1056] [--barriers 20000] [--json out.json]

The resident megakernel (backends/cuda/.../megakernel.py) meets at ``y_grid_sync`` between layers: a small model's
decode step is mostly those barriers (the first H100 run: 2.3 ms/token on the megakernel, 1.7 on launched kernels).
This times a cooperative kernel that does nothing but ``--barriers`` of them, for each grid of ``--blocks`` blocks of
64 threads (the megakernel's block: its default grid is 8 per SM), and, beside it in the same run, a two-level
barrier (blocks arrive on one of 32 counters, each on its own 128-byte line; the last of each counter arrives on the
top one), the candidate that spreads the atomics over L2. Each kernel also checks its own barrier: every block adds
1 to a per-round slot before the barrier and block 0 reads the slot after it; a count short of the grid is
reported as BROKEN (and the exit status is 1).

Needs an NVIDIA GPU and the cuda backend; make gpu-check runs it as an optional timed part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

#: the loop each barrier is timed in (one kernel per barrier function: no call through a pointer in the loop)
LOOP = """
extern "C" __global__ void __launch_bounds__(64) NAME(unsigned int* bar, unsigned int* seen, long long n) {
    for (long long i = 0; i < n; i++) {
        if (threadIdx.x == 0) atomicAdd(seen + 2 * (i & 1), 1u);
        SYNC(bar);
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            volatile unsigned int* v = seen;
            if (v[2 * (i & 1)] != gridDim.x * (unsigned int)(i / 2 + 1)) v[1] = 1u;
        }
        SYNC(bar);
    }
}
"""
KERNELS = {"y_flat": "y_grid_sync", "y_tree": "y_grid_sync_tree"}  # kernel -> the barrier it loops over


def source() -> str:
    """The megakernel's own barrier, the two-level one, and a kernel looping over each."""
    from yirage_backend_cuda.megakernel import GRID_SYNC, GRID_SYNC_TREE

    loops = "".join(LOOP.replace("NAME", name).replace("SYNC", sync) for name, sync in KERNELS.items())
    return GRID_SYNC + "\n" + GRID_SYNC_TREE + loops


def time_barriers(module: Any, kernel: str, blocks: int, barriers: int) -> tuple[float, bool]:
    """Microseconds per barrier of ``kernel`` on ``blocks`` blocks (median of 3 launches), and whether every round
    saw the whole grid arrive."""
    import ctypes

    import torch
    from yirage_backend_cuda.driver import call
    from yirage_backend_cuda.megakernel import GRID_SYNCS

    driver = module.driver
    fn = module.launchable(kernel, blocks, 64, "benchmark/grid_barrier.py")
    bar = torch.zeros(GRID_SYNCS["tree"][2], dtype=torch.int32, device="cuda")
    seen = torch.zeros(4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    times, ok = [], True
    for rounds in (barriers // 10, barriers, barriers, barriers):  # the first launch warms up, untimed
        bar.zero_()
        seen.zero_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with module.current():
            call(driver, f"cuLaunchCooperativeKernel({kernel}, {blocks} blocks)",
                 driver.cuLaunchCooperativeKernel(fn, blocks, 1, 1, 64, 1, 1, 0, stream,
                                                  ((bar.data_ptr(), seen.data_ptr(), rounds),
                                                   (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong))))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        ok = ok and int(seen[1]) == 0
        if rounds == barriers:
            times.append(elapsed / (2 * rounds) * 1e6)  # two barriers a round
    return statistics.median(times), ok


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", help="grid sizes (default: 1, 2, 4 and 8 per SM)")
    parser.add_argument("--barriers", type=int, default=20000, help="barriers per timed launch")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("grid_barrier: no CUDA GPU here (torch.cuda.is_available() is False); nothing to time")
        return 0
    from yirage_backend_cuda.pk_runtime import load_module

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    module = load_module(source(), 0, name="grid_barrier.cu")
    rows = []
    print(f"grid-wide barrier, {torch.cuda.get_device_name(0)} ({sms} SMs), 64-thread blocks, us per barrier")
    print(f"{'blocks':>7} {'flat (megakernel)':>18} {'two-level':>10}")
    for blocks in args.blocks or [sms, 2 * sms, 4 * sms, 8 * sms]:
        row: dict[str, Any] = {"blocks": blocks}
        for kernel, label in (("y_flat", "flat_us"), ("y_tree", "tree_us")):
            us, ok = time_barriers(module, kernel, blocks, args.barriers)
            row[label], row[f"{label[:-3]}_ok"] = us, ok
        rows.append(row)
        flags = "".join(f"  {k[:-3]} BROKEN" for k in ("flat_ok", "tree_ok") if not row[k])
        print(f"{blocks:7d} {row['flat_us']:18.2f} {row['tree_us']:10.2f}{flags}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["flat_ok"] and r["tree_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
