"""CUDA C++ spellings (NVRTC: no headers; compile with --fmad=false for IEEE pointwise results)."""

from yirage.codegen.dialect import Dialect, WideLoad

_WORDS = ("x", "y", "z", "w")
#: 16-byte loads (a uint4 holds 8 bfloat16/float16, low half first: CUDA is little-endian); widening is exact
WIDE_LOADS = {
    "float32": WideLoad(4, "const float4 {o} = *(const float4*)({p} + {i});", tuple(f"{{o}}.{c}" for c in _WORDS), 16),
    "bfloat16": WideLoad(8, "const uint4 {o} = *(const uint4*)({p} + {i});", tuple(
        e for c in _WORDS for e in (f"__uint_as_float({{o}}.{c} << 16)", f"__uint_as_float({{o}}.{c} & 0xffff0000u)")),
        16),
    "float16": WideLoad(8, "const uint4 {o} = *(const uint4*)({p} + {i});", tuple(
        e for c in _WORDS for e in (f"__half2float(__ushort_as_half((unsigned short)({{o}}.{c} & 0xffffu)))",
                                    f"__half2float(__ushort_as_half((unsigned short)({{o}}.{c} >> 16)))")), 16),
}

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
    shuffle_xor="__shfl_xor_sync(0xffffffffu, {v}, {m})", shuffle_width=32,
    wide_loads=WIDE_LOADS, aligned="(((unsigned long long)({p})) % {n} == 0)",
    prefetch='asm volatile("prefetch.global.L2 [%0];" :: "l"({p} + {i}))',
)
