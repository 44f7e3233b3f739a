"""OpenCL C spellings. FP_CONTRACT is off: an FMA would keep an overflowing product finite."""

from yirage.codegen.dialect import Dialect, WideLoad

_LANES = tuple(f"s{j}" for j in range(8))
#: vloadn needs only element alignment, so no run-time address test; bfloat16 widens by its bits, exactly
WIDE_LOADS = {
    "float32": WideLoad(4, "const float4 {o} = vload4(0, {p} + {i});", tuple(f"{{o}}.{c}" for c in _LANES[:4])),
    "bfloat16": WideLoad(8, "const ushort8 {o} = vload8(0, {p} + {i});",
                         tuple(f"as_float((uint){{o}}.{c} << 16)" for c in _LANES)),
    "float16": WideLoad(8, "const float8 {o} = vload_half8(0, {p} + {i});", tuple(f"{{o}}.{c}" for c in _LANES)),
}

DIALECT = Dialect(
    name="opencl",
    preamble="#pragma OPENCL FP_CONTRACT OFF",
    kernel="__kernel void",
    param=lambda i, ctype, name, writable: f"__global {'' if writable else 'const '}{ctype}* {name}",
    ids={"global": "get_global_id(0)", "group": "get_group_id(0)", "local": "get_local_id(0)",
         "local_size": "get_local_size(0)"},
    barrier="barrier(CLK_LOCAL_MEM_FENCE);",
    barrier_global="barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);",
    local="__local",
    inline="inline",
    index_type="long",
    types={"float32": "float", "float64": "double", "int32": "int", "int64": "long"},
    math={"exp": "exp", "sqrt": "sqrt", "erf": "erf", "pow": "pow", "int_as_float": "as_float"},
    infinity={"float32": "INFINITY", "float64": "(double)INFINITY"},
    unsigned={"uint32": "uint", "uint64": "ulong"}, bits="as_uint({x})",
    double_pragma="#pragma OPENCL EXTENSION cl_khr_fp64 : enable",
    narrow={"float16": ("half", "vload_half({i}, {p})", "vstore_half_rte({v}, {i}, {p})"),
            "bfloat16": ("ushort", "as_float((uint){p}[{i}] << 16)", "{p}[{i}] = y_to_bf16({v})")},
    narrow_helpers={"bfloat16": "inline ushort y_to_bf16(float f) { uint u = as_uint(f); return f != f ? "
                                "(ushort)0x7fc0 : (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }"},
    wide_loads=WIDE_LOADS, prefetch="prefetch((const __global uchar*)({p} + {i}), 1)",
)
