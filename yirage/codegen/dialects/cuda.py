"""CUDA C++ spellings (NVRTC: no headers; compile with --fmad=false for IEEE pointwise results)."""

from yirage.codegen.dialect import Dialect

CUDA_IDS = {"global": "((long long)blockIdx.x * blockDim.x + threadIdx.x)", "group": "blockIdx.x",
            "local": "threadIdx.x", "local_size": "blockDim.x"}

DIALECT = Dialect(
    name="cuda",
    preamble="",
    kernel='extern "C" __global__ void',
    param=lambda i, ctype, name, writable: f"{'' if writable else 'const '}{ctype}* __restrict__ {name}",
    ids=CUDA_IDS,
    barrier="__syncthreads();",
    barrier_global="__syncthreads();",
    local="__shared__",
    inline="__device__ __forceinline__",
    index_type="long long",
    types={"float32": "float", "float64": "double", "int32": "int", "int64": "long long"},
    math={"exp": "exp", "sqrt": "sqrt", "erf": "erf", "pow": "pow", "int_as_float": "__int_as_float"},
    infinity={"float32": "__int_as_float(0x7f800000)", "float64": "__longlong_as_double(0x7ff0000000000000LL)"},
    launch_bounds=lambda n: f"__launch_bounds__({n}) ", host_gemm=True,
    unsigned={"uint32": "unsigned int", "uint64": "unsigned long long"}, bits="__float_as_uint({x})",
    narrow={"float16": ("__half", "__half2float({p}[{i}])", "{p}[{i}] = __float2half_rn({v})"),
            "bfloat16": ("__nv_bfloat16", "__bfloat162float({p}[{i}])", "{p}[{i}] = __float2bfloat16_rn({v})")},
    narrow_helpers={"float16": "#include <cuda_fp16.h>", "bfloat16": "#include <cuda_bf16.h>"},
)
