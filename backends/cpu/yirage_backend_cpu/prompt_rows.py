"""Which projection runs a prompt's rows on this machine: the cpu backend's tiles or torch's, timed once per shape.

prompt_linear's tiles (quantized 8-row groups, float tiles, bf16 dot products) beat torch's dequantize- or
widen-then-GEMM at short prompts and lose at long ones, and where they cross depends on the CPU. SmolLM2's four
projection shapes summed, tiles' time / torch's (< 1: the tiles win), 2 threads, `benchmark/prompt_rows.py` on the
Intel machine (medians of 7) and the measurements prompt_linear's fixed limits came from on the AMD EPYC (medians
of 10; bf16x there: whole prefills):

    rows                               4     16     32     64    128    256    512
    Intel Xeon, AMX (2026-12-01) f32   0.82   0.94   1.24   1.38   1.58
                                 bf16  0.40   0.60   0.93   1.08   1.40   1.58   2.48
                                 q8_0  0.23   0.37   0.52   0.65   0.93   1.10   1.24
                                 q4_0  0.11   0.20   0.30   0.43   0.69   0.87   1.10
                                bf16x  0.81   1.81   2.81   3.83   6.10
    AMD EPYC (2026-11-27)        f32   0.42   0.80   0.90   0.95   1.06
                                 bf16         0.58   0.78   0.83   0.80   0.99   1.22
                                 q8_0         0.29   0.40   0.53   0.67   0.53   0.75
                                 q4_0         0.08   0.29   0.38   0.45   0.59   0.72
                                bf16x         0.83   1.02   1.08   1.21

Row limits fixed from the AMD machine made the Intel machine's bf16 prompt of 128 tokens 1.4x slower than its
float32 one. So each (weight kind, N, K, torch's thread count, row bucket) is timed the first time a prompt needs
it: both projections on seeded rows of the bucket's size (powers of two from 4), once each to compile and touch,
then 3-15 rounds interleaved (as many as fit ROUND_BUDGET); the side with the faster best round wins (another
process only ever adds time). A timing whose rounds spread (median over best) beyond NOISY was taken beside other
work: this process uses it, but it is not kept. Choices live in the compile cache
(``<cache>/cpu-prompt-rows/<machine>.json``, private, written atomically), keyed by the CPU model and flags,
torch's and numba's versions, numba's target CPU and the backend's sources, so later prompts and other processes
reuse them. A damaged file is reported and timed again. Not timed: rows above CAPS (torch's), and up to SMALLEST
rows where torch's side copies W (COPIES: the tiles').

The two sides round differently (the quantized tiles round x to int16 per block, as the decode does; float sums run
in another order), so the low bits of a prompt's logits follow the choice, which may differ between machines and,
for a timing too noisy to keep, between processes. ``YIRAGE_CPU_PROMPT_TILES``: ``measure`` (the default),
``fixed`` (FIXED's row limits, measured on the AMD EPYC: no timing, the same path on every machine and run),
``always`` (the tiles up to CAPS) or ``never`` (torch's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("yirage.cpu")

ENV = "YIRAGE_CPU_PROMPT_TILES"
MODES = ("measure", "fixed", "always", "never")
VERSION = 1
#: interleaved timed rounds per shape and bucket (each side's fastest counts): as many as fit ROUND_BUDGET seconds
#: per side by the untimed call, within ROUNDS (sub-millisecond calls on a VM spread most)
ROUNDS, ROUND_BUDGET = (3, 15), 0.05
NOISY = 1.5  # a side whose median round took more than this times its fastest was timed under load: not kept
SMALLEST = 4  # rows 1 .. 4 share the first bucket
#: the most prompt rows the tiles ever take, per weight kind (f32/bf16/f16: float32 x; "bf16 x": rounded x on bf16
#: matrices, prompt_dtype): nothing is timed above them. Measured up to 512 rows on two machines: torch's GEMM won
#: there for f32 above 64-128 rows, bf16 above 256, bf16 x above 16-128; the quantized tiles still won at 512 on the
#: AMD EPYC (0.72-0.75 of torch's time), so they are timed up to 1024
CAPS = {"q8_0": 1024, "q4_0": 1024, "bf16": 512, "f16": 512, "f32": 128, "bf16 x": 128}
#: kinds whose torch side widens or dequantizes W to a float32 copy per call: at SMALLEST rows or fewer it reads and
#: writes more memory than the tiles read for the same products (the LM head of a prompt's last row: 28 M weights
#: for SmolLM2, 44-63 ms against 1.2-3.6 ms, and six such calls were 0.4 s of a first prompt), so not timed there
COPIES = ("q8_0", "q4_0", "bf16", "f16")
#: YIRAGE_CPU_PROMPT_TILES=fixed: the row limits measured on the AMD EPYC (the table above; prompt_linear's history)
FIXED = {"q8_0": 512, "q4_0": 512, "bf16": 128, "f16": 128, "f32": 32, "bf16 x": 32}

Run = Callable[[Any], Any]  # x (rows, K) -> x @ W.T


class PromptRowsError(ValueError):
    """A YIRAGE_CPU_PROMPT_TILES value that names no mode."""


def bucket(m: int) -> int:
    """The row count a prompt of ``m`` rows is timed at: the next power of two, at least SMALLEST."""
    return max(SMALLEST, 1 << max(0, math.ceil(math.log2(m))))


class Fixed:
    """The tiles up to a row limit per weight kind (``limits``; CAPS where a kind is missing), no timing."""

    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = limits

    def tiles(self, kind: str, n: int, k: int, m: int, ours: Run, theirs: Run, dtype: Any) -> bool:
        return m <= min(self.limits.get(kind, CAPS[kind]), CAPS[kind])


class Measured:
    """The faster projection per (kind, N, K, threads, row bucket), timed once and kept in ``path`` (None: the
    compile cache's file for this machine, resolved on first use). ``clock``: seconds (tests pass a fake)."""

    def __init__(self, path: Path | None = None, clock: Callable[[], float] = time.perf_counter,
                 rounds: int | None = None) -> None:
        self._path, self._clock, self._rounds = path, clock, rounds
        self._choices: dict[str, dict[str, Any]] | None = None
        self._keeping = True  # False once the compile cache refused a write: choices stay in this process
        self._lock = threading.Lock()

    def tiles(self, kind: str, n: int, k: int, m: int, ours: Run, theirs: Run, dtype: Any) -> bool:
        """Whether ``ours`` (the tiles) beats ``theirs`` (torch's) at ``m`` rows of a (n, k) matrix of ``kind``;
        timed on ``dtype`` rows of bucket(m) the first time. Never above CAPS[kind]."""
        import torch

        if m > CAPS[kind]:
            return False
        if m <= SMALLEST and kind in COPIES:
            return True
        key = f"{kind} {n}x{k} rows<={bucket(m)} threads={torch.get_num_threads()}"
        known = self._choices.get(key) if self._choices is not None else None
        if known is not None:  # a kept or timed choice: no wait behind another thread's timing
            return bool(known["tiles"])
        with self._lock:  # one timing at a time, each once: two at once would time each other
            if self._choices is None:
                self._choices = self._read()
            record = self._choices.get(key)
            if record is None:
                record = self._choices[key] = self._time(key, bucket(m), k, ours, theirs, dtype)
                if record["spread"] <= NOISY and self._keeping:
                    self._write(key, record)
                else:  # another process took the cores meanwhile: this process's choice only, timed again later
                    logger.info("prompt rows: %s timed on a busy machine (median %.2fx the fastest round); not kept",
                                key, record["spread"])
        return bool(record["tiles"])

    def _time(self, key: str, rows: int, k: int, ours: Run, theirs: Run, dtype: Any) -> dict[str, Any]:
        import torch

        from yirage.log import working

        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows * 7919 + k)).to(dtype)
        with working("timing the cpu backend's prompt projections against torch's (once per machine and shape)"):
            warm = self._clock()
            ours(x)  # compiled (numba's cache) and its memory touched, outside the timing
            theirs(x)
            warm = self._clock() - warm
            rounds = self._rounds or max(ROUNDS[0], min(ROUNDS[1], int(2 * ROUND_BUDGET / max(warm, 1e-6))))
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(rounds):
                for tiles, run in ((True, ours), (False, theirs))[:: 1 if r % 2 == 0 else -1]:
                    start = self._clock()
                    run(x)
                    times[tiles].append(self._clock() - start)
        ours_s, theirs_s = min(times[True]), min(times[False])  # interference only ever adds time
        spread = max(statistics.median(times[side]) / max(min(times[side]), 1e-9) for side in times)
        record = {"tiles": ours_s <= theirs_s, "tiles_ms": round(ours_s * 1e3, 4), "torch_ms": round(theirs_s * 1e3, 4),
                  "spread": round(spread, 3)}
        logger.debug("prompt rows: %s: tiles %.3f ms, torch %.3f ms (spread %.2f) -> %s", key, ours_s * 1e3,
                     theirs_s * 1e3, spread, "tiles" if record["tiles"] else "torch")
        return record

    def path(self) -> Path:
        if self._path is None:
            from yirage.compiler.cache import cache_root, private_dir, private_root

            self._path = private_dir(private_root(cache_root()) / "cpu-prompt-rows") / f"{machine_key()}.json"
        return self._path

    def _read(self) -> dict[str, dict[str, Any]]:
        """The kept choices, or none (missing; damaged: a warning, then timed again; no usable compile cache: a
        warning, and choices kept in this process only)."""
        from yirage.compiler.cache import CacheError, read_private

        try:
            path = self.path()
        except CacheError as exc:  # a prompt runs without a cache: its choices are timed once per process
            self._refuse(exc)
            return {}
        if not path.exists():
            return {}
        try:
            doc = json.loads(read_private(path).decode("utf-8"))
            if not isinstance(doc, dict) or doc.get("version") != VERSION:
                raise ValueError("another version")
            choices = doc["choices"]
            if not isinstance(choices, dict) or not all(
                    isinstance(c, dict) and type(c.get("tiles")) is bool for c in choices.values()):
                raise ValueError("a choice is not a record with a boolean 'tiles'")
        except (OSError, UnicodeDecodeError, ValueError, KeyError) as exc:
            logger.warning("the cpu backend's prompt-row choices in %s are damaged (%s: %s); timing them again",
                           path, type(exc).__name__, exc)
            return {}
        return choices

    def _write(self, key: str, record: dict[str, Any]) -> None:
        """Add ``key`` to the file, keeping what other processes added meanwhile: read, merge and replace under an
        exclusive lock on a sidecar file (tensor-parallel ranks on one host time the same shapes at once)."""
        from yirage.compiler.cache import CacheError, write_private

        try:
            path = self.path()
            with _locked(path.with_name(f".{path.name}.lock")):
                choices = {**self._read(), key: record}
                write_private(path, json.dumps({"version": VERSION, "choices": choices}, indent=1, sort_keys=True)
                              + "\n")
        except (CacheError, OSError) as exc:
            self._refuse(exc)

    def _refuse(self, exc: Exception) -> None:
        if self._keeping:
            logger.warning("the cpu backend cannot keep its prompt-row choices in the compile cache (%s: %s); they "
                           "are timed again in each process. Set YIRAGE_CACHE_DIR to a private, writable directory",
                           type(exc).__name__, exc)
        self._keeping = False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created private) for the block; without fcntl (Windows) none: a lost choice
    is only timed again."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def machine_key() -> str:
    """What a choice depends on besides its shape: the CPU and its flags, torch's, numba's and the backend's code."""
    import numba
    import torch

    from yirage.system import cpu_flags, cpu_model
    from yirage_backend_cpu.sources import backend_fingerprint

    parts = [str(VERSION), cpu_model(), " ".join(sorted(cpu_flags())), torch.__version__, numba.__version__,
             os.environ.get("NUMBA_CPU_NAME", ""), os.environ.get("NUMBA_CPU_FEATURES", ""), backend_fingerprint()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


ALWAYS, NEVER = Fixed(CAPS), Fixed({kind: 0 for kind in CAPS})
_MEASURED = Measured()  # one per process: its choices and its lock shared by every prompt


def choice() -> Fixed | Measured:
    """The policy YIRAGE_CPU_PROMPT_TILES names (read per call, so a test or a user can switch it)."""
    mode = os.environ.get(ENV, "measure").strip().lower() or "measure"
    if mode == "measure":
        return _MEASURED
    if mode == "fixed":
        return Fixed(FIXED)
    if mode == "always":
        return ALWAYS
    if mode == "never":
        return NEVER
    raise PromptRowsError(f"{ENV}={os.environ[ENV]!r} is not a mode; use one of {', '.join(MODES)} (measure: time "
                          "the tiles against torch's once per machine and shape, the default)")
