"""Tensor-parallel decode (InferEngine(tp=N), ranks on gloo) over what the single-rank path runs: bf16 and Q4_0
weights, a GGUF file, seeded sampling, EOS stops, and three ranks.

Oracles: transformers (bf16 at llm_oracle's tolerance; three ranks in float32) where the weights are theirs;
the single-rank InferEngine on the same file and dtype where the point is that the ranks together compute what
one process does (Q4_0, GGUF, sampling, EOS); for Q4_0 also the single-rank model's torch forward on the same
blocks (dequantized, teacher-forced over the tokens), which no kernel layout (quant_group's 8-row repack) touches.
Every rank saves its own result, and each test checks every rank's against the oracle, so a rank that drifts
(another seed, no EOS check) fails even when rank 0 is right.

The cases of each world size share one spawn (module fixtures: two ranks for five cases, three ranks for one);
ranks are subprocesses with torchrun's environment (test_distributed.run_ranks), each under a hard timeout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from yirage.engine import GenerationConfig, InferEngine
from yirage.models.llama import LlamaModel

transformers = pytest.importorskip("transformers")
from llm_oracle import (  # noqa: E402 - needs transformers
    assert_decode_matches,
    distinct_per_row,
    diverse_init,
    reference_generate,
    zoo_factory,
)
from test_distributed import PROMPT, SEED, TINY, run_ranks, tiny_model  # noqa: E402

NEW = 10  # tokens per decode
SAMPLING = {"temperature": 1.5, "top_k": 24, "top_p": 0.9, "seed": 1234}
TP_TOL = 1e-4  # max |tp - single rank| per step and row, as a fraction of the single rank's logit range
# three ranks: 6 query heads over 3 KV heads, 192 intermediate rows, vocab 101 (shards of 34, 34 and 33 rows)
TP3 = dict(TINY, hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3,
           vocab_size=101)

TP_CASES = """
from yirage.engine import GenerationConfig, InferEngine
init_world("cpu", timeout_s=60)
out = sys.argv[1]
spec = torch.load(sys.argv[2])
engines = {}
def decode(engine, ids, kw):
    r = engine.generate(ids, GenerationConfig(max_new_tokens=spec["n"], **{"eos_token_id": (), **kw}))
    return {"tokens": r.tokens, "logits": r.logits, "lengths": r.lengths, "steps": int(r.timings["steps"])}
for name, path, dtype, ids, kw in spec["cases"]:
    if (path, dtype) not in engines:
        engines[path, dtype] = InferEngine(path, backend="cpu", dtype=dtype, tp=spec["tp"], num_workers=1)
    engine = engines[path, dtype]
    result = {}
    if kw.get("eos_token_id") == "pick":  # ids the greedy decode emits mid-way: row 0's 3rd token, row 1's 6th
        free = decode(engine, ids, {})["tokens"]
        kw = {**kw, "eos_token_id": (int(free[0, 2]), int(free[1, 5]))}
        result["free"] = free
    result.update(decode(engine, ids, kw), kw=kw)
    torch.save(result, f"{out}/{name}.{rank}.pt")  # each rank its own: a rank that drifts is seen
"""


@dataclasses.dataclass
class Spawn:
    """One run of TP_CASES: where the ranks saved their results, and each rank's (returncode, stdout, stderr)."""

    out: Path
    runs: list[Any]
    paths: dict[str, Path]
    ids: dict[str, torch.Tensor]

    def results(self, case: str) -> list[dict[str, Any]]:
        """Every rank's result of ``case``; an AssertionError with the ranks' stderr when one has none."""
        files = [self.out / f"{case}.{rank}.pt" for rank in range(len(self.runs))]
        if not all(f.exists() for f in files):
            tails = "\n".join(f"rank {r} exited {code}:\n{err[-2500:]}" for r, (code, _, err) in enumerate(self.runs))
            raise AssertionError(f"case {case!r}: not every rank saved a result\n{tails}")
        return [torch.load(f) for f in files]


def spawn(tmp: Path, tp: int, cases: list[tuple], timeout: float) -> list[Any]:
    out = tmp / "out"
    out.mkdir()
    torch.save({"tp": tp, "n": NEW, "cases": cases}, tmp / "spec.pt")
    return run_ranks(TP_CASES, [str(out), str(tmp / "spec.pt")], n=tp, timeout=timeout)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


