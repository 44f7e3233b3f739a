"""The renderer's ``Gemm`` steps run by torch: shared by every backend whose dialect has ``host_gemm``.

A ``host_gemm`` dialect (CUDA and HIP: the vendor BLAS; OpenCL on a CPU device that shares host memory: the
host's BLAS) gets large matmuls split into prologue kernel, ``Gemm`` step and epilogue kernel
(``yirage.codegen.cstyle_matmul``). The step is ``torch.matmul`` on views of the call's buffers; this module
runs a step read back from the launch header (``yirage.codegen.launch``). ``torch.as_strided`` refuses a view
that does not fit its tensor's storage, so no view reaches the BLAS beyond the memory of its buffer.
"""

from __future__ import annotations

from typing import Any

from yirage.codegen.launch import Gemm

__all__ = ["Gemm", "run_gemm"]


def run_gemm(gemm: Gemm, tensors: dict[str, Any]) -> None:
    """``out = a @ b`` through torch on the buffers of one call (flat tensors), viewed as the plan lays them out."""
    import torch

    a = torch.as_strided(tensors[gemm.a], gemm.a_dims, gemm.a_strides)
    b = torch.as_strided(tensors[gemm.b], gemm.b_dims, gemm.b_strides)
    torch.matmul(a, b, out=tensors[gemm.out].view(gemm.out_dims))
