"""Hostile inputs to configs and CLIs (issue 28): each is refused up front, naming the cause and the fix.

Oracles: the documented bounds (int64 token ids, MAX_NEW_TOKENS, TEMPERATURE_FLOOR, MAX_PK_COUNT, TCP ports
1..65535, OpenCL indices >= 0); the greedy tokens of the reference backend for what every backend must decode
at the temperature floor; and the argparse convention for CLIs: exit status 2, a message naming the flag, no
traceback. CLIs run in a subprocess, as a user runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import yirage as yr
from yirage.accuracy.dump import prompt_ids
from yirage.accuracy.layout import AccuracyError, DumpReader, DumpWriter
from yirage.autoconfig import MAX_PK_COUNT, SavedConfigError
from yirage.distributed import resolve_world
from yirage.distributed.world import DistributedError
from yirage.engine import GenerationConfig, InferEngine
from yirage.models.config import ModelError
from yirage.persistent.kernel import TEMPERATURE_FLOOR
from yirage.persistent.layers import LayerError

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300
UNWRITABLE = "/proc/yirage-hostile"  # /proc refuses new files even to root, whatever the permission bits say
needs_cpu = pytest.mark.skipif(not yr.is_backend_available("cpu"), reason="the cpu backend (numba) is unavailable")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama (vocab 256) saved as safetensors."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(4)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    launcher = ("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "YIRAGE_OPENCL_DEVICE")
    full = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}  # keeps conftest's YIRAGE_CONFIG_DIR
    full.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
                          env=full, check=False)


def assert_usage_error(run: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit status 2 (argparse's), no traceback, and the message names the cause."""
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in run.stderr, out


def small_kernel(backend: str = "reference", **kwargs) -> yr.PersistentKernel:
    seq = 24
    return yr.PersistentKernel(max_seq_length=seq, backend=backend, **kwargs,
                               meta_tensors=[torch.zeros(1, dtype=torch.int64), torch.zeros(1, seq, dtype=torch.int64)])


# -- 1. max_new_tokens and eos ids within int64 ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 10**30}, r"max_new_tokens must be an int >= 1 and <= 2\*\*31 - 1, got 10{30}"),
    ({"max_new_tokens": 2**63}, r"<= 2\*\*31 - 1.*max_position_embeddings"),
    ({"eos_token_id": [2**70]}, r"eos_token_id must be None .*an int id in \[0, 2\*\*63\)"),
    ({"eos_token_id": -1}, r"an int id in \[0, 2\*\*63\)"),
])
def test_generation_config_bounds_max_new_tokens_and_eos_ids(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)
    assert GenerationConfig(max_new_tokens=2**31 - 1, eos_token_id=2**63 - 1).max_new_tokens == 2**31 - 1


@pytest.mark.parametrize("eos", [[2**70], [2**63], [-1], ["2"], [True]])
def test_persistent_kernel_refuses_eos_ids_outside_int64(eos) -> None:
    with pytest.raises(LayerError, match=r"eos_token_id must be None, a token id \(an int in \[0, 2\*\*63\)\)"):
        small_kernel(eos_token_id=eos)


@needs_cpu
def test_a_huge_step_count_decodes_to_max_seq_length_instead_of_a_numba_error() -> None:
    vocab, hidden = 32, 16
    pk = small_kernel("cpu", num_workers=1, num_local_schedulers=0)
    g = torch.Generator().manual_seed(0)
    x, logits = pk.new_tensor((1, hidden), name="x"), pk.new_tensor((1, vocab), name="logits")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(torch.randn(vocab, hidden, generator=g), "embed"), x)
    pk.rmsnorm_linear_layer(x, pk.attach_input(torch.ones(hidden), "ones"),
                            pk.attach_input(torch.randn(vocab, hidden, generator=g), "head"), logits)
    pk.argmax_layer(logits, pk.new_tensor((1, 1), dtype=torch.int64, name="next"))
    assert pk(10**30) == 23  # 24 positions: the decode stops at max_seq_length, as with None
    assert int(pk.step[0]) == 23


def test_engine_refuses_eos_ids_the_vocabulary_never_emits(tiny) -> None:
    engine = InferEngine(tiny, backend="reference")
    with pytest.raises(ModelError, match=r"eos_token_id \[300\] not below vocab_size=256: the model never emits"):
        engine.generate([[1, 2]], GenerationConfig(max_new_tokens=2, eos_token_id=(5, 300)))
    assert engine.generate([[1, 2]], GenerationConfig(max_new_tokens=2, eos_token_id=255)).tokens.shape[0] == 1


