"""Large plain matmuls through torch's cuBLAS instead of the renderer's one-thread-per-output kernel.

The renderer's Matmul kernel gives each output element one thread and a loop
over K: right for the small, fused matmuls of a decode step, far from cuBLAS
for large ones. Without changing the renderer, the launcher can replace the
kernels whose whole result is the product: A a plain read of one buffer laid
out over ``batch + (M, K)``, the epilogue the bare accumulator, no fused
RMSNorm, every buffer float32 (or every one float64: cuBLAS has no integer
GEMM, and float16/bfloat16 products would be rounded before an epilogue), and
at least ``GEMM_MIN_MNK`` multiply-adds. ``render_source`` records those in
the launch metadata, so the choice is part of the cache key. A call then runs
``torch.matmul(a, b, out=...)`` in place of the kernel, on torch's current
stream (ordered with the kernels around it, and capturable: torch sets cuBLAS
up for CUDA graphs). While TF32 is allowed for float32 matmuls
(``torch.backends.cuda.matmul.allow_tf32``) the kernel runs instead, so
results stay IEEE float32 like every other backend's. Fused epilogues (bias,
residual, activation) need the renderer to split the kernel into a GEMM and an
epilogue kernel; the issue 9 item 6 report says which interface that needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from yirage.codegen.exprs import compute_type
from yirage.compiler.indexing import broadcast_strides
from yirage.compiler.kernel_ir import KernelPlan, Load, Matmul, Var

#: smallest batch*M*N*K sent to cuBLAS: below it the launch overhead of the kernel is the whole cost
GEMM_MIN_MNK = 1 << 18


def gemm_specs(plan: KernelPlan, launched: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{Matmul kernel name: the torch.matmul that replaces it} for the plan's Matmul kernels that are plain products.

    ``launched``: the rendered kernels in launch order; a spec's ``replaces`` lists those the Matmul was rendered
    as (``name`` and ``name_*``: a prologue, split-K parts...), all skipped when torch computes the product.
    """
    specs: dict[str, dict[str, Any]] = {}
    for k in plan.kernels:
        if not isinstance(k, Matmul) or k.row_scale is not None or k.epilogue != Var("acc"):
            continue
        if not isinstance(k.a, Load) or k.a.rotate_half:
            continue
        a, b, out = (plan.buffers[n] for n in (k.a.buffer, k.b, k.out))
        kinds = {compute_type(x) for x in (a, b, out)}
        narrow = any(x.role != "temp" and x.dtype.name != compute_type(x) for x in (a, b, out))
        if narrow or len(kinds) != 1 or not kinds <= {"float32", "float64"}:
            continue
        if a.dims != k.a_space or out.dims != k.space or math.prod(k.batch) * k.m * k.n * k.k < GEMM_MIN_MNK:
            continue
        replaces = [x for x in launched if x == k.name or x.startswith(f"{k.name}_")]
        if not replaces:
            continue
        b_dims, b_strides = k.batch + (k.k, k.n), broadcast_strides(b, k.batch + (k.k, k.n))
        if not any(b_strides[:len(k.batch)]):  # one B for every batch: torch folds the batch into M
            b_dims, b_strides = b_dims[len(k.batch):], b_strides[len(k.batch):]
        specs[k.name] = {"a": a.name, "a_dims": list(a.dims), "a_strides": list(a.strides), "b": b.name,
                         "b_dims": list(b_dims), "b_strides": list(b_strides), "out": out.name,
                         "out_dims": list(out.dims), "dtype": kinds.pop(),
                         "replaces": replaces}
    return specs


def run_gemm(spec: dict[str, Any], tensors: dict[str, Any]) -> None:
    """``out = a @ b`` through torch on the buffers of one call (views as the plan lays them out)."""
    import torch

    a = torch.as_strided(tensors[spec["a"]], spec["a_dims"], spec["a_strides"])
    b = torch.as_strided(tensors[spec["b"]], spec["b_dims"], spec["b_strides"])
    torch.matmul(a, b, out=tensors[spec["out"]].view(spec["out_dims"]))


def use_cublas(spec: dict[str, Any]) -> bool:
    """False for a float32 product while torch may run float32 matmuls in TF32 (not IEEE float32 then)."""
    import torch

    return spec["dtype"] == "float64" or not torch.backends.cuda.matmul.allow_tf32
