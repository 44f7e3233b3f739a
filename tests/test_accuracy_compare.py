"""Accuracy dump and compare (yirage.accuracy): a fused cpu decode against the unfused float64 golden run.

The model is a tiny random Llama (2 layers, hidden 64, GQA) with llm_oracle's diverse init. The golden
dump is checked against transformers (the independent oracle); the compare tool must pass a clean
fused run on every row and, with one cpu task body deliberately broken, flag that kernel first.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import yirage as yr
from yirage.accuracy import AccuracyError, DumpReader, Selection, compare, dump_graph, dump_model
from yirage.accuracy.layout import DumpWriter
from yirage.accuracy.metrics import compute
from yirage.cli import main

transformers = pytest.importorskip("transformers")

from llm_oracle import diverse_init  # noqa: E402 - needs transformers, checked just above

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3  # token steps per dump
SEED = 0  # dump_model's seed for the random token ids


def need_cpu() -> None:
    if not yr.is_backend_available("cpu"):
        pytest.skip("the cpu backend is not available here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """(model directory, transformers model): a 2-layer Llama, hidden 64, 4 heads over 2 kv heads."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    oracle = diverse_init(transformers.AutoModelForCausalLM.from_config(config).eval())
    path = tmp_path_factory.mktemp("accuracy") / "tiny-llama"
    oracle.save_pretrained(path, safe_serialization=True)
    return path, oracle


