"""benchmark/llm_bench.py, the LLM benchmark harness: list parsing, cases sorted by KV-cache bytes (the formula
recomputed here from the model's config.json), tiny end-to-end runs on a random model, a Hugging Face directory
and a GGUF file with every result field checked against its definition, the HF eager and llama.cpp peers (a fake
llama-bench that answers known timings, so no build runs here), and exit status 2 with a clear message for bad
input. No wall-clock figure is asserted."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARK_DIR = Path(__file__).resolve().parents[1] / "benchmark"
sys.path.insert(0, str(BENCHMARK_DIR))
import llm_bench  # noqa: E402 - lives in benchmark/, a scripts folder, not a package
import llm_bench_cases as cases  # noqa: E402

transformers = pytest.importorskip("transformers")

METRICS = ("ttft_ms", "itl_ms", "prefill_tok_s", "decode_tok_s", "total_s")
FAKE_PREFILL_NS_PER_TOKEN, FAKE_DECODE_NS_PER_TOKEN = 1_000_000, 2_000_000  # what the fake llama-bench reports
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)


def kv_bytes_oracle(config: dict, batch: int, seq: int) -> int:
    """2 (K, V) x batch x positions x kv heads x head dim x layers x 4 (float32), from a transformers config."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 2 * batch * seq * config["num_key_value_heads"] * head_dim * config["num_hidden_layers"] * 4


@pytest.fixture
def run_main(tmp_path: Path):
    """llm_bench.main(argv) with torch's thread count and RNG restored; returns the JSON document it wrote."""
    def run(*argv: str, output: str = "r.json") -> dict:
        out = tmp_path / output
        threads = torch.get_num_threads()
        try:
            with torch.random.fork_rng():
                assert llm_bench.main([*argv, "--output", str(out)]) == 0
        finally:
            torch.set_num_threads(threads)
        if out.suffix == ".csv":
            with open(out, newline="") as f:
                return {"rows": list(csv.DictReader(f))}
        return json.loads(out.read_text())
    return run


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_CONFIG)).eval()
    path = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def gguf_file(hf_dir: Path) -> Path:
    from yirage.models.gguf_export import export_gguf

    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir))
    path = hf_dir.parent / "tiny.gguf"
    export_gguf(path, model.config, model.state_dict(), "F32")
    return path


def check_document(doc: dict, config: dict, batches: list[int], inputs: list[int], outputs: list[int]) -> None:
    """Every case ran, in KV-byte order; every figure is finite, ordered and consistent with its definition."""
    expected = {(b, i, o): kv_bytes_oracle(config, b, i + o) for b, i, o in itertools.product(batches, inputs, outputs)}
    assert {(c["batch_size"], c["input_len"], c["output_len"]): c["kv_bytes"] for c in doc["cases"]} == expected
    kv = [c["kv_bytes"] for c in doc["cases"]]
    assert kv == sorted(kv)
    meta = doc["metadata"]
    for key in ("backend", "device", "model", "model_format", "model_config", "dtype", "kv_dtype", "rounds", "warmup",
                "cpu_model", "physical_cores", "yirage", "torch", "created"):
        assert meta[key] is not None, key
    assert meta["backend"] == "cpu" and meta["kv_dtype"] == "float32"
    ours = [r for r in doc["results"] if r["peer"] == "yirage cpu"]
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in ours] == [
        (c["batch_size"], c["input_len"], c["output_len"]) for c in doc["cases"]]
    for row in (r for r in doc["results"] if r["status"] == "ok"):
        assert row["rounds"] == meta["rounds"] and row["reason"] is None
        assert row["kv_bytes"] == expected[(row["batch_size"], row["input_len"], row["output_len"])]
        for metric in METRICS:
            s = row[metric]
            assert all(math.isfinite(v) and v > 0 for v in s.values()), (row["peer"], metric, s)
            assert s["min"] <= s["median"] <= s["max"]
        b, i, steps = row["batch_size"], row["input_len"], row["output_len"] - 1
        # odd round counts: each median is one round's figure, and tok/s is monotone in the time it divides
        assert row["prefill_tok_s"]["median"] == pytest.approx(b * i / (row["ttft_ms"]["median"] / 1e3), rel=1e-9)
        assert row["decode_tok_s"]["median"] == pytest.approx(b * 1e3 / row["itl_ms"]["median"], rel=1e-9)
        assert row["total_s"]["max"] * 1e3 >= row["ttft_ms"]["min"] + steps * row["itl_ms"]["min"] * 0.999


