"""The renderer's ``Gemm`` steps through torch's cuBLAS: large matmuls, fused prologue and epilogue kept.

The CUDA dialect has ``host_gemm``: the C-family renderer splits every
float32/float64 Matmul of at least ``HOST_GEMM_MIN_MNK`` multiply-adds whose B
is a plain buffer of the compute type into a prologue kernel (A's expression,
scaled by a fused RMSNorm), a ``Gemm`` step and an epilogue kernel (bias,
residual, activation, narrowing to float16/bfloat16) reading the accumulator
the GEMM wrote (``yirage.codegen.cstyle_matmul``). A call runs the step as
``torch.matmul(a, b, out=...)`` (``yirage.backend.gemm_steps``) on torch's current stream: ordered with the
kernels around it, and capturable into a CUDA graph (torch sets cuBLAS up for
capture; no host sync, no host read). While TF32 is allowed for float32
matmuls (``torch.backends.cuda.matmul.allow_tf32``) the step's ``fallback``
kernel (the whole fused product, IEEE float32) runs instead and its epilogue
kernel is skipped, so results stay IEEE float32 like every other backend's.
The choice is made when the call is enqueued (for a CUDA graph: at capture).
"""

from __future__ import annotations

from yirage.backend.gemm_steps import Gemm, run_gemm
from yirage.codegen.cstyle_matmul import HOST_GEMM_MIN_MNK

__all__ = ["HOST_GEMM_MIN_MNK", "Gemm", "run_gemm", "use_cublas"]


def use_cublas(gemm: Gemm) -> bool:
    """False for a float32 product while torch may run float32 matmuls in TF32 (not IEEE float32 then)."""
    import torch

    return gemm.dtype == "float64" or not torch.backends.cuda.matmul.allow_tf32
