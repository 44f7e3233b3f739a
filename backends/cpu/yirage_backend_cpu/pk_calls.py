"""How the CPU runtime calls its nogil ``decode`` so that Ctrl-C still stops it within milliseconds.

From the main thread with Python's default SIGINT handler, ``decode`` runs in
the main thread itself. CPython's C signal handler only notes the signal and
writes its number to the wakeup fd (``signal.set_wakeup_fd``); a watcher
thread reading that fd sets ``flags[STOP]``, every decode thread sees it
between tasks, ``decode`` returns, and Python raises KeyboardInterrupt as soon
as it is back in bytecode. Otherwise (another SIGINT handler, no wakeup fd)
``decode`` runs in a helper thread while the main thread waits in short,
interruptible slices. Either way the decode threads are one OpenMP team for
the whole call (pk_team); entering it from the main thread saves the hop to
the helper thread and keeps OpenMP to the team torch already has.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numba
import numpy as np

from yirage_backend_cpu.pk_tasks import STOP


def call_decode(decode: Any, threads: int, args: tuple[Any, ...], flags: np.ndarray) -> int:
    """``decode(*args)`` on ``threads`` numba threads, stoppable by Ctrl-C when called from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        # signals reach only the main thread: Ctrl-C there reaches this run through yirage.persistent.shutdown
        return _with_threads(decode, threads, args)
    if hasattr(signal, "set_wakeup_fd") and os.name == "posix" \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        with _WATCH.watching(flags):
            return _with_threads(decode, threads, args)
    return _in_helper_thread(decode, threads, args, flags)  # a custom SIGINT handler decides what Ctrl-C does


def _with_threads(decode: Any, threads: int, args: tuple[Any, ...]) -> int:
    """``decode`` on ``threads`` numba threads (numba's thread count is per calling thread)."""
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        return int(decode(*args))
    finally:
        numba.set_num_threads(previous)


class _SignalWatch:
    """One long-lived thread per process reading the wakeup fd while a decode runs in the main thread.

    Bytes it reads are passed on to the wakeup fd that was set before (asyncio
    sets one), so this watch is invisible to it.
    """

    def __init__(self) -> None:
        self.pid = -1
        self.write_fd = -1
        self.flags: np.ndarray | None = None
        self.forward = -1

    def _start(self) -> None:
        read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd needs a non-blocking fd
        self.pid = os.getpid()
        threading.Thread(target=self._serve, args=(read_fd,), name="yirage-pk-sigint", daemon=True).start()

    def _serve(self, read_fd: int) -> None:
        while True:
            data = os.read(read_fd, 64)
            flags = self.flags
            if flags is not None and signal.SIGINT in data:
                flags[STOP] = 1  # every decode thread checks it between tasks
            if self.forward >= 0:
                try:
                    os.write(self.forward, data)
                except BlockingIOError:  # a full wakeup pipe: CPython drops such bytes the same way
                    continue

    @contextlib.contextmanager
    def watching(self, flags: np.ndarray) -> Iterator[None]:
        if self.pid != os.getpid():  # first use, or a forked child: threads do not survive fork
            self._start()
        self.flags = flags
        self.forward = signal.set_wakeup_fd(self.write_fd)
        try:
            yield
        finally:
            signal.set_wakeup_fd(self.forward)
            self.forward = -1
            self.flags = None


_WATCH = _SignalWatch()


class _Job:
    def __init__(self, decode: Any, threads: int, args: tuple[Any, ...]) -> None:
        self.decode, self.threads, self.args = decode, threads, args
        self.done = threading.Event()
        self.steps = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.steps = _with_threads(self.decode, self.threads, self.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which re-raises it
            self.error = exc
        finally:
            self.done.set()

    def wait(self) -> None:
        """Wait until the job ends, even through further Ctrl-C presses: its memory must outlive it."""
        while not self.done.is_set():
            try:
                self.done.wait(0.05)
            except KeyboardInterrupt:
                continue  # already stopping; the first KeyboardInterrupt is re-raised by the caller


class _Helper:
    """One long-lived thread that runs ``decode`` for the main thread (a new one per call costs ~0.25 ms).

    Re-created in a forked child (threads do not survive fork). Only the
    main thread submits, and it waits for each job, so one thread suffices.
    """

    def __init__(self) -> None:
        self.pid = -1
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()

    def submit(self, job: _Job) -> None:
        if self.pid != os.getpid():
            self.pid, self.jobs = os.getpid(), queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self.jobs,), name="yirage-pk-decode", daemon=True).start()
        self.jobs.put(job)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
        while True:
            jobs.get().run()


_HELPER = _Helper()


def _in_helper_thread(decode: Any, threads: int, args: tuple[Any, ...], flags: np.ndarray) -> int:
    """``decode`` in the helper thread while this one waits in short slices; on KeyboardInterrupt set
    ``flags[STOP]``, wait for the run to end, re-raise."""
    job = _Job(decode, threads, args)
    _HELPER.submit(job)
    try:
        while not job.done.wait(0.05):
            pass
    except KeyboardInterrupt:
        flags[STOP] = 1  # every decode thread checks it between tasks, so the wait below is short
        job.wait()
        raise
    if job.error is not None:
        raise job.error
    return job.steps
