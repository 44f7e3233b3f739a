"""Weight-only quantized matrices in GGUF's Q8_0 and Q4_0 block formats.

A decode step streams every weight once per token, so its speed is the
weights' bytes over the memory bandwidth: Q8_0 (34 bytes per 32 values) reads
3.8x fewer bytes than float32, Q4_0 (18 bytes) 7.1x fewer. The blocks are
kept exactly as llama.cpp lays them out in a GGUF file, row after row: each
row of the (N, K) matrix is K/32 blocks, each an IEEE half scale ``d``
followed by the quants (Q8_0: 32 int8, value = q * d; Q4_0: 16 bytes, byte j
holding element j in its low nibble and element j + 16 in its high one, value
= (nibble - 8) * d). Compiled task bodies dequantize in registers; the
reference runtime and the torch prefill dequantize with ``dequantize()``.

``quantize`` follows ggml's reference quantizers (quantize_row_q8_0_ref,
quantize_row_q4_0_ref), so a matrix quantized here has the bytes llama.cpp
would write for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yirage.errors import YirageError

BLOCK = 32  # values per block, both formats
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}
FORMATS = tuple(BLOCK_BYTES)


class QuantError(YirageError, ValueError):
    """A matrix or block buffer that cannot be quantized or read as quantized; the message says why."""


def _check_format(fmt: Any) -> str:
    if fmt not in BLOCK_BYTES:
        raise QuantError(f"unknown quantization format {fmt!r}; use one of {', '.join(FORMATS)}")
    return str(fmt)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """An (N, K) matrix as GGUF blocks: ``blocks`` is a contiguous uint8 tensor of shape (N, K // 32 * block bytes).

    Attach it to a PersistentKernel like a float weight (``pk.attach_input(qt, name)``) on a backend whose
    ``persistent_weight_formats`` include ``format``.
    """

    blocks: Any
    format: str
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        import torch

        fmt = _check_format(self.format)
        if not isinstance(self.blocks, torch.Tensor) or self.blocks.dtype != torch.uint8:
            raise QuantError(f"{fmt} blocks must be a torch.uint8 tensor, got "
                             f"{getattr(self.blocks, 'dtype', type(self.blocks).__name__)}")
        n, k = (int(s) for s in self.shape)
        if n < 1 or k < 1 or k % BLOCK:
            raise QuantError(f"a {fmt} matrix must be (N, K) with K a positive multiple of {BLOCK}, got {self.shape}")
        want = (n, k // BLOCK * BLOCK_BYTES[fmt])
        if tuple(self.blocks.shape) != want:
            raise QuantError(f"{fmt} blocks of a {(n, k)} matrix must have shape {want} (K/{BLOCK} blocks of "
                             f"{BLOCK_BYTES[fmt]} bytes per row), got {tuple(self.blocks.shape)}")
        object.__setattr__(self, "shape", (n, k))

    @property
    def nbytes(self) -> int:
        return int(self.blocks.numel())

    def dequantize(self, rows: Any = None) -> Any:
        """float32 values of the whole matrix, or of ``rows`` (an index tensor: the result has its shape + (K,))."""
        return dequantize(self.blocks if rows is None else self.blocks[rows], self.format, self.shape[1])

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.format}, shape={self.shape}, {self.nbytes} bytes)"


def dequantize(blocks: Any, fmt: str, k: int) -> Any:
    """float32 values of block rows (any leading shape, last dim K / 32 * block bytes) with K columns."""
    import torch

    fmt = _check_format(fmt)
    lead = tuple(blocks.shape[:-1])
    b = blocks.reshape(*lead, k // BLOCK, BLOCK_BYTES[fmt])
    d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)  # (..., nb, 1)
    qs = b[..., 2:]
    out = torch.empty(*lead, k // BLOCK, BLOCK, dtype=torch.float32, device=blocks.device)  # one pass, in place
    if fmt == "q8_0":
        out.copy_(qs.view(torch.int8))
    else:
        torch.bitwise_and(qs, 15, out=out[..., :BLOCK // 2])
        torch.bitwise_right_shift(qs, 4, out=out[..., BLOCK // 2:])
        out.sub_(8)
    return out.mul_(d).reshape(*lead, k)


def quantize(weight: Any, fmt: str) -> QuantizedTensor:
    """An (N, K) float matrix (K a multiple of 32) as ``fmt`` blocks, byte for byte what ggml would write."""
    import torch

    fmt = _check_format(fmt)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise QuantError(f"quantize expects a 2-D float torch.Tensor (N, K), got "
                         f"{tuple(getattr(weight, 'shape', ()))} {getattr(weight, 'dtype', type(weight).__name__)}")
    n, k = weight.shape
    if k % BLOCK:
        raise QuantError(f"{fmt} needs rows of a multiple of {BLOCK} values; this matrix has K={k} (keep it in "
                         "float, or pad K)")
    x = weight.detach().to("cpu", torch.float32).reshape(n, k // BLOCK, BLOCK)
    if not bool(torch.isfinite(x).all()):
        raise QuantError(f"cannot quantize to {fmt}: the matrix holds NaN or inf values, which blocks cannot "
                         "represent; fix the weights first")
    if fmt == "q8_0":
        d = x.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        v = x * inv
        a = v.abs()
        whole = torch.floor(a)
        q = (torch.sign(v) * (whole + torch.floor(2 * (a - whole)))).to(torch.int8).view(torch.uint8)  # roundf
    else:
        top = torch.gather(x, -1, x.abs().argmax(dim=-1, keepdim=True))  # the signed value of largest magnitude
        d = top / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
        q = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    scale = d.to(torch.float16).view(torch.uint8)  # (n, nb, 2)
    blocks = torch.cat([scale, q], dim=-1).reshape(n, k // BLOCK * BLOCK_BYTES[fmt]).contiguous()
    return QuantizedTensor(blocks, fmt, (n, k))
