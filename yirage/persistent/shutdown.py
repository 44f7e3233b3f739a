"""Stop in-flight decodes when the interpreter exits because the main thread failed (Ctrl-C).

A long decode running in a non-main thread keeps the process alive: after
Ctrl-C in the main thread, Python joins every non-daemon thread before it
exits, so the user waits for the whole decode (tens of seconds). Runtimes
register here while a decode is in flight (``decoding``); a hook that
Python runs before it joins those threads (``threading._register_atexit``,
as ``concurrent.futures`` uses) asks each of them to ``stop()``, and later
runs are refused, so the process exits within a task or so.

Only when the main thread ended with an uncaught exception (KeyboardInterrupt
or an error, see ``sys.last_value``): a main thread that simply returns (or
calls ``sys.exit``) while workers decode keeps Python's usual meaning, and
the workers' results are complete.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from yirage.errors import YirageError
from yirage.locks import ForkSafeRLock


class InterpreterExitingError(YirageError, RuntimeError):
    """A decode stopped (or refused) because the interpreter is exiting after an error in the main thread."""


_running: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = ForkSafeRLock()
_state = {"stopping": ""}  # the main thread's exception, once in-flight decodes were told to stop


@contextmanager
def decoding(runtime: Any) -> Iterator[None]:
    """Register ``runtime`` (it has ``stop()``) for the duration of one decode; refuse one during exit."""
    with _lock:
        _refuse_if_stopping()
        _running.add(runtime)
    try:
        yield
    finally:
        with _lock:
            _running.discard(runtime)


def stopping() -> bool:
    """True once the exit hook has stopped in-flight decodes (their results are incomplete)."""
    return bool(_state["stopping"])


def _refuse_if_stopping() -> None:
    if _state["stopping"]:
        raise InterpreterExitingError(
            f"decoding stopped: the interpreter is exiting because the main thread ended with {_state['stopping']}; "
            "tokens/step hold the steps completed. To let worker threads finish, catch the exception in the main "
            "thread and join them")


def check_not_stopped() -> None:
    """Raise if the exit hook stopped the decode that just returned (its result is incomplete)."""
    _refuse_if_stopping()


def _stop_in_flight_decodes() -> None:
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # set for an uncaught exception
    if exc is None:
        return  # a normal end of the main thread: worker threads finish their decodes
    with _lock:
        _state["stopping"] = type(exc).__name__
        runtimes = list(_running)
    for runtime in runtimes:
        runtime.stop()


def _register() -> None:
    register = getattr(threading, "_register_atexit", None)  # private, but concurrent.futures relies on it
    if register is None:
        return  # an interpreter without the hook: threads are joined as usual
    try:
        register(_stop_in_flight_decodes)
    except RuntimeError:
        pass  # imported while the interpreter is already exiting: its threads are being joined, nothing to hook


_register()
