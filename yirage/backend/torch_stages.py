"""``TorchLoweringStages``: the compile path of a backend that runs kernel plans as unfused torch ops.

The fallback of every backend whose own compiler is missing (the domestic accelerators without their
vendor's Triton) and the whole of the core ``torch`` backend: a ``KernelPlan`` becomes a
``yirage.codegen.torch_plan.TorchPlan`` on the backend's ``torch_device``, correct wherever torch runs.

Why ``compile(plan, graph)`` and not render/build/load: nothing is built. The stages exist to cache a
compiler's output on disk; here the "output" is a list of Python closures made in well under a
millisecond, which cannot be stored and need not be (the per-graph executable cache of
``yirage.runtime.graphs`` already compiles a graph once per backend). Going through ``compile_cached``
would write a file per plan only to read the plan back from it.

How a backend uses it::

    class AscendBackend(TorchLoweringStages, Backend):   # the mixin first, so its compile() wins
        name = "ascend"
        torch_device = "npu"        # the torch device TYPE its tensors live on (inputs are checked against it)
        ...                         # probe(), device_info(), memory_info() as usual

It gets ``kernel_dtypes`` (all six) and ``compile``. A backend with a faster path for some plans
overrides ``compile`` and calls ``self.torch_lowering(plan)`` where it falls back (log why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

logger = logging.getLogger("yirage.backend")

#: every dtype the torch-device lowering computes (float16/bfloat16 through float32)
TORCH_LOWERING_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64"})


class TorchLoweringStages:
    """Mixin for ``Backend`` subclasses: compile kernel plans into torch ops on ``self.torch_device``.

    What the backend must set: ``torch_device`` (a torch device type such as ``"npu"``, ``"mlu"``,
    ``"musa"``, ``"cuda"`` or ``"cpu"``; torch must know it, i.e. the vendor's torch adapter is imported
    by ``probe()`` or earlier) and a ``probe()`` that is ok only where that device exists.
    """

    kernel_dtypes: ClassVar[frozenset[str]] = TORCH_LOWERING_DTYPES
    torch_device: ClassVar[str]
    name: ClassVar[str]

    def compile(self, plan: Any, graph: Any) -> Callable[[Sequence[Any]], list[Any]]:
        """``run(inputs) -> outputs`` executing ``plan`` kernel by kernel as torch ops (``graph`` is not read)."""
        self.require_available()  # type: ignore[attr-defined]  # from Backend
        return self.torch_lowering(plan)

    def torch_lowering(self, plan: Any) -> Callable[[Sequence[Any]], list[Any]]:
        """The torch-device lowering of ``plan`` on this backend's device, for backends that fall back to it."""
        from yirage.codegen.torch_plan import TorchPlan

        logger.debug("backend %r runs plan %s as torch ops on %r", self.name, plan.digest[:12], self.torch_device)
        return TorchPlan(plan, self.torch_device)
