"""Running the opencl backend's PersistentKernel on PoCL in the GPU layout (``lanes=0``), optionally with warp
shuffles emulated in local memory: how kernels written for CUDA/HIP get checked on a machine without a GPU
(test_pk_gemv.py, test_pk_render.py). The ``gpu_layout`` fixture is in conftest.py."""

from __future__ import annotations

import re
from dataclasses import replace

from yirage.codegen.dialects import dialect
from yirage.persistent.cstyle import render_persistent

SHUFFLE_HELPER = """
inline float y_shfl_xor(__local float* sh, float v, int m) {
    barrier(CLK_LOCAL_MEM_FENCE);
    sh[get_local_id(0)] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    return sh[get_local_id(0) ^ m];
}"""


def emulated_shuffles(aligned: bool):
    """OpenCL with ``shuffle_xor`` spelled as an exchange through local memory (every thread of the work-group
    reaches each call, as the renderer guarantees for a warp), and wide loads that ask for a run-time alignment
    test that says ``aligned``."""
    base = dialect("opencl")
    return replace(base, name="opencl (emulated shuffles)", preamble=base.preamble + SHUFFLE_HELPER,
                   shuffle_xor="y_shfl_xor(y_sh, {v}, {m})", shuffle_width=32,
                   wide_loads={k: replace(v, align=16) for k, v in base.wide_loads.items()},
                   aligned="(((ulong)({p})) % {n} == 0)" if aligned else "(((ulong)({p})) % {n} == 1)")


def declare_shuffle_scratch(source: str) -> str:
    """Give each kernel that calls ``y_shfl_xor`` its local exchange array (OpenCL: declared at kernel scope)."""
    parts = re.split(r"(?m)^(?=__kernel void )", source)
    return "".join(p.replace(") {\n", ") {\n    __local float y_sh[1024];\n", 1) if "y_shfl_xor(y_sh" in p else p
                   for p in parts)


def force_gpu_layout(monkeypatch):
    """Run the opencl backend's PersistentKernel in the GPU layout, in the dialect the test sets (``.dialect``)."""
    from yirage_backend_opencl import OpenCLBackend
    from yirage_backend_opencl import pk_runtime as runtime

    class Forced:
        dialect = runtime.DIALECT
        rendered: list = []

    def render(program, d, group, lanes):
        rendered = render_persistent(program, Forced.dialect, group, lanes)
        Forced.rendered.append(rendered)
        return replace(rendered, source=declare_shuffle_scratch(rendered.source))

    monkeypatch.setattr(runtime, "render_persistent", render)
    monkeypatch.setattr(OpenCLBackend, "persistent_runtime",
                        lambda self, program, config: runtime.OpenCLPersistentRuntime(program, config, lanes=0))
    return Forced
