"""The names the C-family PersistentKernel renderer gives its buffers, and its launch record.

Shared by the renderer (``cstyle``), its sampling kernel (``cstyle_sample``) and the runtimes that allocate the
buffers and launch what was rendered (OpenCL, cuda), so none of them imports another for a name.
"""

from __future__ import annotations

from dataclasses import dataclass

from yirage.codegen.launch import Launch

#: internal buffers every rendering uses besides the program's tensors (CTL: the control buffer, laid out
#: by yirage.persistent.control)
CTL, STEP, XS, SCORES = "ctl", "step", "xs", "scores"


def tensor_name(index: int) -> str:
    """The buffer name of program tensor ``index`` (``PKTensor.index``)."""
    return f"t{index}"


@dataclass(frozen=True)
class PKLaunch(Launch):
    """A kernel-graph ``Launch`` of a PersistentKernel step: ``args`` name buffers (``t<index>`` for program
    tensors, or CTL/STEP/XS/SCORES), ``layer`` the program layer it runs (-1: begin/commit)."""

    layer: int = -1


__all__ = ["CTL", "SCORES", "STEP", "XS", "PKLaunch", "tensor_name"]