def test_parse_list_accepts_one_value_a_json_list_and_a_comma_list() -> None:
    assert cases.parse_list("4") == [4]
    assert cases.parse_list("[1,2,4]") == [1, 2, 4]
    assert cases.parse_list("1,2,4") == [1, 2, 4]
    assert cases.parse_list(" [16, 64] ") == [16, 64]


@pytest.mark.parametrize("bad", ["", "x", "1,x", "[1,2", "[]", "0", "-1", "1.5", "1,,2", "[1,[2]]"])
def test_parse_list_refuses_anything_else_and_names_the_forms(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"\[1,2,4\].*1,2,4"):
        cases.parse_list(bad)


def test_cases_are_the_product_sorted_by_kv_cache_bytes() -> None:
    config = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    got = cases.get_test_cases([4, 1, 2], [256, 16], [128, 16, 16], kv_heads=3, head_dim=64, layers=30)
    product = set(itertools.product([4, 1, 2], [256, 16], [128, 16]))
    assert [(c.batch_size, c.input_len, c.output_len) for c in got] == sorted(
        product, key=lambda t: (kv_bytes_oracle(config, t[0], t[1] + t[2]), t))
    assert [c.kv_bytes for c in got] == [kv_bytes_oracle(config, c.batch_size, c.input_len + c.output_len)
                                         for c in got]
    assert (got[0].batch_size, got[0].input_len, got[0].output_len) == (1, 16, 16)


def test_repeat_prompt_stretches_a_short_prompt() -> None:
    assert cases.repeat_prompt([5, 6, 7], 7) == [5, 6, 7, 5, 6, 7, 5]
    assert cases.repeat_prompt([5, 6, 7], 2) == [5, 6]


def test_random_model_acceptance_command_writes_sorted_results(run_main) -> None:
    doc = run_main("--make-random-model", "tiny", "--batch-size", "1,2", "--input-len", "16,64", "--output-len", "16",
                   "--rounds", "3", "--warmup", "1")
    assert len(doc["cases"]) == 4 and len(doc["results"]) == 4
    assert doc["metadata"]["model_format"] == "hf" and doc["metadata"]["model"].startswith("random tiny")
    check_document(doc, TINY_CONFIG, [1, 2], [16, 64], [16])


def test_random_model_size_flags_override_the_preset(run_main) -> None:
    doc = run_main("--make-random-model", "tiny", "--layers", "1", "--kv-heads", "4", "--batch-size", "[2]",
                   "--input-len", "8", "--output-len", "4", "--rounds", "1", "--warmup", "0", output="r.csv")
    (row,) = doc["rows"]
    config = dict(TINY_CONFIG, num_hidden_layers=1, num_key_value_heads=4)
    assert int(row["kv_bytes"]) == kv_bytes_oracle(config, 2, 12)
    assert row["backend"] == "cpu" and row["peer"] == "yirage cpu" and row["status"] == "ok"
    for metric in METRICS:
        values = [float(row[f"{metric}_{s}"]) for s in ("min", "median", "max")]
        assert values[0] == values[1] == values[2] > 0  # one round


def test_hf_directory_runs_with_the_hf_eager_peer(run_main, hf_dir: Path) -> None:
    doc = run_main("--model-path", str(hf_dir), "--batch-size", "1,2", "--input-len", "8", "--output-len", "6",
                   "--rounds", "1", "--peers", "hf")
    assert doc["metadata"]["model_format"] == "hf" and doc["metadata"]["peers"] == ["HF eager"]
    check_document(doc, TINY_CONFIG, [1, 2], [8], [6])
    for ours in (r for r in doc["results"] if r["peer"] == "yirage cpu"):
        (hf,) = [r for r in doc["results"] if r["peer"] == "HF eager" and r["batch_size"] == ours["batch_size"]]
        assert hf["status"] == "ok"
        assert ours["ttft_vs_hf_eager"] == pytest.approx(hf["ttft_ms"]["median"] / ours["ttft_ms"]["median"])
        assert ours["itl_vs_hf_eager"] == pytest.approx(hf["itl_ms"]["median"] / ours["itl_ms"]["median"])


