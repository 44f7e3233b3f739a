"""PersistentKernel layers as data: the LayerSpec table, the descriptor encoder, the frozen program.

The expected descriptor rows are written out here from the layer parameters
and the tensors' registration order, not produced by the encoder under test.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import yirage as yr
from yirage.persistent.descriptor import ABSENT, encode
from yirage.persistent.kernel import PersistentKernel
from yirage.persistent.layers import Layer, LayerError, PKTensor
from yirage.persistent.program import PersistentProgram
from yirage.persistent.specs import (
    ARG_COLUMNS,
    KIND_CODES,
    LAYER_SPECS,
    FloatCol,
    IntCol,
    Partition,
    layout_fingerprint,
)

BATCH, SEQ, HIDDEN, VOCAB, KV_HEADS, GROUP, HEAD_DIM = 2, 8, 16, 32, 2, 1, 4


def test_every_layer_method_has_a_spec_and_every_spec_a_method() -> None:
    methods = {name for name in dir(PersistentKernel) if name.endswith("_layer") and not name.startswith("_")}
    assert methods == {spec.method for spec in LAYER_SPECS.values()}
    assert all(spec.kind == kind for kind, spec in LAYER_SPECS.items())
    assert sorted(KIND_CODES.values()) == list(range(len(LAYER_SPECS)))
    for spec in LAYER_SPECS.values():
        assert len(spec.roles) == len(set(spec.roles)) <= len(ARG_COLUMNS), spec.kind
        assert spec.optional <= set(spec.roles) and {r for r, _ in spec.reads} <= set(spec.roles), spec.kind
        assert set(spec.writes) <= set(spec.roles) and spec.meta <= {"tokens", "step"}, spec.kind
        assert spec.token_table is None or spec.token_table in spec.roles, spec.kind
        assert all(d.role in spec.roles for d in spec.dims), spec.kind
    assert [s.kind for s in LAYER_SPECS.values() if s.picks_token] == ["argmax", "sample"]


def test_descriptor_columns_are_named_unique_and_not_shared_within_a_kind() -> None:
    for enum in (IntCol, FloatCol):
        assert sorted(c.value for c in enum) == list(range(len(enum)))  # unique and dense
        assert len({c.name for c in enum}) == len(enum)
    fixed = {IntCol.KIND, IntCol.OUTPUT, IntCol.N, IntCol.TASKS, *ARG_COLUMNS}
    for spec in LAYER_SPECS.values():
        for param in spec.params:
            assert isinstance(param.column, IntCol if param.type is int else FloatCol), (spec.kind, param)
        int_cols = [p.column for p in spec.params if p.type is int] + [d.column for d in spec.dims]
        float_cols = [p.column for p in spec.params if p.type is float]
        assert len(set(int_cols)) == len(int_cols) and not set(int_cols) & fixed, spec.kind
        assert len(set(float_cols)) == len(float_cols), spec.kind


def _small_kernel(backend: str = "reference") -> tuple[PersistentKernel, dict[str, PKTensor]]:
    """embed -> rmsnorm_linear(+bias) -> attention -> linear+residual -> rmsnorm_linear -> silu -> head -> sample."""
    gen = torch.Generator().manual_seed(0)
    step = torch.zeros(BATCH, dtype=torch.int64)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    pk = PersistentKernel(max_seq_length=SEQ, meta_tensors=[step, tokens], backend=backend, num_workers=1,
                          num_local_schedulers=0)
    qkv_cols = KV_HEADS * (GROUP + 2) * HEAD_DIM
    attn_cols = KV_HEADS * GROUP * HEAD_DIM

    def attach(name: str, *dims: int) -> PKTensor:
        return pk.attach_input(torch.randn(*dims, generator=gen), name)

    t = {"tokens": pk.tokens_tensor}
    t["embed"] = attach("embed", VOCAB, HIDDEN)
    t["norm1"], t["wqkv"], t["bqkv"] = attach("norm1", HIDDEN), attach("wqkv", qkv_cols, HIDDEN), attach("bqkv",
                                                                                                         qkv_cols)
    t["kc"] = pk.attach_input(torch.zeros(BATCH, KV_HEADS, SEQ, HEAD_DIM), "kc")
    t["vc"] = pk.attach_input(torch.zeros(BATCH, KV_HEADS, SEQ, HEAD_DIM), "vc")
    t["cos"], t["sin"] = attach("cos", SEQ, HEAD_DIM), attach("sin", SEQ, HEAD_DIM)
    t["wo"], t["norm2"], t["wgu"] = attach("wo", HIDDEN, attn_cols), attach("norm2", HIDDEN), attach("wgu", 64, HIDDEN)
    t["wd"], t["norm3"], t["head"] = attach("wd", HIDDEN, 32), attach("norm3", HIDDEN), attach("head", VOCAB, HIDDEN)
    for name, dims, dtype in (("x", (BATCH, HIDDEN), "float32"), ("qkv", (BATCH, qkv_cols), "float32"),
                              ("attn", (BATCH, attn_cols), "float32"), ("h", (BATCH, HIDDEN), "float32"),
                              ("gu", (BATCH, 64), "float32"), ("h2", (BATCH, HIDDEN), "float32"),
                              ("logits", (BATCH, VOCAB), "float32"), ("ids", (BATCH, 1), "int64")):
        t[name] = pk.new_tensor(dims, dtype, name=name)
    pk.embed_layer(t["tokens"], t["embed"], t["x"], grid_dim=(2, 1, 1))
    pk.rmsnorm_linear_layer(t["x"], t["norm1"], t["wqkv"], t["qkv"], grid_dim=(3, 1, 1), eps=1e-5, bias=t["bqkv"])
    pk.attention_layer(t["qkv"], t["kc"], t["vc"], cos_pos_embed=t["cos"], sin_pos_embed=t["sin"], output=t["attn"])
    pk.linear_with_residual_layer(t["attn"], t["wo"], t["x"], t["h"], grid_dim=(4, 1, 1))
    pk.rmsnorm_linear_layer(t["h"], t["norm2"], t["wgu"], t["gu"], grid_dim=(2, 1, 1))
    pk.silu_mul_linear_with_residual_layer(t["gu"], t["wd"], t["h"], t["h2"], grid_dim=(8, 1, 1))
    pk.rmsnorm_linear_layer(t["h2"], t["norm3"], t["head"], t["logits"], grid_dim=(4, 1, 1))
    pk.sampling_layer(t["logits"], t["ids"], temperature=0.5, top_k=5, top_p=0.75, seed=11)
    return pk, t


def _expected_rows(t: dict[str, PKTensor]) -> list[tuple[dict[IntCol, int], dict[FloatCol, float]]]:
    """What every descriptor row must hold, from the layer parameters above (ABSENT / 0.0 elsewhere)."""
    i = {name: tensor.index for name, tensor in t.items()}
    c = IntCol
    qkv_cols, attn_cols = KV_HEADS * (GROUP + 2) * HEAD_DIM, KV_HEADS * GROUP * HEAD_DIM
    return [
        ({c.KIND: KIND_CODES["embed"], c.OUTPUT: i["x"], c.ARG0: i["tokens"], c.ARG1: i["embed"], c.N: HIDDEN,
          c.TASKS: 2}, {}),
        ({c.KIND: KIND_CODES["rmsnorm_linear"], c.OUTPUT: i["qkv"], c.ARG0: i["x"], c.ARG1: i["wqkv"],
          c.ARG2: i["norm1"], c.ARG3: i["bqkv"], c.K: HIDDEN, c.N: qkv_cols, c.TASKS: 3}, {FloatCol.EPS: 1e-5}),
        ({c.KIND: KIND_CODES["attention"], c.OUTPUT: i["attn"], c.ARG0: i["qkv"], c.ARG1: i["kc"], c.ARG2: i["vc"],
          c.ARG3: i["cos"], c.ARG4: i["sin"], c.N: attn_cols, c.TASKS: BATCH * KV_HEADS, c.KV_HEADS: KV_HEADS,
          c.GROUP: GROUP, c.HEAD_DIM: HEAD_DIM, c.CACHE_SEQ: SEQ}, {}),
        ({c.KIND: KIND_CODES["linear_with_residual"], c.OUTPUT: i["h"], c.ARG0: i["attn"], c.ARG1: i["wo"],
          c.ARG2: i["x"], c.K: attn_cols, c.N: HIDDEN, c.TASKS: 4}, {}),
        ({c.KIND: KIND_CODES["rmsnorm_linear"], c.OUTPUT: i["gu"], c.ARG0: i["h"], c.ARG1: i["wgu"],
          c.ARG2: i["norm2"], c.K: HIDDEN, c.N: 64, c.TASKS: 2}, {FloatCol.EPS: 1e-6}),  # bias absent: ARG3 -1
        ({c.KIND: KIND_CODES["silu_mul_linear_with_residual"], c.OUTPUT: i["h2"], c.ARG0: i["gu"], c.ARG1: i["wd"],
          c.ARG2: i["h"], c.K: 32, c.N: HIDDEN, c.TASKS: 8}, {}),  # K: half of [gate | up]
        ({c.KIND: KIND_CODES["rmsnorm_linear"], c.OUTPUT: i["logits"], c.ARG0: i["h2"], c.ARG1: i["head"],
          c.ARG2: i["norm3"], c.K: HIDDEN, c.N: VOCAB, c.TASKS: 4}, {FloatCol.EPS: 1e-6}),
        ({c.KIND: KIND_CODES["sample"], c.OUTPUT: i["ids"], c.ARG0: i["logits"], c.K: VOCAB, c.N: 1, c.TASKS: 1,
          c.TOP_K: 5, c.SEED: 11}, {FloatCol.TEMPERATURE: 0.5, FloatCol.TOP_P: 0.75}),
    ]


def _assert_rows(ints: list[list[int]], floats: list[list[float]], t: dict[str, PKTensor]) -> None:
    expected = _expected_rows(t)
    assert len(ints) == len(floats) == len(expected)
    for layer, (want_i, want_f) in enumerate(expected):
        for col in IntCol:
            assert ints[layer][col] == want_i.get(col, ABSENT), f"layer {layer} column {col.name}"
        for col in FloatCol:
            assert floats[layer][col] == pytest.approx(want_f.get(col, 0.0)), f"layer {layer} column {col.name}"


def test_the_encoder_writes_every_layer_parameter_into_its_named_column() -> None:
    pk, t = _small_kernel()
    pk.compile()
    program = pk.program
    assert isinstance(program, PersistentProgram)
    _assert_rows([list(r) for r in program.descriptors.ints], [list(r) for r in program.descriptors.floats], t)
    assert program.tokens_id == t["tokens"].index and program.pick_id == t["ids"].index
    assert program.vocab == VOCAB and [x.name for x in program.tensors] == list(pk.tensors)


def test_the_cpu_runtime_reads_the_core_descriptors() -> None:
    if not yr.is_backend_available("cpu"):
        pytest.skip("the cpu backend is not available here")
    pk, t = _small_kernel("cpu")
    pk.compile()  # builds the runtime's arrays; decode itself is not compiled or run here
    _assert_rows(pk.runtime.lp.tolist(), pk.runtime.lf.tolist(), t)


def test_partitions_come_from_the_spec() -> None:
    pk, _ = _small_kernel()
    attention, linres, sample = pk.layers[2], pk.layers[3], pk.layers[7]
    assert LAYER_SPECS["attention"].output is Partition.PER_KV_HEAD
    assert (attention.out_parts, attention.read_parts("input"), attention.read_parts("k_cache")) == (KV_HEADS,
                                                                                                    KV_HEADS, 1)
    assert (linres.out_parts, linres.read_parts("residual"), linres.read_parts("input")) == (4, 4, 1)
    assert sample.out_parts == 1


def test_the_program_is_frozen_and_a_later_layer_does_not_reach_it() -> None:
    pk, t = _small_kernel()
    pk.compile()
    program = pk.program
    assert pk.runtime.program is program and pk.task_graph is program.task_graph
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.layers = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.layers[0].tasks = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        program.layers[1].inputs["bias"] = t["bqkv"]  # type: ignore[index]
    with pytest.raises(TypeError):
        program.values["embed"] = torch.zeros(1)  # type: ignore[index]
    assert isinstance(program.layers, tuple) and isinstance(program.descriptors.ints, tuple)
    extra = pk.new_tensor((BATCH, 1), "int64", name="ids2")
    pk.argmax_layer(t["logits"], extra)
    assert pk.program is None and pk.runtime is None  # the kernel must compile again
    assert len(program.layers) == 8 and len(program.descriptors.ints) == 8  # the old program did not change


def test_bad_layers_are_refused_with_the_cause() -> None:
    x = PKTensor("x", (1, 8), "float32", False, 0)
    y = PKTensor("y", (1, 8), "float32", False, 1)
    with pytest.raises(LayerError, match="unknown layer kind 'conv'.*known kinds: embed"):
        Layer("conv", 0, {"input": x}, y, tasks=1)
    with pytest.raises(LayerError, match="required input 'weight_linear' is missing"):
        encode([Layer("rmsnorm_linear", 0, {"input": x}, y, tasks=1, params={"eps": 1e-6})])
    w = PKTensor("w", (8, 8), "float32", True, 2)
    with pytest.raises(LayerError, match="parameter 'eps' \\(float\\) is missing"):
        encode([Layer("rmsnorm_linear", 0, {"input": x, "weight_linear": w, "weight_norm": w}, y, tasks=1)])
    with pytest.raises(LayerError, match="'scale'.*not roles of 'argmax'"):
        encode([Layer("argmax", 0, {"input": x, "scale": w}, y, tasks=1)])


def test_cpu_code_cached_for_another_descriptor_layout_is_recompiled(tmp_path) -> None:
    """numba's cache stamp does not cover the core's table: a changed layout must not run stale columns."""
    if not yr.is_backend_available("cpu"):
        pytest.skip("the cpu backend is not available here")
    code = (
        "import sys\n"
        "import yirage_backend_cpu.pk_tasks as tasks\n"
        "import yirage_backend_cpu.pk_runtime as runtime\n"
        "if sys.argv[1] == 'changed':\n"
        "    tasks.LAYOUT = 12345  # what the module would compute after the core table changed\n"
        "before = tasks._compiled_layout()\n"
        "tasks.check_compiled_layout(vars(runtime))\n"
        "print(before, tasks._compiled_layout(), tasks.LAYOUT)\n"
    )
    cache = tmp_path / "numba"
    cache.mkdir(mode=0o700)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    runs = [subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300, env=env)
            for mode in ("same", "changed")]
    for run in runs:
        assert run.returncode == 0, run.stderr
    layout = str(layout_fingerprint())
    assert runs[0].stdout.split() == [layout, layout, layout]
    assert runs[1].stdout.split() == [layout, "12345", "12345"]  # the cached value was stale, then recompiled
