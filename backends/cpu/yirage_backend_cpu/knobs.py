"""The schedule knobs of the numba renderer: the decisions its cost model takes that a measured search may overturn.

``schedule_knobs(plan)`` declares them for ``g.superoptimize()`` (``yirage.compiler.schedule``); the renderers take
each kernel's chosen values (``plan.schedule[kernel]``) and fall back on the picks below, so a plan without a
schedule renders as it always has. Three decisions are declared:

* ``strategy`` of a matmul: a generated loop (``dot`` over a (N, K) B, ``split_k`` over a (K, N) B) or torch's BLAS
  (``blas``). Which wins depends on the BLAS library and the machine: on an AMD EPYC with 2 cores split-K beat
  torch's matmul up to M = 16 rows where the pick (tuned on an Intel machine) calls BLAS above M = 2. Loops are
  offered only up to ``LOOP_MAX_M`` rows: above, BLAS's blocking is certain to win and a loop's call would only
  spend the search's time.
* ``heads_per_pass`` of a grouped-query attention: the whole group of heads sharing a KV head per parallel
  iteration, so each K and V row is read once for all of them, or one query head (more iterations: a single
  (batch, KV head) of MQA would leave a core idle); ``heads_per_pass`` picks.
* ``parallel`` of a pointwise or row kernel whose work lies within a factor ``DOUBT`` of the threshold where waking
  the thread pool starts to pay (``PARALLEL_MIN_WORK``): near it, the pool's wake-up cost and a core's share of the
  work are of one size, and only a measurement tells them apart.
"""

from __future__ import annotations

import math
from typing import Any

from yirage.codegen.exprs import expr_cost
from yirage.codegen.indexing import broadcast_strides
from yirage.compiler.kernel_ir import Attention, KernelPlan, Matmul, Pointwise, Row
from yirage.compiler.schedule import Knob
from yirage_backend_cpu.codegen import PARALLEL_MIN_WORK, threads

GEMV_MAX_M = 16  # up to this many rows per batch, streaming a (N, K) B once beats BLAS
SPLIT_K_MAX_M = 2  # split-K over a (K, N) B beats BLAS only for a row or two (measured on an Intel machine)
LOOP_MAX_M = 64  # loops are offered to the search up to this many rows per batch
DOUBT = 16  # a parallel decision within this factor of PARALLEL_MIN_WORK is offered to the search


def pointwise_parallel(k: Pointwise) -> bool:
    return math.prod(k.space) * expr_cost(k.expr) >= PARALLEL_MIN_WORK


def row_parallel(k: Row) -> bool:
    return _rows(k) > 1 and math.prod(k.space) >= PARALLEL_MIN_WORK


def heads_per_pass(k: Attention) -> int:
    """The whole query group per pass where (batch, KV head) pairs still give every thread two or more (GQA at
    batch 8 on 2 cores: 2.6 ms instead of 4.0, the K and V rows read once, not once per query head); else one."""
    group = k.heads // k.kv_heads
    return group if group > 1 and k.batch * k.kv_heads >= 2 * threads() else 1


def matmul_strategies(k: Matmul, buffers: dict[str, Any]) -> tuple[str, ...]:
    """The legal strategies of ``k``, the cost model's pick first: BLAS once B is reused enough (many rows, or a
    few rows over a row-major B); else split-K over a row-major B of one batch, dot products otherwise."""
    sbk, sbn = broadcast_strides(buffers[k.b], k.batch + (k.k, k.n))[-2:]
    row_major_b = sbn == 1 and sbk != 1
    split_k = row_major_b and math.prod(k.batch) == 1
    loop = "split_k" if split_k else "dot"
    pick = "blas" if k.m > GEMV_MAX_M or (row_major_b and k.m > SPLIT_K_MAX_M) else loop
    if k.m > LOOP_MAX_M or (loop == "dot" and row_major_b and pick == "blas"):
        return (pick,)  # dot products over a row-major B read it across rows: never offered, only kept as a pick
    return tuple(dict.fromkeys([pick, "blas", loop]))


def schedule_knobs(plan: KernelPlan) -> list[Knob]:
    knobs = []
    for k in plan.kernels:
        if isinstance(k, Matmul):
            strategies = matmul_strategies(k, plan.buffers)
            if len(strategies) > 1:
                knobs.append(Knob(k.name, "strategy", strategies, "generated loop or torch's BLAS"))
        elif isinstance(k, Attention) and k.heads > k.kv_heads:
            pick = heads_per_pass(k)
            other = 1 if pick > 1 else k.heads // k.kv_heads
            knobs.append(Knob(k.name, "heads_per_pass", (pick, other), "query heads per pass over a KV head's rows"))
        elif isinstance(k, (Pointwise, Row)):
            if isinstance(k, Row) and _rows(k) < 2:
                continue
            work = math.prod(k.space) * (expr_cost(k.expr) if isinstance(k, Pointwise) else 1)
            if PARALLEL_MIN_WORK // DOUBT <= work < PARALLEL_MIN_WORK * DOUBT:
                pick = pointwise_parallel(k) if isinstance(k, Pointwise) else row_parallel(k)
                knobs.append(Knob(k.name, "parallel", (pick, not pick), "numba prange over the thread pool or not"))
    return knobs


def _rows(k: Row) -> int:
    return math.prod(k.space) // k.space[k.axis]
