"""benchmark/device_decode.py's bandwidth bound: the bytes a decode step reads (from the config, by hand) and a
probe that measures something; the whole script on the CPU in its smoke shape."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCHMARK_DIR = Path(__file__).resolve().parents[1] / "benchmark"
sys.path.insert(0, str(BENCHMARK_DIR))
device_decode = pytest.importorskip("device_decode")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [True, False])
def test_step_bytes_count_every_weight_once(tied: bool) -> None:
    shape = {**device_decode.SMALL, "tie_word_embeddings": tied}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two norms
    weights = v * h * (1 if tied else 2) + layers * per_layer + h  # the table (and the LM head), the final norm
    assert device_decode.step_bytes(model, torch.bfloat16) == 2 * weights
    assert device_decode.step_bytes(model, torch.float32) == 4 * weights


def test_the_llama1b_shape_is_llama_3_2_1b() -> None:
    model = transformers.LlamaConfig(**device_decode.LLAMA1B)
    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.LlamaForCausalLM(model).parameters())
    assert 1.23e9 < params < 1.24e9  # 1.236 B with the tied table counted once


def test_the_smoke_run_reports_the_bound_and_the_share(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    code = device_decode.main(["--backends", "cpu", "--small", "--dtypes", "float32", "--rounds", "1",
                               "--json", str(out)])
    (row,) = json.loads(out.read_text())
    assert code == 0, row
    assert row["tokens_vs_oracle"] == "equal"
    assert row["read_gb_s"] > 0 and row["bound_ms"] > 0
    assert row["share_of_bound"] == pytest.approx(row["bound_ms"] / row["ms_per_token"])


def test_a_sampled_smoke_run_draws_the_same_tokens_every_run_and_differs_from_greedy(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """--sample decodes with the seeded sampler (the runs' tokens must agree, or the row is an error) and times HF
    sampling the same way; the drawn tokens are not the greedy ones."""
    drawn = []
    run = device_decode.yirage_run
    monkeypatch.setattr(device_decode, "yirage_run", lambda *a, **k: drawn.append(run(*a, **k)) or drawn[-1])
    out = tmp_path / "rows.json"
    for flags in (["--sample"], []):
        code = device_decode.main(["--backends", "cpu", "--small", "--dtypes", "float32", "--rounds", "2",
                                   "--json", str(out), *flags])
        (row,) = json.loads(out.read_text())
        assert code == 0, row
    assert drawn[0]["tokens"] != drawn[1]["tokens"]
    assert row["tokens_vs_oracle"] == "equal" and drawn[0]["ms_per_token"] > 0


def test_a_variant_sets_its_environment_for_its_run_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YIRAGE_CUDA_GRID_SYNC", "flat")
    monkeypatch.delenv("YIRAGE_PK_PREFETCH", raising=False)
    name, settings = device_decode.variant("cuda:YIRAGE_PK_PREFETCH=0,YIRAGE_CUDA_GRID_SYNC=tree")
    assert name == "cuda" and settings == (("YIRAGE_PK_PREFETCH", "0"), ("YIRAGE_CUDA_GRID_SYNC", "tree"))
    with device_decode.environment(settings):
        assert os.environ["YIRAGE_PK_PREFETCH"] == "0" and os.environ["YIRAGE_CUDA_GRID_SYNC"] == "tree"
    assert "YIRAGE_PK_PREFETCH" not in os.environ and os.environ["YIRAGE_CUDA_GRID_SYNC"] == "flat"
    assert device_decode.variant("triton") == ("triton", ())
    with pytest.raises(SystemExit, match="BACKEND:VARIABLE=VALUE"):
        device_decode.variant("cuda:YIRAGE_PK_PREFETCH")