# -- 2. one answer for a tiny temperature on every backend -----------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 1e-30, TEMPERATURE_FLOOR / 2])
def test_temperatures_below_the_floor_are_refused_pointing_at_greedy(temperature) -> None:
    with pytest.raises(ValueError, match=r"below the floor 1e-06.*use temperature=0 for greedy decoding"):
        GenerationConfig(temperature=temperature)
    pk = small_kernel()
    with pytest.raises(LayerError, match=r"must be a finite number >= 1e-06.*use argmax_layer \(temperature=0\)"):
        pk.sampling_layer(None, None, temperature=temperature)
    assert GenerationConfig(temperature=TEMPERATURE_FLOOR).temperature == TEMPERATURE_FLOOR


def test_every_backend_decodes_the_greedy_tokens_at_the_temperature_floor(tiny) -> None:
    ids = [[1, 2], [7, 9]]
    greedy = InferEngine(tiny, backend="reference").generate(ids, GenerationConfig(max_new_tokens=4,
                                                                                   eos_token_id=()))
    cold = GenerationConfig(max_new_tokens=4, eos_token_id=(), temperature=TEMPERATURE_FLOOR, seed=5)
    backends = [b for b in ("reference", "cpu", "opencl") if yr.is_backend_available(b)]
    for backend in backends:
        got = InferEngine(tiny, backend=backend).generate(ids, cold).tokens
        assert got.tolist() == greedy.tokens.tolist(), backend


# -- 3. worker counts bounded ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value", [("num_workers", 10**9), ("num_workers", 2**63), ("num_workers", 1e9),
                                        ("num_local_schedulers", MAX_PK_COUNT + 1)])
def test_worker_counts_are_bounded_before_anything_is_allocated(key, value, tmp_path) -> None:
    message = rf"{key} must be an int >= [01] and <= {MAX_PK_COUNT} .*got {value!r}"
    with pytest.raises(LayerError, match=message):
        small_kernel(**{key: value})
    with pytest.raises(ValueError, match=message):  # before the model is even looked for
        InferEngine(tmp_path / "no-model-here", backend="reference", **{key: value})


@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict]:
    path = yr.BackendOptimizer(sweep=False).save_config(tmp_path / "c.json", backend="cpu")
    return path, json.loads(path.read_text())


@needs_cpu
def test_a_saved_config_with_a_huge_worker_count_is_refused_at_load(saved) -> None:
    path, data = saved
    data["settings"]["num_workers"]["value"] = 10**9
    path.write_text(json.dumps(data))
    with pytest.raises(SavedConfigError, match=rf"num_workers must be an int >= 1 and <= {MAX_PK_COUNT}"):
        yr.BackendOptimizer().load_config(path)


GOOD_ROW = {"num_workers": 2, "num_local_schedulers": 0, "median_ms": 1.5, "min_ms": 1.0, "max_ms": 2.0,
            "samples": 3, "error": None}


@needs_cpu
@pytest.mark.parametrize("row, message", [
    ({"num_workers": "x"}, r"sweep row 0: num_workers must be an int"),
    ({**GOOD_ROW, "median_ms": "fast"}, r"sweep row 0: 'median_ms' must be a finite number"),
    ({k: v for k, v in GOOD_ROW.items() if k != "min_ms"}, r"sweep row 0: 'min_ms' must be a finite number"),
    ({**GOOD_ROW, "samples": 1.5}, r"sweep row 0: 'samples' must be an int >= 1"),
    ({**GOOD_ROW, "error": 7}, r"sweep row 0: 'error' must be a string or null"),
])
def test_junk_sweep_rows_are_refused_at_load_not_in_report(saved, row, message) -> None:
    path, data = saved
    path.write_text(json.dumps({**data, "sweep": [row]}))
    with pytest.raises(SavedConfigError, match=message):
        yr.BackendOptimizer().load_config(path).report()
    path.write_text(json.dumps({**data, "sweep": [GOOD_ROW, {**GOOD_ROW, "median_ms": None, "error": "boom"}]}))
    assert "2 workers + 0 schedulers" in yr.BackendOptimizer().load_config(path).report()


# -- 4. CLIs: unwritable outputs, bad ports and sizes exit 2 without a traceback -----------------------------------
def test_llm_bench_checks_the_output_path_before_running_any_case() -> None:
    run = run_cli("benchmark/llm_bench.py", "--make-random-model", "tiny", "--output-len", "2", "--rounds", "1",
                  "--warmup", "0", "--output", f"{UNWRITABLE}.json")
    assert_usage_error(run, f"--output '{UNWRITABLE}.json' cannot be written", "pass a writable file path")
    assert "cases on" not in run.stderr  # refused before the model was made and any case ran


def write_dump(root: Path, records: dict[str, np.ndarray]) -> Path:
    writer = DumpWriter(root, {"kind": "unfused", "source": "model", "ids": [[1, 2]]})
    for op, value in records.items():
        writer.write(0, op, "output", 0, value)
    return writer.close()


