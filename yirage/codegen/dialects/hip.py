"""HIP spellings: CUDA's, with HIP's runtime header (hipcc/hiprtc; -ffp-contract=off for IEEE results).

Shuffles name their width (32): on a 64-wide wavefront each half exchanges within itself, so the 32-thread
slices the renderer reduces over work on wave32 and wave64 devices alike.
"""

from dataclasses import replace

from yirage.codegen.dialects.cuda import DIALECT as CUDA

DIALECT = replace(
    CUDA, name="hip", preamble="#include <hip/hip_runtime.h>",
    narrow={"float16": ("__half", "__half2float({p}[{i}])", "{p}[{i}] = __float2half_rn({v})"),
            "bfloat16": ("__hip_bfloat16", "__bfloat162float({p}[{i}])", "{p}[{i}] = __float2bfloat16({v})")},
    narrow_helpers={"float16": "#include <hip/hip_fp16.h>", "bfloat16": "#include <hip/hip_bf16.h>"},
    shuffle_xor="__shfl_xor({v}, {m}, 32)", shuffle_width=32,
)
