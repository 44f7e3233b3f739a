"""HIP spellings: CUDA's, with HIP's runtime header (hipcc/hiprtc; -ffp-contract=off for IEEE results)."""

from dataclasses import replace

from yirage.codegen.dialects.cuda import DIALECT as CUDA

DIALECT = replace(
    CUDA, name="hip", preamble="#include <hip/hip_runtime.h>",
    narrow={"float16": ("__half", "__half2float({p}[{i}])", "{p}[{i}] = __float2half_rn({v})"),
            "bfloat16": ("__hip_bfloat16", "__bfloat162float({p}[{i}])", "{p}[{i}] = __float2bfloat16({v})")},
    narrow_helpers={"float16": "#include <hip/hip_fp16.h>", "bfloat16": "#include <hip/hip_bf16.h>"},
)