def test_compare_refuses_an_unwritable_output_directory(tmp_path) -> None:
    dump = write_dump(tmp_path / "d", {"a": np.zeros(3)})
    run = run_cli("-m", "yirage", "compare", "--my-path", str(dump), "--golden-path", str(dump), "--output",
                  UNWRITABLE)
    assert_usage_error(run, f"output directory '{UNWRITABLE}' cannot be written", "pass a writable directory")


def test_a_master_port_past_65535_is_refused_naming_the_range(tmp_path) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}
    with pytest.raises(DistributedError, match=r"MASTER_PORT='99999' is not a TCP port \(1\.\.65535\).*29500"):
        resolve_world(environ=env)
    assert resolve_world(environ={**env, "MASTER_PORT": "65535"}).master_port == 65535
    run = run_cli("demo/generate.py", "--make-random-model", str(tmp_path / "m"), "--config", "tiny", "--tp", "2",
                  env=env)
    assert_usage_error(run, "MASTER_PORT='99999' is not a TCP port (1..65535)")


@pytest.mark.parametrize("flag, value, message", [
    ("--batch-size", "0", "--batch-size 0: pass a positive number"),
    ("--prompt-len", "0", "--prompt-len 0: pass a positive number"),
    ("--max-new-tokens", "0", "--max-new-tokens must be an int >= 1"),
    ("--temperature", "1e-45", "use temperature=0 for greedy decoding"),
    ("--num-workers", "1000000000", f"num_workers must be an int >= 1 and <= {MAX_PK_COUNT}"),
])
def test_demo_generate_refuses_bad_sizes_before_making_a_model(tmp_path, flag, value, message) -> None:
    model = tmp_path / "m"
    run = run_cli("demo/generate.py", "--make-random-model", str(model), "--config", "tiny", "--no-compare-hf",
                  flag, value)
    assert_usage_error(run, message)
    assert not model.exists()


# -- 5. the accuracy tools: ids and dump records -------------------------------------------------------------------
@pytest.mark.parametrize("ids", [[[1.5, 2]], [[True, 2]], [True, False], torch.tensor([[1.0, 2.0]]),
                                 torch.tensor([[True, False]])])
def test_non_integer_ids_are_refused_not_truncated(ids) -> None:
    with pytest.raises(AccuracyError, match="must be int token ids .*no floats or booleans"):
        prompt_ids(256, ids)
    assert prompt_ids(256, [[1, 2]]).tolist() == [[1, 2]]


@pytest.mark.parametrize("ids", ["[[1.5,2]]", "[[true,2]]"])
def test_dump_cli_refuses_non_integer_ids(tiny, tmp_path, ids) -> None:
    out = tmp_path / "dump"
    run = run_cli("-m", "yirage", "dump", "--model", str(tiny), "--output", str(out), "--unfused", "--ids", ids)
    assert_usage_error(run, "must be int token ids")
    assert not (out / "meta.json").exists()


@pytest.mark.parametrize("field, value, message", [
    ("token", [0], r"record 0: token=\[0\] is not an int >= 0"),
    ("index", True, "record 0: index=True is not an int >= 0"),
    ("op", ["a"], r"record 0: op=\['a'\] is not a non-empty string"),
    ("io", "sideways", "record 0: io='sideways' is not one of"),
    ("shape", "3", "record 0: shape='3' is not a list of ints"),
])
def test_junk_dump_records_are_refused_naming_the_record(tmp_path, field, value, message) -> None:
    dump = write_dump(tmp_path / "d", {"a": np.zeros(3)})
    meta = json.loads((dump / "meta.json").read_text())
    meta["records"][0][field] = value
    (dump / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(AccuracyError, match=message):
        DumpReader(dump)
    run = run_cli("-m", "yirage", "compare", "--my-path", str(dump), "--golden-path", str(dump), "--output",
                  str(tmp_path / "csv"))
    assert_usage_error(run, "dump again")


# -- 6. OpenCL device indices ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not yr.is_backend_available("opencl"), reason="the opencl backend is unavailable")
@pytest.mark.parametrize("wanted", ["-1:0", "0:-1"])
def test_negative_opencl_device_indices_are_refused(wanted) -> None:
    code = "from yirage_backend_opencl import devices; print(devices.device())"
    run = run_cli("-c", code, env={"YIRAGE_OPENCL_DEVICE": wanted})
    assert run.returncode == 1 and "DeviceSelectionError" in run.stderr, run.stderr
    assert f"YIRAGE_OPENCL_DEVICE={wanted!r} names no OpenCL device (the indices must be >= 0)" in run.stderr
    assert run_cli("-c", code, env={"YIRAGE_OPENCL_DEVICE": "0:0"}).returncode == 0