FAKE_LLAMA_BENCH = """\
#!{python}
import json, shutil, sys
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
log = Path(sys.argv[0]).parent
with open(log / "calls.jsonl", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
shutil.copy(args["-m"], log / "seen.gguf")
p, n, d = int(args["-p"]), int(args["-n"]), int(args.get("-d", 0))
ns = p * {prefill} if p else n * {decode}
print(json.dumps([{{"n_prompt": p, "n_gen": n, "n_depth": d, "avg_ns": ns, "samples_ns": [ns],
                   "build_commit": "fake", "model_type": "fake"}}]))
"""


FAKE_BATCHED_STEP_S = 0.003  # the batched stand-in's time per decode step of the whole batch
FAKE_LLAMA_BATCHED_BENCH = """\
#!{python}
import json, sys
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
with open(Path(sys.argv[0]).parent / "calls.jsonl", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
pp, tg, pl = int(args["-npp"]), int(args["-ntg"]), int(args["-npl"])
print("llama_model_load: some log line")
print(json.dumps({{"pp": pp, "tg": tg, "pl": pl, "n_kv": pl * (pp + tg), "t_pp": pl * pp * {prefill} / 1e9,
                  "t_tg": tg * {step}}}))
"""


@pytest.fixture
def fake_llama_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """llama-bench and llama-batched-bench stand-ins in $YIRAGE_LLAMA_CPP_DIR: 1 ms per prompt token, 2 ms per
    generated token of one sequence, 3 ms per decode step of a batch."""
    root = tmp_path / "llama.cpp"
    root.mkdir()
    for name, text in (("llama-bench", FAKE_LLAMA_BENCH), ("llama-batched-bench", FAKE_LLAMA_BATCHED_BENCH)):
        binary = root / name
        binary.write_text(text.format(python=sys.executable, prefill=FAKE_PREFILL_NS_PER_TOKEN,
                                      decode=FAKE_DECODE_NS_PER_TOKEN, step=FAKE_BATCHED_STEP_S))
        binary.chmod(0o700)
    monkeypatch.setenv("YIRAGE_LLAMA_CPP_DIR", str(root))
    return root


def test_gguf_file_runs_with_the_llama_cpp_peer_on_the_same_weights(run_main, gguf_file: Path, hf_dir: Path,
                                                                     fake_llama_bench: Path) -> None:
    from gguf import GGUFReader

    doc = run_main("--model-path", str(gguf_file), "--batch-size", "2,1", "--input-len", "8", "--output-len", "5",
                   "--rounds", "1", "--peers", "llamacpp")
    assert doc["metadata"]["model_format"] == "gguf"
    check_document(doc, TINY_CONFIG, [1, 2], [8], [5])
    rows = {(r["peer"], r["batch_size"]): r for r in doc["results"]}
    llama = rows[("llama.cpp", 1)]
    assert llama["ttft_ms"]["median"] == pytest.approx(8 * FAKE_PREFILL_NS_PER_TOKEN / 1e6)
    assert llama["itl_ms"]["median"] == pytest.approx(FAKE_DECODE_NS_PER_TOKEN / 1e6)
    ours = rows[("yirage cpu", 1)]
    assert ours["itl_vs_llama_cpp"] == pytest.approx(llama["itl_ms"]["median"] / ours["itl_ms"]["median"])
    batched = rows[("llama.cpp", 2)]  # llama-batched-bench: both prompts' prefill, then steps of 2 tokens
    assert batched["status"] == "ok"
    assert batched["ttft_ms"]["median"] == pytest.approx(2 * 8 * FAKE_PREFILL_NS_PER_TOKEN / 1e6)
    assert batched["itl_ms"]["median"] == pytest.approx(FAKE_BATCHED_STEP_S * 1e3)
    assert batched["decode_tok_s"]["median"] == pytest.approx(2 / FAKE_BATCHED_STEP_S)
    ours2 = rows[("yirage cpu", 2)]
    assert ours2["itl_vs_llama_cpp"] == pytest.approx(batched["itl_ms"]["median"] / ours2["itl_ms"]["median"])
    calls = [json.loads(line) for line in (fake_llama_bench / "calls.jsonl").read_text().splitlines()]
    assert {tuple(c[c.index(flag) + 1] for flag in ("-p", "-n", "-d") if flag in c) for c in calls
            if "-p" in c} == {("8", "0", "0"), ("0", "4", "8")}  # the prompt alone; 4 steps after its 8 tokens
    assert [tuple(c[c.index(flag) + 1] for flag in ("-npl", "-npp", "-ntg", "-fa")) for c in calls
            if "-npl" in c] == [("2", "8", "4", "off")]
    # llama.cpp read the model's weights: the GGUF it got holds the same tensors as the file benchmarked
    reference = {t.name: t.data for t in GGUFReader(gguf_file).tensors}
    seen = {t.name: t.data for t in GGUFReader(fake_llama_bench / "seen.gguf").tensors}
    assert seen.keys() == reference.keys()
    for name, data in reference.items():
        assert (seen[name] == data).all(), name


