"""OpenCL does not survive fork(): a child refuses the backend instead of hanging.

An OpenCL runtime keeps threads and locks of its own (PoCL's CPU device runs a pool of worker threads and
guards its queues with mutexes). ``fork()`` copies the memory of a process, not its threads: a child of a
process that had loaded an OpenCL runtime inherits that runtime's state with its threads gone and perhaps a
lock held, so its first enqueue, build or even device query blocks forever, and SIGINT does not reach it
inside the driver. So once pyopencl is loaded, a forked child raises ``OpenCLForkError`` at every entry to the
backend (compile stages, the compiled program's call, the PersistentKernel runtime, ``check_process``) with
the fixes: the 'spawn' or 'forkserver' start methods, or creating the graph or engine only in the child of a
parent that never loaded OpenCL.
"""

from __future__ import annotations

import os
import sys

from yirage.errors import YirageError


class OpenCLForkError(YirageError, RuntimeError):
    """The opencl backend used in a child forked from a process that had loaded an OpenCL runtime."""


_state = {"forked_from": 0}


def _after_fork_in_child() -> None:
    if "pyopencl" in sys.modules:  # the parent may have started the runtime's threads
        _state["forked_from"] = os.getppid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def check() -> None:
    """Raise OpenCLForkError in a child forked after its parent loaded pyopencl (see the module docstring)."""
    if _state["forked_from"]:
        raise OpenCLForkError(
            f"this process was forked from process {_state['forked_from']}, which had loaded an OpenCL runtime; "
            "OpenCL runtimes do not survive fork() (their threads are gone in the child, and a call would block "
            "forever). Use the 'spawn' or 'forkserver' start method (multiprocessing.set_start_method('spawn'), "
            "or DataLoader(multiprocessing_context='spawn')), or create the graph or engine in a process whose "
            "parent never used the opencl backend")