@pytest.fixture(scope="module")
def golden(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dump_model(tiny[0], tmp_path_factory.mktemp("golden") / "dump", unfused=True, steps=STEPS, seed=SEED)


@pytest.fixture(scope="module")
def fused(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_cpu()
    return dump_model(tiny[0], tmp_path_factory.mktemp("fused") / "dump", backend="cpu", steps=STEPS, seed=SEED)


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load(reader: DumpReader, token: int, op: str, io: str = "output", index: int = 0) -> np.ndarray:
    record = reader.get(token, op, io, index)
    assert record is not None, f"{op}.{io}.{index} of token {token} was not dumped"
    return reader.load(record)


def transformers_logits(oracle, ids: list[list[int]]) -> torch.Tensor:
    """The oracle's logits (B, T, vocab) for the teacher-forced sequence, in float64."""
    import copy

    wide = copy.deepcopy(oracle).double()
    with torch.no_grad():
        return wide(torch.tensor(ids)).logits


def test_golden_and_fused_dumps_match_transformers(tiny, golden, fused) -> None:
    ours, theirs = DumpReader(golden), DumpReader(fused)
    ids = ours.meta["ids"]
    assert theirs.meta["ids"] == ids and len(ids[0]) == STEPS
    ref = transformers_logits(tiny[1], ids)
    for t in range(STEPS):
        expected = ref[:, t].numpy()
        # transformers normalizes in float32 even in a float64 model: agreement to ~1e-6 is all it offers
        np.testing.assert_allclose(load(ours, t, "lm_head"), expected, rtol=0, atol=1e-5)
        np.testing.assert_allclose(load(theirs, t, "logits"), expected, rtol=0, atol=1e-4)
        assert load(ours, t, "sampler").tolist() == expected.argmax(-1)[:, None].tolist()


def test_a_clean_fused_cpu_model_passes_every_row(fused, golden, tmp_path) -> None:
    report = compare(fused, golden, tmp_path)
    table = rows(report.path)
    assert report.failed == [] and all(r["pass_fail"] == "pass" for r in table), report.summary()
    kernels = [k["name"] for k in DumpReader(fused).meta["map"]]
    assert kernels[:6] == ["x0", "qkv0", "attn0", "x0_mid", "gate_up0", "x1"] and kernels[-1] == "next_token"
    # every fused kernel's inputs and output, at every token, in execution order
    seen = [(int(r["token_id"]), r["op_name"]) for r in table]
    assert sorted(set(seen), key=seen.index) == [(t, k) for t in range(STEPS) for k in kernels]
    qkv = next(r for r in table if r["op_name"] == "qkv0" and r["tensor"] == "output.0")
    assert qkv["golden_ops"] == ("layers.0.self_attn.q_proj.output.0+layers.0.self_attn.k_proj.output.0+"
                                 "layers.0.self_attn.v_proj.output.0")
    assert float(qkv["cosine_similarity"]) > 0.9999 and float(qkv["relative_euclidean_distance"]) < 1e-5
    swapped = compare(golden, fused, tmp_path / "swapped")  # the unfused side as "my": the same rows, mirrored
    assert swapped.failed == [] and [r["tensor"] for r in swapped.rows] == [r["tensor"] for r in table]


# A deliberately wrong cpu task body: every linear_with_residual task adds 0.5 to the first column it writes.
PERTURBATION = '''
"""Test fixture: a wrong linear_with_residual task body for the cpu PersistentKernel runtime."""
import numpy as np
from numba import njit

import yirage_backend_cpu.pk_runtime as runtime
from yirage_backend_cpu.pk_entry import run_task, task_entry
from yirage_backend_cpu.pk_tasks import C_KIND, C_N, C_OUT, C_TASKS, LINRES, OPTS, execute, f32s
from yirage_backend_cpu.sources import tie_caches_to_sources


@njit(**OPTS)
def perturbed_execute(task, w, addr, tdt, tnum, lp, lf, task_layer, task_index, batch, scratch, step, tokens,
                      tok_cols, none, flags, entries):
    execute(task, w, addr, tdt, tnum, lp, lf, task_layer, task_index, batch, scratch, step, tokens, tok_cols, none,
            flags, entries)
    layer = task_layer[task]
    if lp[layer, C_KIND] == LINRES:
        out = f32s(addr[lp[layer, C_OUT]], tnum[lp[layer, C_OUT]])
        n = lp[layer, C_N]
        n0 = task_index[task] * (n // lp[layer, C_TASKS])
        for b in range(batch):
            out[b * n + n0] += np.float32(0.5)


def _perturbed_entry(task, w, frame, scratch, scratch_len):
    run_task(perturbed_execute, task, w, frame, scratch, scratch_len)


perturbed_entry = task_entry(_perturbed_entry)
tie_caches_to_sources(globals())
runtime.execute_entry = perturbed_entry  # the task entry CPUPersistentRuntime.run hands decode
'''


def perturbed_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A numba cache of its own for the perturbed runtime (never the real one), kept between test runs when
    pytest's cache is on, so only the first run pays the cold compile of the task bodies; named by the perturbation."""
    name = "yirage-accuracy-perturbed-" + hashlib.sha256(PERTURBATION.encode()).hexdigest()[:16]
    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir(name)) if cache is not None else tmp_path_factory.mktemp(name)
    os.chmod(root, 0o700)
    module = root / "perturbed_tasks.py"
    if not module.exists() or module.read_text() != PERTURBATION:
        module.write_text(PERTURBATION)
    (root / "numba").mkdir(mode=0o700, exist_ok=True)
    return root


def test_a_perturbed_cpu_task_body_is_flagged_at_that_kernel_and_no_earlier(
        tiny, golden, fused, tmp_path, request, tmp_path_factory) -> None:
    cache = perturbed_cache(request, tmp_path_factory)
    out = tmp_path / "perturbed"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(cache)!r})
        import perturbed_tasks  # noqa: F401 - patches the cpu runtime before any kernel compiles
        from yirage.cli import main
        sys.exit(main(["dump", "--model", {str(tiny[0])!r}, "--output", {str(out)!r}, "--backend", "cpu",
                       "--steps", "{STEPS}", "--seed", "{SEED}"]))
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache / "numba"), "YIRAGE_CACHE_DIR": str(tmp_path / "yc")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = compare(out, golden, tmp_path / "csv")
    table = rows(report.path)
    first = report.first_failure
    assert first is not None and (first["token_id"], first["op_name"], first["tensor"]) == (0, "x0_mid", "output.0")
    for t in range(STEPS):  # at every token: everything before the perturbed kernel's output passes
        mine = [r for r in table if int(r["token_id"]) == t]
        bad = next(i for i, r in enumerate(mine) if r["pass_fail"] == "fail")
        assert (mine[bad]["op_name"], mine[bad]["tensor"], mine[bad]["op_kind"]) == \
            ("x0_mid", "output.0", "linear_with_residual"), mine[bad]
        assert "cosine_similarity" in mine[bad]["fail_reason"]
    # the dump made without the perturbation (in this process, the real numba cache) still passes
    assert compare(fused, golden, tmp_path / "clean").failed == []