def test_without_tqdm_the_progress_is_one_line_per_case(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    got = cases.get_test_cases([1], [4, 8], [2], kv_heads=1, head_dim=2, layers=1)
    assert list(llm_bench.progress(got)) == got
    err = capsys.readouterr().err
    assert "[1/2] batch 1, in 4, out 2" in err and "[2/2] batch 1, in 8, out 2" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--make-random-model", "tiny", "--batch-size", "1,x"], "argument --batch-size: '1,x' is not a positive integer"),
    (["--model-path", "/nonexistent/model"], "--model-path '/nonexistent/model' does not exist; pass a Hugging Face"),
    ([], "one of the arguments --model-path --make-random-model is required"),
    (["--make-random-model", "tiny", "--output-len", "1"], "--output-len [1]: every value must be >= 2"),
    (["--make-random-model", "tiny", "--peers", "vllm"], "unknown peer(s) vllm"),
    (["--make-random-model", "tiny", "--output", "r.txt"], "must end in .json or .csv"),
    (["--make-random-model", "tiny", "--hidden-size", "60"], "must be a multiple of --heads 4"),
    # the first case fits (nothing is allocated before the check), the second case's cache cannot
    (["--make-random-model", "tiny", "--batch-size", "100000", "--input-len", "16,100000"],
     "ModelError: case (batch 100000, in 100000, out 32) does not fit"),
])
def test_bad_input_exits_2_with_the_cause(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        llm_bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "ModelError" in message:
        assert "GB of memory is available" in err and "--batch-size / --input-len / --output-len" in err


def test_the_script_exits_2_on_an_unparsable_list() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARK_DIR / "llm_bench.py"), "--make-random-model",
                           "--input-len", "[16,"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 2, done.stderr
    assert "argument --input-len: '[16,' is not a positive integer" in done.stderr


