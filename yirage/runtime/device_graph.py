"""Device graphs: a backend's recording of one compiled call, replayed without the host's launch work.

A backend that has them (CUDA graphs) returns one from ``Backend.capture``.
What it returns is checked here once, at capture, so a plugin's bug is
reported with the plugin's name instead of as wrong numbers later: it must
have ``replay()`` and ``check_status()``, and ``replay()`` must give the
graph's declared outputs, on the backend's device, as the same tensors on
every replay (they are the captured outputs, overwritten in place).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yirage.errors import PluginError
from yirage.runtime.executable import Executable, plugin_of


class DeviceGraph:
    """A checked device graph: ``replay()`` returns the captured output tensors, refreshed."""

    def __init__(self, captured: Any, executable: Executable) -> None:
        self._captured, self.executable = captured, executable
        self.outputs: list[Any] | None = None

    def replay(self) -> list[Any]:
        out = self._captured.replay()
        if self.outputs is None:
            self._check_first(out)
            self.outputs = list(out)
        elif type(out) is not list or len(out) != len(self.outputs) or \
                any(a is not b for a, b in zip(out, self.outputs, strict=True)):
            raise _plugin_error(self.executable, "replay() returned other tensors than on its first replay; a "
                                "replay must write the captured outputs in place")
        return self.outputs

    def check_status(self) -> None:
        self._captured.check_status()

    def _check_first(self, out: Any) -> None:
        import torch

        declared = self.executable._outs
        device = self.executable.backend.torch_device
        ok = type(out) is list and len(out) == len(declared) and all(
            type(o) is torch.Tensor and o.dtype is dtype and o.shape == dims and o.device.type == device
            for o, (dims, dtype) in zip(out, declared, strict=True))
        if not ok:
            raise self.executable._bad_outputs(out)


def capture(executable: Executable, inputs: Sequence[Any]) -> DeviceGraph | None:
    """The backend's device graph of one call of ``executable`` on ``inputs``, or None if it has none."""
    captured = executable.backend.capture(executable, inputs)
    if captured is None:
        return None
    missing = [m for m in ("replay", "check_status") if not callable(getattr(captured, m, None))]
    if missing:
        raise _plugin_error(executable, f"capture() returned {type(captured).__name__} without "
                            f"{' and '.join(m + '()' for m in missing)}")
    return DeviceGraph(captured, executable)


def _plugin_error(executable: Executable, problem: str) -> PluginError:
    return PluginError(f"backend {executable.backend.name!r} (from {plugin_of(executable.backend)}): {problem}. "
                       "This is a bug in the plugin: report it to its authors; meanwhile turn graph capture off "
                       "with FusedInferEngine(..., device_graphs=False)")
