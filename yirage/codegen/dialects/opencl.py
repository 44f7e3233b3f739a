"""OpenCL C spellings. FP_CONTRACT is off: an FMA would keep an overflowing product finite."""

from yirage.codegen.dialect import Dialect

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
)