def test_llama_cpp_without_amx_is_built_for_this_cpu_minus_amx_and_cached_apart(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    import llama_cpp_peer as peer

    monkeypatch.delenv(peer.ENV, raising=False)
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(peer.AMX_ENV, raising=False)
    assert peer.cmake_flags() == peer.CMAKE_FLAGS
    native = peer.cache_dir()
    monkeypatch.setenv(peer.AMX_ENV, "0")
    flags = peer.cmake_flags()
    assert "-DGGML_NATIVE=ON" not in flags and "-DGGML_NATIVE=OFF" in flags
    for lang in ("C", "CXX"):  # ggml's native mode would append -march=native after these, turning AMX back on
        assert f"-DCMAKE_{lang}_FLAGS=-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in flags
    assert peer.cache_dir() != native and peer.cache_dir().name.endswith("-no-amx")


def test_llama_cpp_for_another_cpu_is_built_for_it_and_cached_apart(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    import llama_cpp_peer as peer

    monkeypatch.delenv(peer.ENV, raising=False)
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(peer.AMX_ENV, raising=False)
    native = peer.cache_dir()
    monkeypatch.setenv(peer.MARCH_ENV, "skylake-avx512")
    flags = peer.cmake_flags()
    assert "-DGGML_NATIVE=OFF" in flags and "-DCMAKE_C_FLAGS=-march=skylake-avx512" in flags
    assert not any("native" in f for f in flags if f.startswith("-DCMAKE_"))
    assert peer.cache_dir() != native and peer.cache_dir().name.endswith("-march-skylake-avx512")
    monkeypatch.setenv(peer.MARCH_ENV, "skylake; rm -rf /")
    with pytest.raises(peer.LlamaCppError, match="not a -march name"):
        peer.cmake_flags()


def test_a_llama_cpp_tool_killed_by_sigill_names_amx_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import llama_cpp_peer as peer

    monkeypatch.delenv(peer.AMX_ENV, raising=False)
    cmd = ["llama-bench", "-m", "x.gguf"]
    sigill = peer._failed(cmd, subprocess.CompletedProcess(cmd, -4, "", ""))
    assert "illegal instruction" in str(sigill) and f"{peer.AMX_ENV}=0" in str(sigill)
    other = peer._failed(cmd, subprocess.CompletedProcess(cmd, 1, "", "bad magic"))
    assert "AMX" not in str(other) and "bad magic" in str(other) and "read_gguf" in str(other)
    monkeypatch.setenv(peer.AMX_ENV, "0")  # already without AMX: the switch is no fix
    assert peer.AMX_ENV not in str(peer._failed(cmd, subprocess.CompletedProcess(cmd, -4, "", "")))


def test_the_acceptance_table_puts_peer_over_yirage_for_times_and_yirage_over_peer_for_rates() -> None:
    import cpu_acceptance

    def row(peer: str, batch: int, inp: int, out: int, ttft: float, itl: float, tok_s: float) -> dict:
        stats = {"ttft_ms": ttft, "itl_ms": itl, "prefill_tok_s": tok_s}
        return {"peer": peer, "batch_size": batch, "input_len": inp, "output_len": out, "status": "ok",
                **{k: {"min": v, "median": v, "max": v} for k, v in stats.items()}}

    rows = [row("yirage cpu", 1, 128, cpu_acceptance.PROMPT_OUT, 100.0, 0.0, 1280.0),
            row("llama.cpp", 1, 128, cpu_acceptance.PROMPT_OUT, 150.0, 0.0, 640.0),
            row("HF eager", 1, 128, cpu_acceptance.PROMPT_OUT, 50.0, 0.0, 2560.0),
            row("yirage cpu", 4, 16, cpu_acceptance.DECODE_OUT, 0.0, 10.0, 0.0),
            row("llama.cpp", 4, 16, cpu_acceptance.DECODE_OUT, 0.0, 12.0, 0.0),
            {"peer": "HF eager", "batch_size": 4, "input_len": 16, "output_len": cpu_acceptance.DECODE_OUT,
             "status": "skipped"}]
    tag = cpu_acceptance.PROMPT_BF16  # a second run, yirage's prompt in bf16: its peers are its own
    rows += [row("yirage cpu" + tag, 1, 128, cpu_acceptance.PROMPT_OUT, 40.0, 0.0, 3200.0),
             row("llama.cpp" + tag, 1, 128, cpu_acceptance.PROMPT_OUT, 160.0, 0.0, 800.0),
             row("HF eager" + tag, 1, 128, cpu_acceptance.PROMPT_OUT, 60.0, 0.0, 2133.3)]
    demo = {"process_s": 9.0, "first_answer_s": 5.0, "identical": True, "ttft_ms": 1.0, "ms_per_token": 1.0}
    text = cpu_acceptance.table({"header": {"cpu": "Test CPU", "flags": ["avx2"], "logical_cpus": 2, "threads": 2},
                                 "rounds": 3, "dtypes": {"f32": {"cold": demo, "warm": demo, "rows": rows}}})
    lines = text.splitlines()
    ttft = next(line for line in lines if line.strip().startswith("TTFT b1 in128")).split()
    assert ttft[-2:] == ["1.50x", "0.50x"]  # llama.cpp 150 / 100 ms; HF 50 / 100 ms
    prompt = next(line for line in lines if line.strip().startswith("prompt b1 in128")).split()
    assert prompt[-2:] == ["2.00x", "0.50x"]  # yirage 1280 tok/s over llama.cpp's 640, HF's 2560
    itl = next(line for line in lines if line.strip().startswith("ITL b4 in16")).split()
    assert itl[-2:] == ["1.20x", "-"]  # a skipped peer has no figure
    tagged = next(line for line in lines if line.strip().startswith("TTFT b1 in128, bf16 prompt")).split()
    assert tagged[-2:] == ["4.00x", "1.50x"]  # against the peers of its own run
    assert "Test CPU" in lines[0] and "equal to transformers'" in text
