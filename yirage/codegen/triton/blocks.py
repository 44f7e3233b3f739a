"""Triton types and block sizing shared by the renderer's frame (``render``) and its matmul kernels (``matmul``).

Why a module of its own: both halves of the Triton renderer size their blocks and name ``tl`` types the same
way; kept here, below both, neither half imports the other for them.
"""

from __future__ import annotations

TL_TYPE = {"float32": "tl.float32", "float64": "tl.float64", "int32": "tl.int32", "int64": "tl.int64"}


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): Triton's block sizes are powers of two."""
    return 1 << max(0, (max(1, n) - 1).bit_length())


def warps(block: int) -> int:
    """num_warps for a program of ``block`` lanes (GPU only: the interpreter ignores it)."""
    return 1 if block <= 128 else 2 if block <= 512 else 4 if block <= 2048 else 8
