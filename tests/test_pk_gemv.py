"""The GPU layout of the PersistentKernel GEMV (yirage.persistent.cstyle_gemv), run on PoCL and read back.

There is no GPU here, so the GPU-shaped kernels run on the CPU OpenCL device (PoCL) with the runtime forced to the
GPU layout (``lanes=0``), in three dialect variants: OpenCL itself (rows reduced by the local-memory tree, loads
``vloadn``), and OpenCL with warp shuffles emulated in local memory (the slice/lane arithmetic and butterfly order
the CUDA and HIP kernels use) with wide loads that need 16-byte alignment, the run-time test passing or failing
(the vector path, then the scalar fallback, of the same kernel). Each step's GEMV outputs are compared with
float64 torch computed from the kernel's own inputs (read back, so no error carries from layer to layer): the
independent oracle. Shapes cover every branch of the load schedule (an unrolled loop of rounds, its remainder,
a partial last round, K not a multiple of the load width), a last work-group with rows past N, bias and residual
epilogues, three batch rows, float32/bfloat16/float16 weights.

Without a device: the CUDA dialect's wide-load element spellings are evaluated here in Python on packed bits
(vs torch's widening), and every dialect's GEMV is checked for its reduction (shuffles, no shared memory or
barrier on CUDA/HIP; a tree elsewhere) and its launch shape. NVRTC/ptxas for the CUDA sources: test_pk_render.py
and test_cuda_megakernel.py (spills: yirage_backend_cuda.check.check_persistent).
"""

from __future__ import annotations

import math
import re
import struct

import pytest
import torch
from pocl_layout import emulated_shuffles

import yirage as yr
from yirage.codegen.dialects import dialect
from yirage.persistent import cstyle_gemv
from yirage.persistent.cstyle import render_persistent

