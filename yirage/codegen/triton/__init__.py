"""The Triton renderer over ``KernelPlan``: a Python module of ``@triton.jit`` kernels plus their launches.

``render_triton(plan)`` returns the module's source and, per kernel, a
``TritonLaunch`` (kernel name, 1-D grid, arguments by buffer name, the
constexpr block sizes chosen from the shapes, num_warps, an optional status
check) and the scratch buffers the launcher allocates. Semantics follow the
C-family renderer: IEEE division and square root (``tl.div_rn``,
``tl.sqrt_rn``; rsqrt is ``1 / sqrt``), a float32 exp within 1 ulp on every
device, NaN-propagating max/min that keep the first operand on ties,
float16/bfloat16 widened to float32 as they load and rounded to nearest even
as they store, temporaries at compute type, ``tl.dot`` in ``"ieee"``
precision (never TF32). The emitted language is the Triton 3.0-3.5 subset
that FlagTree's vendor backends pin (no ``libdevice``, no tensor descriptors);
``check_supported`` refuses, before any text is produced, what it cannot
compute. Pure text: importing this package never imports triton.
"""

from yirage.codegen.launch import TritonLaunch
from yirage.codegen.triton.render import RENDERER_VERSION, TritonRendered, _Renderer, check_supported, schedule_knobs
from yirage.compiler.kernel_ir import KernelPlan


def render_triton(plan: KernelPlan) -> TritonRendered:
    """The plan's kernels as one Triton module, with how to launch each; raises UnsupportedExprError first."""
    return _Renderer(plan).render()


__all__ = ["RENDERER_VERSION", "TritonLaunch", "TritonRendered", "check_supported", "render_triton", "schedule_knobs"]