def test_metrics_match_hand_computed_float64_values() -> None:
    a, b = np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 4.0])
    m = compute(a, b)
    assert m["cosine_similarity"] == pytest.approx(17 / math.sqrt(14 * 21), rel=1e-15)
    assert m["relative_euclidean_distance"] == pytest.approx(1 / math.sqrt(21), rel=1e-15)
    assert (m["max_absolute_error"], m["mean_absolute_error"]) == (1.0, pytest.approx(1 / 3))
    assert (m["max_relative_error"], m["mean_relative_error"]) == (0.25, pytest.approx(0.25 / 3))
    p = [math.exp(x) for x in (1, 2, 4)]
    q = [math.exp(x) for x in (1, 2, 3)]
    p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    assert m["kl_divergence"] == pytest.approx(kl, rel=1e-12)
    zero = compute(np.zeros(4), np.zeros(4))
    assert zero["cosine_similarity"] == 1.0 and zero["relative_euclidean_distance"] == 0.0
    # KL is per row of the last dim, averaged: two rows, one equal (0) and one as above
    two = compute(np.array([[5.0, 5.0, 5.0], [1.0, 2.0, 3.0]]), np.array([[5.0, 5.0, 5.0], [1.0, 2.0, 4.0]]))
    assert two["kl_divergence"] == pytest.approx(m["kl_divergence"] / 2, rel=1e-12)


def write_dump(root: Path, tensors: dict[str, np.ndarray], ids: list[list[int]] | None = None) -> Path:
    writer = DumpWriter(root, {"kind": "unfused", "source": "model", "ids": ids or [[1, 2]]})
    for op, value in tensors.items():
        writer.write(0, op, "output", 0, value)
    return writer.close()


def test_nan_inf_shape_and_missing_rows_are_kept_with_their_reason(tmp_path) -> None:
    x = np.linspace(-1, 1, 8)
    mine = write_dump(tmp_path / "my", {"a": x, "b": np.where(x > 0.5, np.nan, x), "c": x[:4], "d": x * np.inf,
                                        "e": x + 1e-3, "f": np.arange(4), "g": x})
    gold = write_dump(tmp_path / "golden", {"a": x, "b": x, "c": x, "d": x, "e": x, "f": np.array([0, 1, 5, 3])})
    report = compare(mine, gold, tmp_path / "out", thresholds={"float64": {"max_absolute_error": 1e-6}})
    table = rows(report.path)
    assert [r["op_name"] for r in table] == list("abcdefg")  # nothing dropped, execution order kept
    reason = {r["op_name"]: r["fail_reason"] for r in table}
    result = {r["op_name"]: r["pass_fail"] for r in table}
    assert result == {"a": "pass", "b": "fail", "c": "fail", "d": "fail", "e": "fail", "f": "fail", "g": "fail"}
    assert reason["b"].startswith("NaN/inf present: my has 2 NaN and 0 inf")
    assert reason["c"] == "shape mismatch: my (4,) vs golden (8,)"
    assert reason["d"].startswith("NaN/inf present: my has 0 NaN and")
    assert "max_absolute_error 0.001 > 1e-06 (float64)" in reason["e"]
    assert reason["f"] == "integer values differ at 1 of 4 elements"
    assert reason["g"].startswith("missing on the golden side: g.output.0 of token 0 is not in the golden dump")
    assert table[2]["my_shape"] == "4" and table[2]["golden_shape"] == "8" and table[2]["cosine_similarity"] == ""
    # defaults: 1e-3 off in float64 fails on relative_euclidean_distance; loosened, it passes
    assert compare(mine, gold, tmp_path / "o2").rows[4]["pass_fail"] == "fail"
    loose = compare(mine, gold, tmp_path / "o3", thresholds={"relative_euclidean_distance": 0.01,
                                                              "cosine_similarity": None})
    assert loose.rows[4]["pass_fail"] == "pass"


def test_dump_selection_by_token_mode_and_op_regex(tiny, tmp_path) -> None:
    path = dump_model(tiny[0], tmp_path / "u", unfused=True, steps=STEPS, seed=SEED, tokens=[1], mode="output",
                      ops=r"qkv1")
    reader = DumpReader(path)
    assert {(r["token"], r["io"]) for r in reader.records} == {(1, "output")}
    assert [r["op"] for r in reader.records] == ["layers.1.input_layernorm", "layers.1.self_attn.q_proj",
                                                 "layers.1.self_attn.k_proj", "layers.1.self_attn.v_proj"]
    assert (tmp_path / "u" / "token_1" / "layers.1.self_attn.q_proj.output.0.npy").is_file()
    assert Selection(tokens="0,2").tokens == (0, 2) and Selection(tokens="all").tokens is None