@pytest.fixture(scope="module")
def two(tmp_path_factory, zoo) -> Spawn:
    """Two ranks, five cases in one spawn: bf16 (zoo llama-gqa), Q4_0 and f32 (the tiny GQA Llama of
    test_distributed, vocab 97: rank 0's LM head shard has 49 rows, rank 1's 48), a Q8_0 GGUF export of it
    (read into float32), seeded sampling, and EOS ids picked from the greedy decode."""
    from yirage.models.gguf_export import export_gguf

    tmp = tmp_path_factory.mktemp("tp2")
    model = tiny_model()
    model.save_pretrained(tmp / "tiny", safe_serialization=True)
    paths = {"tiny": tmp / "tiny", "gguf": export_gguf(tmp / "tiny.gguf", model.config, model.state_dict(), "Q8_0"),
             "bf16": zoo("llama-gqa", torch.bfloat16).path}
    ids = {"tiny": torch.randint(0, TINY["vocab_size"], PROMPT, generator=torch.Generator().manual_seed(SEED)),
           "bf16": zoo("llama-gqa", torch.bfloat16).reference.ids}
    tiny, logits = str(paths["tiny"]), {"output_logits": True}
    cases = [("bf16", str(paths["bf16"]), None, ids["bf16"], logits), ("q4_0", tiny, "q4_0", ids["tiny"], logits),
             ("gguf", str(paths["gguf"]), None, ids["tiny"], logits), ("sample", tiny, None, ids["tiny"], SAMPLING),
             ("eos", tiny, None, ids["tiny"], {"eos_token_id": "pick"})]
    return Spawn(tmp / "out", spawn(tmp, 2, cases, timeout=300), paths, ids)


_SINGLE: dict[tuple[str, Any], InferEngine] = {}


def single(path: Path, dtype: Any = None) -> InferEngine:
    """The single-rank engine on the same file and dtype (built once, then reused)."""
    key = (str(path), dtype)
    if key not in _SINGLE:
        _SINGLE[key] = InferEngine(path, backend="cpu", dtype=dtype, num_workers=1)
    return _SINGLE[key]


def decode(engine: InferEngine, ids: torch.Tensor, **kw: Any) -> Any:
    return engine.generate(ids, GenerationConfig(max_new_tokens=NEW, **{"eos_token_id": (), **kw}))


def assert_close_per_step(want: torch.Tensor, got: torch.Tensor, tol: float, label: str) -> None:
    """Per step and row: max |got - want| <= tol x (max - min of want's row); NaN fails."""
    scale = (want.amax(-1) - want.amin(-1)).double()
    err = (got.double() - want.double()).abs().amax(-1)
    bad = ~(err <= tol * scale)
    assert not bad.any(), (f"{label}: logits differ by more than {tol:g} x the logit range at (row, step) "
                           f"{bad.nonzero().tolist()[:6]}; worst ratio {float((err / scale).max()):.3g}")


def assert_ranks_equal_single(results: list[dict[str, Any]], want: Any, label: str) -> None:
    """Every rank's tokens, lengths and step count are the single-rank engine's."""
    for rank, r in enumerate(results):
        assert r["tokens"].tolist() == want.tokens.tolist(), (f"{label}: rank {rank}'s tokens differ from the single "
                                                              f"rank's:\n  rank {rank} {r['tokens'].tolist()}\n"
                                                              f"  single {want.tokens.tolist()}")
        assert r["lengths"] == want.lengths, f"{label}: rank {rank}'s lengths {r['lengths']} != {want.lengths}"
        assert r["steps"] == want.timings["steps"], (f"{label}: rank {rank} ran {r['steps']} decode steps, the single "
                                                     f"rank {want.timings['steps']}")


def test_bf16_weights_decode_on_two_ranks_like_transformers(two, zoo) -> None:
    """bf16 checkpoint, two ranks: every rank's logits at every step within llm_oracle's 1e-3 of the logit range
    of transformers (float32 on the same rounded weights) and its greedy tokens. Fails when a bf16 shard takes
    another rank's slice (o_proj's columns swapped between the ranks)."""
    model = zoo("llama-gqa", torch.bfloat16)
    ref = model.reference
    head = dataclasses.replace(ref, tokens=ref.tokens[:, :NEW], logits=ref.logits[:, :NEW])
    assert min(distinct_per_row(head.tokens)) >= 5  # diverse output: equal tokens mean something
    for rank, r in enumerate(two.results("bf16")):
        assert_decode_matches(head, r["tokens"], r["logits"], label=f"TP=2 rank {rank}, {model.label}")


