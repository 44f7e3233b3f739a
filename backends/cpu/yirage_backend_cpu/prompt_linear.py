"""The cpu backend's projections for a prompt's prefill over Q8_0 / Q4_0 matrices (Backend.prompt_linear).

The torch prefill dequantizes every matrix to float32 per call (yirage.models.weights.dense) before a GEMM: for
a 16-token prompt of SmolLM2-135M that is 106 M weights widened each time, and its TTFT was 254 ms in Q4_0
against llama.cpp's 21 ms. Here the decode's own kernel reads the blocks as they are: the 8-row groups
(repacked.grouped, the decode runtime's copy), four prompt rows per pass over a group (quant_group), the rows
of W split over torch's thread count, the caller's thread and threads of their own (the kernels release the
GIL). Measured on SmolLM2 (2 cores, prefill alone, interleaved): Q4_0 2.7x / 2.1x / 1.8x / 1.6x / 0.96x
faster than dequantize + GEMM at 16 / 32 / 64 / 128 / 256 prompt rows, Q8_0 1.6x / 1.6x / 1.2x / 1.06x /
0.93x; so up to MAX_ROWS rows. x is rounded per block of 32 to int16 as in the decode (error at most 2^-16 of
the block's largest |x|, pk_quant); x holding inf or NaN takes the kernel's float32 path. Matrices whose rows
do not form whole groups stay with torch.

bfloat16 / float16 matrices: torch widens each to a float32 copy per call (the LM head's 28 M weights for the
one row a prompt's last position needs); the decode's float tiles (pk_tasks.linear: 2 weight rows x 4 prompt
rows, widened in registers) read them as they are, in float32 arithmetic as the decode. SmolLM2 bf16 prefill:
2.8x / 2.3x / 2.2x / 1.5x / 1.3x / 1.0x faster at 1 / 4 / 8 / 16 / 32 / 64 rows; so up to MAX_NARROW_ROWS.
float32 matrices stay with torch's GEMM, which reads them as fast.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from yirage_backend_cpu.pk_quant import Q4_0, Q4_0G, Q8_0, Q8_0G, linear_q
from yirage_backend_cpu.pk_tasks import BF16, F16, linear
from yirage_backend_cpu.quant_group import GROUP
from yirage_backend_cpu.repacked import block_code, grouped

#: prompt rows (batch x tokens) up to which the group kernels beat dequantize-then-GEMM (module docstring)
MAX_ROWS = 128
#: ... and for bfloat16 / float16 weights, which torch widens to a float32 copy per call (module docstring)
MAX_NARROW_ROWS = 32
NARROW = {torch.bfloat16: BF16, torch.float16: F16}  # weight dtype -> pk_tasks' code
_NONE = np.empty(0, np.float32)


class PromptLinear:
    """``x @ W.T`` for quantized or 16-bit ``W`` (see the module docstring); None where torch's should run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_key: tuple[int, int] = (0, 0)  # (pid, threads) the pool was made for: none survive a fork

    def __call__(self, x: Any, weight: Any) -> Any:
        from yirage.quant import QuantizedTensor

        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0:
            return None
        m = x.shape[0]
        if isinstance(weight, QuantizedTensor):
            return self._quantized(x, weight) if m <= MAX_ROWS else None
        if (isinstance(weight, torch.Tensor) and weight.dtype in NARROW and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.is_contiguous()
                and m <= MAX_NARROW_ROWS):
            n, k = weight.shape
            return self._run(linear, x, n, [(weight.data_ptr(), NARROW[weight.dtype], n0, n1)
                                            for n0, n1 in self._parts(n, 2)], lambda: _NONE)
        return None

    def _quantized(self, x: Any, weight: Any) -> Any:
        if weight.format not in ("q8_0", "q4_0"):
            return None
        blocks = weight.blocks
        n, k = (int(s) for s in weight.shape)
        if blocks.device.type != "cpu" or x.shape[1] != k or n % GROUP or not blocks.is_contiguous():
            return None
        code = block_code(blocks, weight.format)
        if code not in (Q8_0, Q4_0):  # non-finite scales: the exact row path, for torch's specials
            return None
        groups = grouped(blocks, n, code == Q8_0)
        gcode = Q8_0G if code == Q8_0 else Q4_0G
        m = x.shape[0]
        return self._run(linear_q, x, n, [(groups.data_ptr(), gcode, n0, n1) for n0, n1 in self._parts(n, GROUP)],
                         lambda: np.empty(m * k + 64, np.float32))  # x split in bytes per part (pk_quant)

    def _run(self, kernel: Any, x: Any, n: int, parts: list[tuple[int, int, int, int]], work: Any) -> Any:
        """``kernel`` (pk_tasks.linear or pk_quant.linear_q) over each part (address, code, n0, n1) of W's rows,
        the first on the caller's thread (torch's own worker may still be spinning beside), the others in
        the pool; (M, N) float32."""
        m, k = x.shape
        xs = x.detach().contiguous().numpy().reshape(-1)
        out = np.empty(m * n, np.float32)
        calls = [(xs, m, k, addr, code, n0, n1, out, n, _NONE, _NONE, work()) for addr, code, n0, n1 in parts]
        pool = self._threads(len(calls) - 1) if len(calls) > 1 else None
        others = [pool.submit(kernel, *args) for args in calls[1:]] if pool is not None else []
        kernel(*calls[0])
        for done in others:
            done.result()
        return torch.from_numpy(out).view(m, n)

    @staticmethod
    def _parts(n: int, align: int) -> list[tuple[int, int]]:
        """Row ranges of whole ``align``-row blocks (8-row groups; weight-row pairs), one per torch thread."""
        threads = max(1, min(torch.get_num_threads(), n // align))
        cuts = [(n // align) * i // threads * align for i in range(threads)] + [n]
        return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    def _threads(self, count: int) -> ThreadPoolExecutor:
        with self._lock:
            key = (os.getpid(), count)
            if self._pool is None or self._pool_key != key:
                if self._pool is not None and self._pool_key[0] == key[0]:
                    self._pool.shutdown(wait=False)  # another thread count: its idle threads end
                self._pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="yirage-prompt")
                self._pool_key = key
            return self._pool


_SHARED = PromptLinear()  # one per process (its pool starts on first use)


def prompt_linear() -> PromptLinear:
    """The process's one PromptLinear (one thread pool)."""
    return _SHARED
