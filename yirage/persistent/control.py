"""The PersistentKernel control buffer: one int64 array the device writes and the host reads between steps.

Why one definition: the C-family kernels (``cstyle``), the Triton task
kernels (``triton_tasks``), the launched and OpenCL runtimes that read them,
and the CPU runtime's numba loop all index the same few slots. Spelled in
five places, one runtime drifted to another order; here they are defined
once and every runtime takes its numbers from ``Ctl`` (numba code as plain
``int(Ctl.X)`` module constants, Triton as ``tl.constexpr(int(Ctl.X))``
globals, C sources as literals the renderer writes).

Layout (int64 slots)::

    0 ALIVE       rows still decoding in this step (0: the run is over)
    1 STEPS       steps the device committed (the host checks its own count against it)
    2 ERROR       0, or why the run stopped (CtlError)
    3 ERR_ROW     the batch row that caused it
    4 ERR_VALUE   the offending value (the out-of-range token id)
    5 STOP        non-zero: the host asks the device to stop between tasks
    6 SPARE_0     a runtime's own counters (the CPU runtime: idle threads that yielded their core)
    7 SPARE_1     (the CPU runtime: idle threads that slept)
    8 + b ACTIVE  row b decodes in this step

The header is ``HEADER`` slots (one 64-byte cache line of int64), the rows'
flags follow: ``size(batch)`` slots in all. The launched and OpenCL runtimes
stop between steps on the host, so their kernels never read ``STOP``; the
CPU runtime polls it between tasks, keeps its row flags in its own bool
array, and so allocates only the header, with its own slots after it.
"""

from __future__ import annotations

from enum import IntEnum


class Ctl(IntEnum):
    """Slot indices of the control buffer (see the module docstring for what each holds)."""

    ALIVE = 0
    STEPS = 1
    ERROR = 2
    ERR_ROW = 3
    ERR_VALUE = 4
    STOP = 5
    SPARE_0 = 6
    SPARE_1 = 7
    ACTIVE = 8  # ACTIVE + b: row b decodes in this step


class CtlError(IntEnum):
    """What ``ctl[Ctl.ERROR]`` holds; the host turns a non-zero kind into an exception after the run."""

    NONE = 0
    TOKEN = 1  # a token id outside the vocabulary (ERR_ROW: the row, ERR_VALUE: the id)
    COMM = 2  # a collective of a multi-rank run failed (the runtime raises the collective's own error)
    PIPE = 3  # the CPU runtime could not hand a collective to its communication thread


#: slots before the per-row flags: one cache line of int64
HEADER = int(Ctl.ACTIVE)


def size(batch: int) -> int:
    """Slots of a control buffer for ``batch`` rows (the header, then one ACTIVE flag per row)."""
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    return HEADER + batch


def _check() -> None:
    """Every slot below HEADER is one header slot, named once; ACTIVE starts right after them."""
    header = sorted(int(s) for s in Ctl if s != Ctl.ACTIVE)
    if header != list(range(HEADER)):
        raise AssertionError(f"yirage.persistent.control: header slots {header} must be 0 .. {HEADER - 1}, each "
                             "once, with ACTIVE right after them")


_check()

__all__ = ["HEADER", "Ctl", "CtlError", "size"]