def teacher_forced_logits(model: LlamaModel, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The logits each of ``tokens`` was picked from, by the model's torch forward (prefill) over prompt + tokens."""
    seq = torch.cat([ids, tokens[:, :-1]], 1)
    b, t = seq.shape
    model.reset_cache(b, t)
    with torch.no_grad():
        return model.forward(seq, torch.arange(t).expand(b, t))[:, ids.shape[1] - 1:]


def test_q4_0_shards_decode_on_two_ranks_like_one_rank(two) -> None:
    """Q4_0 on two ranks (each shard's matrices repacked in 8-row groups by the CPU runtime, rank 0's 49-row LM
    head left ungrouped): every rank's tokens are the single-rank Q4_0 engine's, its logits within 1e-4 of the
    range of that engine's, and within 1e-3 of the single-rank model's torch forward on the same blocks, an oracle
    no kernel layout reaches (a repack that misorders the rows of every matrix fails there, not only against the
    single-rank kernel). Q4_0 really is used: its logits differ from float32's by more than the tolerance."""
    ids = two.ids["tiny"]
    want = decode(single(two.paths["tiny"], "q4_0"), ids, output_logits=True)
    f32 = decode(single(two.paths["tiny"]), ids, output_logits=True).logits
    scale = f32.amax(-1) - f32.amin(-1)
    assert float(((want.logits - f32).abs().amax(-1) / scale).min()) > 1e-3  # quantized: far from float32
    torch_q4 = teacher_forced_logits(LlamaModel.from_pretrained(two.paths["tiny"], "q4_0"), ids, want.tokens)
    assert min(distinct_per_row(want.tokens)) >= 5
    results = two.results("q4_0")
    assert_ranks_equal_single(results, want, "q4_0")
    for rank, r in enumerate(results):
        assert_close_per_step(want.logits, r["logits"], TP_TOL, f"q4_0 rank {rank} vs the single-rank kernel")
        assert_close_per_step(torch_q4, r["logits"], 1e-3, f"q4_0 rank {rank} vs the torch forward on the blocks")


def test_a_gguf_file_decodes_on_two_ranks_like_one_rank(two) -> None:
    """A Q8_0 GGUF file (q/k rows in llama.cpp's RoPE order, block-aligned column slices dequantized per rank) on
    two ranks: every rank's tokens are the single-rank engine's on the same file, its logits within 1e-4 of the
    range. Fails when a rank's q/k slice is un-permuted with the whole model's head count."""
    ids = two.ids["tiny"]
    want = decode(single(two.paths["gguf"]), ids, output_logits=True)
    assert min(distinct_per_row(want.tokens)) >= 5
    results = two.results("gguf")
    assert_ranks_equal_single(results, want, "gguf")
    for rank, r in enumerate(results):
        assert_close_per_step(want.logits, r["logits"], TP_TOL, f"gguf rank {rank}")


def test_every_rank_samples_the_single_rank_tokens_from_the_same_seed(two) -> None:
    """temperature/top_k/top_p with a seed: every rank draws the single-rank engine's tokens (a rank whose sampler
    is seeded differently fails). The draw is not greedy: the sampled tokens differ from the greedy ones."""
    want = decode(single(two.paths["tiny"]), two.ids["tiny"], **SAMPLING)
    greedy = two.results("eos")[0]["free"]
    assert want.tokens.tolist() != greedy.tolist()
    assert_ranks_equal_single(two.results("sample"), want, "sampling")


def test_an_eos_mid_decode_stops_every_rank_at_the_single_rank_step(two) -> None:
    """EOS ids taken from the greedy decode (row 0's 3rd token, row 1's 6th; a row stops at the first of them it
    emits): every rank stops each row where the single-rank engine does (tokens, padded tails, lengths; the rows at
    different steps) and ends the decode after the same number of steps, before max_new_tokens. Fails when only
    rank 0 checks the EOS ids (rank 1 decodes on alone and loses its peer)."""
    results = two.results("eos")
    eos = results[0]["kw"]["eos_token_id"]
    want = decode(single(two.paths["tiny"]), two.ids["tiny"], eos_token_id=eos)
    assert results[0]["free"].tolist() == decode(single(two.paths["tiny"]), two.ids["tiny"]).tokens.tolist()
    assert max(want.lengths) < NEW and want.timings["steps"] < NEW - 1  # both rows stop: the decode ends early
    assert len(set(want.lengths)) == 2  # one row decodes on after the other stopped
    assert all(r["kw"]["eos_token_id"] == eos for r in results)
    assert_ranks_equal_single(results, want, "eos")


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> tuple[Spawn, Any]:
    """Three ranks of a Llama whose 6 heads / 3 KV heads / 192 intermediate rows divide by 3, and transformers'
    greedy reference on it."""
    tmp = tmp_path_factory.mktemp("tp3")
    torch.manual_seed(SEED)
    oracle = diverse_init(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TP3)).eval(), seed=SEED)
    oracle.save_pretrained(tmp / "m", safe_serialization=True)
    oracle.generation_config.eos_token_id = None
    ids = torch.randint(0, TP3["vocab_size"], PROMPT, generator=torch.Generator().manual_seed(SEED))
    cases = [("tp3", str(tmp / "m"), None, ids, {"output_logits": True})]
    return Spawn(tmp / "out", spawn(tmp, 3, cases, timeout=300), {"m": tmp / "m"}, {"m": ids}), \
        reference_generate(oracle, ids, NEW)


def test_three_ranks_decode_like_transformers(three) -> None:
    """Three ranks (a middle rank that is neither first nor last; vocabulary shards 34/34/33): every rank's logits
    within 1e-3 of transformers' logit range at every step, and its greedy tokens. Fails when the residual is
    added by every rank but the last (right for two ranks, twice for three)."""
    spawned, ref = three
    assert min(distinct_per_row(ref.tokens)) >= 5
    for rank, r in enumerate(spawned.results("tp3")):
        assert_decode_matches(ref, r["tokens"], r["logits"], label=f"TP=3 rank {rank}")
