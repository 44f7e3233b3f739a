"""The latency of torch.distributed's gloo collectives between ranks of one machine: the floor under
tensor-parallel decode on CPUs (docs/distributed.md).

    python -m torch.distributed.run --nproc-per-node 2 benchmark/gloo_latency.py [--hidden 576] [--vocab 49152]

Rank 0 prints the mean time of an all-reduce of ``hidden`` float32 (one row-parallel projection's output),
blocking and as ``async_op=True`` + ``wait()`` (how yirage's communication thread calls it), and of an all-gather
of a vocabulary shard of logits, over ``--calls`` calls after a warm-up.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(args.hidden)
    shard = torch.ones(1, -(-args.vocab // n))
    parts = [torch.empty_like(shard) for _ in range(n)]

    def timed(fn, calls: int) -> float:
        for _ in range(min(50, calls)):
            fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    results = {
        f"all_reduce {args.hidden} float32, blocking": timed(lambda: dist.all_reduce(x), args.calls),
        f"all_reduce {args.hidden} float32, async + wait": timed(lambda: dist.all_reduce(x, async_op=True).wait(),
                                                                 args.calls),
        f"all_gather {n} x {shard.shape[1]} float32": timed(lambda: dist.all_gather(parts, shard), args.calls // 5),
    }
    if rank == 0:
        for what, us in results.items():
            print(f"{n} ranks, {what}: {us:.0f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
