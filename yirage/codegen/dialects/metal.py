"""Metal Shading Language spellings (compile with fast math off). MSL has no double and no erf."""

from yirage.codegen.dialect import Dialect

DIALECT = Dialect(
    name="metal",
    preamble="#include <metal_stdlib>\nusing namespace metal;",
    kernel="kernel void",
    param=lambda i, ctype, name, writable: f"device {'' if writable else 'const '}{ctype}* {name} [[buffer({i})]]",
    ids={"global": "gid_", "group": "wid_", "local": "lid_", "local_size": "lsz_"},
    id_params=("uint gid_ [[thread_position_in_grid]]", "uint wid_ [[threadgroup_position_in_grid]]",
               "uint lid_ [[thread_position_in_threadgroup]]", "uint lsz_ [[threads_per_threadgroup]]"),
    barrier="threadgroup_barrier(mem_flags::mem_threadgroup);",
    barrier_global="threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);",
    local="threadgroup",
    inline="inline",
    index_type="long",
    types={"float32": "float", "int32": "int", "int64": "long"},
    math={"exp": "precise::exp", "sqrt": "precise::sqrt", "pow": "precise::pow", "int_as_float": "as_type<float>"},
    infinity={"float32": "INFINITY"},
    unsigned={"uint32": "uint", "uint64": "ulong"}, bits="as_type<uint>({x})",
    narrow={"float16": ("half", "float({p}[{i}])", "{p}[{i}] = half({v})"),
            "bfloat16": ("bfloat", "float({p}[{i}])", "{p}[{i}] = bfloat({v})")},  # bfloat: MSL 3.1
)