def test_cli_dump_and_compare_end_to_end(tiny, golden, tmp_path, capsys) -> None:
    need_cpu()
    my = tmp_path / "my"
    assert main(["dump", "--model", str(tiny[0]), "--output", str(my), "--steps", str(STEPS), "--seed", str(SEED),
                 "--tokens", "0,2", "--mode", "output", "--ops", r"layers\.1\.|logits"]) == 0
    reader = DumpReader(my)
    assert reader.tokens == [0, 2] and {r["op"] for r in reader.records} == \
        {"qkv1", "attn1", "x1_mid", "gate_up1", "x2", "logits"}
    run = subprocess.run([sys.executable, "tools/yirage_backend_manager.py", "compare", "--my-path", str(my),
                          "--golden-path", str(golden), "--output", str(tmp_path / "csv")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "12 rows, 0 failed" in run.stdout
    assert [r["op_name"] for r in rows(tmp_path / "csv" / "accuracy_compare.csv")][:6] == \
        ["qkv1", "attn1", "x1_mid", "gate_up1", "x2", "logits"]
    capsys.readouterr()
    assert main(["compare", "--my-path", str(my), "--golden-path", str(golden), "--output", str(tmp_path / "strict"),
                 "--threshold", "relative_euclidean_distance=1e-15"]) == 1
    assert "first failure: token 0 qkv1 output.0: relative_euclidean_distance" in capsys.readouterr().out
    assert main(["compare", "--my-path", str(tmp_path / "nope"), "--golden-path", str(golden)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_kernel_graph_fused_on_cpu_vs_each_op_unfused(tmp_path) -> None:
    need_cpu()
    g = yr.new_kernel_graph()
    x, gw, w, r = (g.new_input(d) for d in ((8, 64), (64,), (64, 32), (8, 32)))
    g.mark_output(g.softmax(g.add(g.silu(g.matmul(g.mul(g.rms_norm(x, (64,)), gw), w)), r)))
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(d, generator=gen) for d in ((8, 64), (64,), (64, 32), (8, 32))]
    fused_dump = dump_graph(g, inputs, tmp_path / "f", backend="cpu")
    golden_dump = dump_graph(g, inputs, tmp_path / "u", unfused=True)
    kernels = DumpReader(fused_dump).meta["map"]
    assert [k["replaces"] for k in kernels][0] == ["t4.rms_norm", "t5.mul", "t6.matmul"]  # one fusion group
    report = compare(fused_dump, golden_dump, tmp_path / "csv")
    assert report.failed == [] and len(report.rows) == sum(len(k["inputs"]) + 1 for k in kernels)
    expected = torch.softmax(torch.nn.functional.silu(
        torch.nn.functional.rms_norm(inputs[0].double(), (64,), eps=1e-6) * inputs[1].double()
        @ inputs[2].double()) + inputs[3].double(), -1)
    last = DumpReader(golden_dump)
    np.testing.assert_allclose(load(last, 0, "t9.softmax"), expected.numpy(), rtol=1e-12, atol=1e-15)


def test_bad_paths_corrupted_meta_and_bad_options_give_clear_errors(tiny, golden, tmp_path) -> None:
    with pytest.raises(AccuracyError, match="does not exist; pass the directory a dump wrote"):
        DumpReader(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(AccuracyError, match="is a file"):
        DumpReader(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AccuracyError, match="has no meta.json"):
        DumpReader(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    with pytest.raises(AccuracyError, match="corrupted \\(not valid JSON"):
        DumpReader(bad)
    (bad / "meta.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(AccuracyError, match="not a yirage accuracy dump"):
        DumpReader(bad)
    meta = json.loads((golden / "meta.json").read_text())
    meta["records"][0]["file"] = "../../etc/passwd"
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(AccuracyError, match="outside the dump directory"):
        DumpReader(bad)
    meta["records"][0]["file"] = "token_0/gone.npy"
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(AccuracyError, match="listed in meta.json but missing"):
        compare(bad, golden, tmp_path / "out")
    other = write_dump(tmp_path / "other", {"a": np.zeros(2)}, ids=[[7, 7]])
    with pytest.raises(AccuracyError, match="differ in 'ids'"):
        compare(other, golden, tmp_path / "out")
    with pytest.raises(AccuracyError, match="exists and is not empty"):
        DumpWriter(golden, {"kind": "unfused"})
    with pytest.raises(AccuracyError, match="neither a metric"):
        compare(golden, golden, tmp_path / "out", thresholds={"cosine": 0.9})
    with pytest.raises(AccuracyError, match="finite number >= 0"):
        compare(golden, golden, tmp_path / "out", thresholds={"cosine_similarity": float("nan")})
    with pytest.raises(AccuracyError, match="not one of input, output, all"):
        Selection(mode="outputs")
    with pytest.raises(AccuracyError, match="not a valid regular expression"):
        Selection(ops="layers.(")
    with pytest.raises(AccuracyError, match="token steps must be ints >= 0"):
        Selection(tokens=[-1])
    with pytest.raises(AccuracyError, match="selects steps past the 3 token steps"):
        dump_model(tiny[0], tmp_path / "late", unfused=True, steps=STEPS, tokens=[5])
