"""The cpu backend's projections for a prompt's prefill over Q8_0 / Q4_0 and 16-bit matrices (Backend.prompt_linear).

The torch prefill dequantizes every Q8_0 / Q4_0 matrix to float32 per call (yirage.models.weights.dense) before a
GEMM: for a 16-token prompt of SmolLM2-135M that is 106 M weights widened each time, and its TTFT was 254 ms in
Q4_0 against llama.cpp's 21 ms. Here the decode's own kernel reads the blocks as they are: the 8-row groups
(repacked.grouped, the decode runtime's copy), four prompt rows per pass over a group (quant_group), x rounded
per block of 32 to int16 as in the decode (error at most 2^-16 of the block's largest |x|, pk_quant; x holding
inf or NaN takes the kernel's float32 path). Matrices whose rows do not form whole groups stay with torch.

bfloat16 / float16 matrices: torch widens each to a float32 copy per call (the LM head's 28 M weights for the
one row a prompt's last position needs); the decode's float tiles (pk_tasks.linear: 2 weight rows x 4 prompt
rows, widened in registers) read them as they are, in float32 arithmetic as the decode. float32 matrices go
the same way for short prompts (torch's GEMM reads them as they are; on an AMD EPYC the tiles were 1.46x / 2.4x /
1.25x / 1.11x / 1.05x / 0.94x faster at 1 / 4 / 16 / 32 / 64 / 128 rows).

bfloat16 activations (``InferEngine(prompt_dtype="bfloat16")``, bf16 matrices): native bf16 dot products where the
CPU has them (bf16_dot); else None (torch's bf16 matmul).

W's rows are split over torch's thread count, the parts run in one parallel region (``linear_parts``); each
weight's split is worked out on its first call and kept until the weight changes or goes (``Plan``). Whether the
tiles or torch's dequantize- or widen-then-GEMM run a prompt of M rows is timed once per machine, matrix shape and
row bucket (prompt_rows: the crossover moved from above 512 to 128-256 rows for Q8_0 between an AMD and an Intel
machine);
``YIRAGE_CPU_PROMPT_TILES`` overrides it. ``benchmark/prompt_rows.py`` prints both sides per row count.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numba import njit, prange

from yirage.config import eager_start
from yirage.models.prefill import torch_linear
from yirage_backend_cpu.bf16_dot import bf16_parts, usable
from yirage_backend_cpu.kernel_lib import FASTMATH
from yirage_backend_cpu.pk_entry import cached, compile_ahead, compiled, pending
from yirage_backend_cpu.pk_quant import Q4_0, Q4_0G, Q8_0, Q8_0G, linear_q_entry
from yirage_backend_cpu.pk_tasks import BF16, F16, F32, call_linear, linear_blocks_entry, linear_entry
from yirage_backend_cpu.prompt_rows import Fixed, Measured, choice
from yirage_backend_cpu.quant_group import GROUP
from yirage_backend_cpu.repacked import block_code, grouped
from yirage_backend_cpu.sources import tie_caches_to_sources
from yirage_backend_cpu.threads import guard

FLOAT_KINDS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}  # weight dtype -> prompt_rows kind
FLOAT_CODES = {torch.bfloat16: BF16, torch.float16: F16, torch.float32: F32}  # weight dtype -> pk_tasks' code


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", nogil=True, cache=True)
def linear_parts(xs, m, k, addrs, codes, n0s, n1s, out, n, work, entry, quant):  # type: ignore[no-untyped-def]
    """pk_tasks.linear (float tiles or quantized groups) through ``entry`` (pk_tasks.linear_entry's address) over
    each part (address, code, rows n0..n1) of W, the parts in one parallel region (numba's OpenMP team, which
    torch's threads share): a pool thread woken per call cost 75-90 us, 10 ms of a 16-token SmolLM2 prefill's 120
    projections."""
    none = work[0][:0]
    for p in prange(addrs.shape[0]):
        call_linear(entry, xs, m, k, addrs[p], codes[p], n0s[p], n1s[p], out, n, none, none, work[p], quant)


@dataclass(frozen=True)
class Plan:
    """How the tiles run one weight: its prompt_rows kind and shape, W's rows split into parts over torch's threads
    (each part's address, format code and rows n0..n1, as numpy columns), whether its format is quantized (then
    x is split in bytes per part: ``m * k + 64`` floats of work space per part, else 1)."""

    kind: str
    n: int
    k: int
    addrs: np.ndarray
    codes: np.ndarray
    n0s: np.ndarray
    n1s: np.ndarray
    quantized: bool


class PromptLinear:
    """``x @ W.T`` for quantized or 16-bit ``W`` (see the module docstring); None where torch's should run: where
    the tiles cannot read W, or ``rows`` (prompt_rows: timed on this machine by default) says torch's is faster
    for W's shape at x's row count."""

    def __init__(self, rows: Fixed | Measured | None = None) -> None:
        self._rows = rows  # None: prompt_rows.choice(), YIRAGE_CPU_PROMPT_TILES read per call
        # (id(source), torch threads) -> [weakref to source, its storage's stamp (_stamp), Plan or None]: a plan per
        # weight, made on its first call, not per call (25-40 us of Python a call, 120 calls in a prompt)
        self._plans: dict[tuple[int, int], list[Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, x: Any, weight: Any) -> Any:
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 0:  # a rounded prompt (prompt_dtype)
            if not usable(x, weight):
                return None
            run = lambda z: self._bf16(z, weight)  # noqa: E731
            kind, n, k = "bf16 x", int(weight.shape[0]), int(weight.shape[1])
        else:
            if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0:
                return None
            plan = self._plan(weight)
            if plan is None or x.shape[1] != plan.k or not _ready(plan.quantized):
                return None
            run = lambda z: self._run(z, plan)  # noqa: E731
            kind, n, k = plan.kind, plan.n, plan.k
        rows = self._rows or choice()
        if not rows.tiles(kind, n, k, x.shape[0], run, lambda z: torch_linear(z, weight), x.dtype):
            return None
        return run(x)

    def _plan(self, weight: Any) -> Plan | None:
        """``weight``'s Plan (None: the tiles cannot read it), made once per weight and thread count, and again
        when the tensor the tiles read (a Q8_0 / Q4_0 matrix's blocks) changes: in place (its torch version), or
        its storage, shape or layout (``.data = ...`` moves no version): a plan never hands compiled code the
        address of a buffer the tensor no longer holds."""
        from yirage.quant import QuantizedTensor

        source = weight.blocks if isinstance(weight, QuantizedTensor) else weight
        if not isinstance(source, torch.Tensor):
            return None
        key = (id(source), torch.get_num_threads())
        with self._lock:
            entry = self._plans.get(key)
        stamp = _stamp(source)
        if entry is not None and entry[0]() is source and entry[1] == stamp:
            return entry[2]
        plan = self._make_plan(weight)
        with self._lock:
            if not self._plans.get(key) or self._plans[key][0]() is not source:
                weakref.finalize(source, self._forget, key)
            self._plans[key] = [weakref.ref(source), stamp, plan]
        return plan

    def _forget(self, key: tuple[int, int]) -> None:
        with self._lock:
            entry = self._plans.get(key)
            if entry is not None and entry[0]() is None:
                del self._plans[key]

    def _make_plan(self, weight: Any) -> Plan | None:
        from yirage.quant import QuantizedTensor

        if isinstance(weight, QuantizedTensor):
            return self._quantized(weight)
        if (weight.dtype in FLOAT_KINDS and weight.device.type == "cpu" and weight.dim() == 2
                and weight.is_contiguous()):
            n, k = (int(s) for s in weight.shape)
            parts = [(weight.data_ptr(), FLOAT_CODES[weight.dtype], n0, n1) for n0, n1 in self._parts(n, 2)]
            return Plan(FLOAT_KINDS[weight.dtype], n, k, *_columns(parts), quantized=False)
        return None

    def _quantized(self, weight: Any) -> Plan | None:
        if weight.format not in ("q8_0", "q4_0"):
            return None
        blocks = weight.blocks
        n, k = (int(s) for s in weight.shape)
        if blocks.device.type != "cpu" or n % GROUP or not blocks.is_contiguous():
            return None
        code = block_code(blocks, weight.format)
        if code not in (Q8_0, Q4_0):  # non-finite scales: the exact row path, for torch's specials
            return None
        groups = grouped(blocks, n, code == Q8_0)
        gcode = Q8_0G if code == Q8_0 else Q4_0G
        parts = [(groups.data_ptr(), gcode, n0, n1) for n0, n1 in self._parts(n, GROUP)]
        return Plan(weight.format, n, k, *_columns(parts), quantized=True)

    def _bf16(self, x: Any, weight: Any) -> Any:
        """bf16 x @ bf16 W.T by native bf16 dot products (bf16_dot), float32 (M, N); W's rows split in pairs over
        torch's threads."""
        m, k = x.shape
        n = weight.shape[0]
        n0s, n1s = (np.array(column, np.int64) for column in zip(*self._parts(n, 2), strict=True))
        out = np.empty(m * n, np.float32)
        guard(lambda _: bf16_parts(x.data_ptr(), m, k, weight.data_ptr(), n0s, n1s, out, n))(None)  # fork check
        return torch.from_numpy(out).view(m, n)

    @staticmethod
    def _run(x: Any, plan: Plan) -> Any:
        """``linear_parts`` over the plan's parts of W's rows; (M, N) float32. W's buffers outlive the call (the
        caller holds them)."""
        m, k = x.shape
        xs = x.detach().contiguous().numpy().reshape(-1)
        out = np.empty(m * plan.n, np.float32)
        work_space = np.empty((plan.addrs.shape[0], m * k + 64 if plan.quantized else 1), np.float32)
        # Q8_0 / Q4_0 blocks through linear_entry's quantized half alone: a quantized model never compiles the tiles
        entry = int(compiled(linear_blocks_entry if plan.quantized else linear_entry).address)
        quant = int(compiled(linear_q_entry).address) if plan.quantized else 0
        guard(lambda _: linear_parts(xs, m, k, plan.addrs, plan.codes, plan.n0s, plan.n1s, out, plan.n, work_space,
                                     entry, quant))(None)
        return torch.from_numpy(out).view(m, plan.n)

    @staticmethod
    def _parts(n: int, align: int) -> list[tuple[int, int]]:
        """Row ranges of whole ``align``-row blocks (8-row groups; weight-row pairs), one per torch thread."""
        threads = max(1, min(torch.get_num_threads(), n // align))
        cuts = [(n // align) * i // threads * align for i in range(threads)] + [n]
        return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _ready(quantized: bool) -> bool:
    """Whether the tiles' entry points can run without waiting for a compile: compiled, or in numba's cache, or
    yirage's eager start is off (``YIRAGE_EAGER_START=0``: the call compiles them here, or waits for the child
    compiling them, as a cold process did before). Else torch's GEMM runs this call, and a child compiles them
    where none has them yet (pk_entry.compile_ahead): a cold process's first prompt does not wait 4-7 s for
    the tiles' compile, and its prompts take the tiles once they are in the cache."""
    entries = (linear_blocks_entry, linear_q_entry) if quantized else (linear_entry,)
    if all(entry.address is not None for entry in entries) or not eager_start():
        return True
    if any(pending(entry) for entry in entries):
        return False
    if all(cached(entry) for entry in entries):
        return True
    return compile_ahead(list(entries)) is None  # None: nothing left to a child (no cache): compiled here


def _stamp(t: Any) -> tuple[Any, ...]:
    """What a Plan of tensor ``t`` depends on: its version, storage address, shape and strides."""
    return t._version, t.data_ptr(), tuple(t.shape), t.stride()


def _columns(parts: list[tuple[int, int, int, int]]) -> tuple[np.ndarray, ...]:
    """The parts' (address, code, n0, n1) as four int64 columns."""
    return tuple(np.array(column, np.int64) for column in zip(*parts, strict=True))


_SHARED = PromptLinear()  # one per process


def prompt_linear() -> PromptLinear:
    """The process's one PromptLinear; a YIRAGE_CPU_PROMPT_TILES that names no mode fails here, at the prefill's
    start."""
    choice()
    return _SHARED


tie_caches_to_sources(globals())  # after every cached function above is defined