BATCH = 3
#: (hidden H, intermediate I, vocab V): every GEMV's K is H or I, its N one of 2I, H, V
SHAPES = {
    "smollm2-like": (576, 1544, 77),  # bf16: 2 loads + a last partial load (64 of 256); I: 6 + 8 left over
    "unrolled-loop": (64, 4928, 77),  # K = 4928: 2 trips of 8 loads, 3 more, a partial last load
    "scalar": (36, 100, 33),  # K not a multiple of 8 (bf16/f16: scalar loads); f32: only a partial load
    "wide-hidden": (2056, 64, 33),  # 3 x 2056 floats: too many to stage the RMSNorm in the GEMV (its own kernel)
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
def build(backend: str, h: int, i: int, v: int, dtype: torch.dtype, batch: int = BATCH, seed: int = 5):
    """embed -> rmsnorm_linear (+ bias) -> silu_mul_linear_with_residual -> linear_with_residual -> LM head."""
    gen = torch.Generator().manual_seed(seed)
    print(f"seed {seed}")
    seq = 4
    step, tokens = torch.arange(batch) % 3, torch.randint(0, v, (batch, seq), generator=gen)
    pk = yr.PersistentKernel(max_seq_length=seq, meta_tensors=[step, tokens], backend=backend)

    def w(*dims: int, name: str):
        return pk.attach_input((torch.randn(*dims, generator=gen) * 0.5).to(dtype), name)

    x = pk.new_tensor((batch, h), name="x")
    pk.embed_layer(pk.tokens_tensor, w(v, h, name="embed"), x)
    gu = pk.new_tensor((batch, 2 * i), name="gu")
    pk.rmsnorm_linear_layer(x, w(h, name="g1"), w(2 * i, h, name="w1"), gu, bias=w(2 * i, name="b1"))
    y = pk.new_tensor((batch, h), name="y")
    pk.silu_mul_linear_with_residual_layer(gu, w(h, i, name="w3"), x, y)
    z = pk.new_tensor((batch, h), name="z")
    pk.linear_with_residual_layer(y, w(h, h, name="w2"), y, z)
    logits = pk.new_tensor((batch, v), name="logits")
    pk.rmsnorm_linear_layer(z, w(h, name="g2"), w(v, h, name="head"), logits)
    pk.argmax_layer(logits, pk.new_tensor((batch, 1), dtype=torch.int64, name="next"))
    return pk


def rms(a: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma


def check_gemvs(pk) -> None:
    """Every GEMV output of the last step against float64 torch on the inputs the kernels read."""
    t = {name: pk.torch_tensors[name].double() for name in ("g1", "w1", "b1", "w3", "w2", "g2", "head")}
    got = {name: pk.read(name).double() for name in ("x", "gu", "y", "z", "logits")}
    gate, up = got["gu"].chunk(2, -1)
    cases = {  # output: (the GEMV's input row vectors, weight, epilogue)
        "gu": (rms(got["x"], t["g1"]), t["w1"], t["b1"]),
        "y": (gate * torch.sigmoid(gate) * up, t["w3"], got["x"]),
        "z": (got["y"], t["w2"], got["y"]),
        "logits": (rms(got["z"], t["g2"]), t["head"], 0.0),
    }
    for name, (a, weight, extra) in cases.items():
        want = a @ weight.t() + extra
        scale = a.abs() @ weight.abs().t() + (extra.abs() if isinstance(extra, torch.Tensor) else 0.0)
        err = ((got[name] - want).abs() / (scale + 1e-30)).max().item()
        assert err < 5e-5, f"{name}: max |GEMV - float64| is {err:.2e} of sum |a w| (K = {weight.shape[1]})"


opencl = pytest.mark.skipif(not yr.is_backend_available("opencl"), reason="the opencl backend is not available here")


VARIANTS = {"tree-vload": None, "shuffle-aligned": True, "shuffle-unaligned": False}
#: the scalar fallback is one loop for every shape: one shape runs it; 9 batch rows: 7 loads per round, not 8
#: (cstyle_gemv.LOAD_BUDGET), so the loop's trips, their remainder and the last partial load all move
CASES = [(shape, dtype, variant, BATCH) for shape in SHAPES for dtype in DTYPES for variant in VARIANTS
         if (variant != "shuffle-unaligned" or shape == "smollm2-like") and shape != "wide-hidden"] + [
    ("unrolled-loop", "bfloat16", "shuffle-aligned", 9), ("unrolled-loop", "float32", "tree-vload", 9),
    ("wide-hidden", "bfloat16", "shuffle-aligned", BATCH), ("smollm2-like", "bfloat16", "shuffle-aligned", 1)]


@opencl
@pytest.mark.parametrize(("shape", "dtype", "variant", "batch"), CASES,
                         ids=[f"{s}-{d}-{v}-batch{b}" for s, d, v, b in CASES])
def test_gpu_layout_gemv_matches_float64_on_pocl(gpu_layout, shape, dtype, variant, batch) -> None:
    aligned = VARIANTS[variant]
    if aligned is not None:
        gpu_layout.dialect = emulated_shuffles(aligned)
    pk = build("opencl", *SHAPES[shape], DTYPES[dtype], batch).compile()
    (rendered,) = gpu_layout.rendered
    source = rendered.source
    assert ("y_shfl_xor(" in source) == (aligned is not None)
    if shape != "scalar" or dtype == "float32":
        assert "vload" in source, "K is a multiple of the load width: wide loads"
    heads = {x.kernel: source.split(f" {x.kernel}(")[1].split(")")[0] for x in rendered.layers}
    staged = [x for x in rendered.layers if x.kernel.startswith("y_gemv") and " xin" in heads[x.kernel]]
    h, i, v = SHAPES[shape]  # a GEMV stages its RMSNorm / silu_mul where batch x K floats fit and its work-groups
    rows = cstyle_gemv.slice_shape(gpu_layout.dialect, 64, batch)[0]  # are few (else their own kernels run)

    def fits(k: int, n: int) -> bool:
        return k * batch <= cstyle_gemv.STAGED_FLOATS and -(-n // rows) <= cstyle_gemv.STAGED_GROUPS

    norms, silu = fits(h, 2 * i) + fits(h, v), fits(i, h)
    assert ("y_rmsnorm" in source) == (norms < 2) and ("y_silu_mul" in source) != silu, heads
    assert len(staged) == norms + silu, heads
    assert ("prefetch(" in source) == bool(staged), "a staged GEMV asks for its weight rows before its stage"
    assert pk(2) == 2
    check_gemvs(pk)


@pytest.mark.parametrize("name", ["cuda", "hip", "metal", "opencl"])
def test_each_dialect_reduces_a_row_with_what_it_declares(name) -> None:
    d = dialect(name)
    pk = build("reference", 576, 1544, 77, torch.bfloat16).compile()
    program = pk.program
    for group in (64, 256, 16):
        rendered = render_persistent(program, d, group)
        gemvs = [x for x in rendered.layers if x.kernel.startswith("y_gemv")]
        assert len(gemvs) == 4
        rows, width, shuffles = cstyle_gemv.slice_shape(d, group, program.batch)
        assert shuffles == (bool(d.shuffle_xor) and group >= 32), (name, group)
        for x in gemvs:
            n = program.layers[x.layer].output.dims[1]
            assert x.local == group and x.groups == math.ceil(n / (group // width)), x
            start = rendered.source.index(f" {x.kernel}(")
            text = rendered.source[start:rendered.source.find("\n}\n", start)]
            # an RMSNorm staged into the GEMV (cstyle_gemv._staged_norm) takes local memory and barriers of its own;
            # the row reduction after it (from the function-level red[] or lid) is what the dialect declares
            staged = " xin" in text
            k = program.layers[x.layer].inputs["input"].dims[1] // (2 if "silu" in program.layers[x.layer].kind else 1)
            fits = program.batch * k <= cstyle_gemv.STAGED_FLOATS and x.groups <= cstyle_gemv.STAGED_GROUPS
            assert staged == (fits and program.layers[x.layer].kind in ("rmsnorm_linear",
                                                                        "silu_mul_linear_with_residual")), (name, x)
            if staged:
                assert f"{d.local} float x[{program.batch * k}];" in text and d.barrier in text
                text = text[re.search(r"\n    (?:\S+ )+(?:red\[|lid = )", text).start():]
            assert (d.local + " " in text) == (d.barrier in text) == (not shuffles), (name, group)
            if shuffles:
                assert text.count(d.shuffle_xor.split("(")[0]) == 1 and f"m = {width // 2}" in text
            if name in ("cuda", "hip"):  # bfloat16 rows of 576 and 1544 (multiples of 8): 16-byte loads
                assert "const uint4 w0 = *(const uint4*)" in text


def widen(expr: str, words: tuple[int, ...]) -> float:
    """A CUDA element spelling evaluated in Python on a uint4 ``o`` (its words little-endian, as CUDA's)."""
    py = expr.replace("{o}", "o").replace("0xffff0000u", "0xffff0000").replace("0xffffu", "0xffff")
    py = py.replace("(unsigned short)", "")

    class Uint4:
        x, y, z, w = words

    def as_float(bits: int) -> float:
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]

    def half(bits: int) -> float:
        return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]

    return eval(py, {"o": Uint4, "__uint_as_float": as_float, "__half2float": lambda h: h, "__ushort_as_half": half})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_wide_loads_widen_each_element_like_torch(dtype) -> None:
    """The element order and bit arithmetic of CUDA's 16-byte loads, checked without a GPU."""
    load = dialect("cuda").wide_loads[dtype]
    values = torch.tensor([1.5, -2.25, 3.0e-3, 65504.0 if dtype == "float16" else 1e30, -0.0, 7.0, 1e-5, -123.5],
                          dtype=DTYPES[dtype])[:load.width]
    raw = values.view(torch.int16 if values.element_size() == 2 else torch.int32).numpy().tobytes()
    words = struct.unpack("<4I", raw)
    if dtype == "float32":  # a float4's elements are the floats themselves
        assert load.elements == ("{o}.x", "{o}.y", "{o}.z", "{o}.w")
        return
    got = [widen(e, words) for e in load.elements]
    assert got == values.double().tolist(), f"{dtype}: {got} != {values.tolist()}"
    assert load.align == 16 and load.load.startswith("const uint4 {o} = *(const uint4*)")
