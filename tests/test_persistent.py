"""PersistentKernel and Llama-family generation, checked against Hugging Face transformers.

The models (tests/llm_oracle.py) are tiny, randomly initialised so that
transformers' own greedy output is diverse, and saved with safetensors to a
session temp dir (no hub). Every generation is compared per step with
transformers' logits, not only its argmax tokens. The PersistentKernel runs
on every backend that has a persistent runtime; others report why they are
skipped. tests/test_llm_ablation.py shows that these comparisons fail on
deliberately broken models.
"""

from __future__ import annotations

import json

import pytest
import torch

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine
from yirage.models.config import ModelError
from yirage.persistent.layers import LayerError

transformers = pytest.importorskip("transformers")

from llm_oracle import (  # noqa: E402 - needs transformers, checked just above
    KINDS,
    NEW_TOKENS,
    assert_decode_matches,
    distinct_per_row,
    hf_config,
    reference_generate,
    zoo_factory,
)

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


def need_cpu() -> None:
    if not yr.is_backend_available("cpu"):
        pytest.skip("the cpu backend is not available here")


def greedy(max_new_tokens: int = NEW_TOKENS, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=(), **kw)


@pytest.mark.parametrize("dtype", (torch.float32,) + HALF, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_transformers_greedy_output_is_diverse(kind, dtype, zoo) -> None:
    """The oracle itself must not collapse into a repeated token, or equal tokens would prove little."""
    model = zoo(kind, dtype)
    counts = distinct_per_row(model.reference.tokens)
    assert all(n >= NEW_TOKENS // 2 for n in counts), (
        f"{model.label}: transformers' greedy output has only {counts} distinct tokens per row out of "
        f"{NEW_TOKENS}; the test model's init must be rescaled")


@pytest.mark.parametrize("kind", KINDS)
def test_decode_logits_and_tokens_match_transformers(kind, zoo, pk_backend) -> None:
    model = zoo(kind)
    engine = InferEngine(model.path, backend=pk_backend)
    result = engine.generate(model.reference.ids, greedy(output_logits=True))
    assert_decode_matches(model.reference, result.tokens, result.logits, label=f"{model.label} on {pk_backend}")
    assert result.backend == pk_backend and result.tokens_per_s > 0 and result.ttft_ms > 0
    fast = engine.generate(model.reference.ids, greedy())  # the whole decode in one kernel call
    assert fast.tokens.tolist() == model.reference.tokens.tolist() and fast.logits is None


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(kind, zoo) -> None:
    model = zoo(kind)
    ids = torch.randint(0, model.oracle.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    engine = InferEngine(model.path, backend="reference")
    engine.reset_cache(2, 16)
    ours = engine.forward(ids, torch.arange(9).expand(2, 9))
    with torch.no_grad():
        theirs = model.oracle(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{model.label}, prefill prompt seed 3: {m}")
    engine.reset_cache(2, 16)
    last = engine.model.forward(ids, torch.arange(9).expand(2, 9), last_only=True)  # what generate's prefill reads
    torch.testing.assert_close(last, theirs[:, -1:], rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{model.label}, last-position prefill, prompt seed 3: {m}")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("kind", ("llama-gqa", "qwen2-bias-tied"))
def test_half_precision_weights_stay_half_and_match(kind, dtype, zoo, pk_backend) -> None:
    """Same tolerance as float32: both sides compute in float32 from the same rounded weights."""
    model = zoo(kind, dtype)
    engine = InferEngine(model.path, backend=pk_backend)
    assert engine.model.blocks[0]["qkv"].dtype == dtype  # kept narrow in memory: half the bytes per token
    result = engine.generate(model.reference.ids, greedy(output_logits=True))
    assert_decode_matches(model.reference, result.tokens, result.logits, label=f"{model.label} on {pk_backend}")


@pytest.mark.parametrize("kv_dtype", HALF, ids=str)
def test_16_bit_kv_caches_match_transformers_rounding_its_cache(kv_dtype, zoo, pk_backend) -> None:
    """The oracle is transformers with every key and value rounded to ``kv_dtype`` as it enters its cache. The
    bfloat16 rounding moves the logits by ~5e-3 of their range, so a cache left float32 (or truncated instead of
    rounded) fails this comparison at the usual 1e-3."""
    model = zoo("llama-gqa")
    rounded = reference_generate(model.oracle, model.reference.ids, kv_dtype=kv_dtype)
    engine = InferEngine(model.path, backend=pk_backend, kv_cache_dtype=str(kv_dtype).removeprefix("torch."))
    result = engine.generate(model.reference.ids, greedy(output_logits=True))
    assert engine.model.k_cache[0].dtype == engine.model.v_cache[0].dtype == kv_dtype
    assert_decode_matches(rounded, result.tokens, result.logits, label=f"{model.label}, {kv_dtype} KV cache on "
                                                                       f"{pk_backend}")


def test_kv_cache_dtypes_are_checked() -> None:
    with pytest.raises(ModelError, match="kv_cache_dtype='int8' is not supported"):
        InferEngine("no-such-model", backend="reference", kv_cache_dtype="int8")
    pk = spec_kernel("reference")
    x = pk.new_tensor((1, 32), name="x")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(torch.randn(100, 32), "embed"), x)
    qkv = pk.new_tensor((1, 3 * 16), name="qkv")
    pk.linear_with_residual_layer(x, pk.attach_input(torch.randn(48, 32), "w"), pk.attach_input(torch.zeros(1, 48),
                                                                                             "r"), qkv)
    cache = (1, 1, 64, 16)
    table = pk.attach_input(torch.ones(64, 16), "cos"), pk.attach_input(torch.zeros(64, 16), "sin")
    with pytest.raises(LayerError, match="k_cache is bfloat16 but v_cache is float16"):
        pk.attention_layer(qkv, pk.attach_input(torch.zeros(cache, dtype=torch.bfloat16), "kc"),
                           pk.attach_input(torch.zeros(cache, dtype=torch.float16), "vc"), cos_pos_embed=table[0],
                           sin_pos_embed=table[1], output=pk.new_tensor((1, 16), name="o"))
    with pytest.raises(LayerError, match="KV caches must be one of"):
        pk.attention_layer(qkv, pk.attach_input(torch.zeros(cache, dtype=torch.int64), "kc2"),
                           pk.attach_input(torch.zeros(cache, dtype=torch.int64), "vc2"), cos_pos_embed=table[0],
                           sin_pos_embed=table[1], output=pk.new_tensor((1, 16), name="o2"))


def test_generation_stops_at_eos(zoo) -> None:
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend="reference")
    ids = model.reference.ids[:1]
    free = model.reference.tokens[0].tolist()
    stop_at = free[4]
    with torch.no_grad():
        expected = model.oracle.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=stop_at,
                                         pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert expected == free[:free.index(stop_at) + 1]  # transformers stops at the first stop_at
    stopped = engine.generate(ids, GenerationConfig(max_new_tokens=12, eos_token_id=stop_at))
    assert stopped.tokens[0, :stopped.lengths[0]].tolist() == expected


def test_sampling_is_seeded_and_tiny_temperature_is_greedy(zoo, pk_backend) -> None:
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend=pk_backend)
    ids = model.reference.ids[:1]
    cold = engine.generate(ids, greedy(8, temperature=1e-4)).tokens
    assert cold.tolist() == model.reference.tokens[:1, :8].tolist()
    hot = greedy(16, temperature=1.5, top_k=50, top_p=0.9, seed=7)
    assert torch.equal(engine.generate(ids, hot).tokens, engine.generate(ids, hot).tokens)
    other = greedy(16, temperature=1.5, top_k=50, top_p=0.9, seed=8)
    assert not torch.equal(engine.generate(ids, hot).tokens, engine.generate(ids, other).tokens)



def test_a_seeded_generation_draws_every_token_from_one_stream(zoo, pk_backend) -> None:
    """The first token is drawn by the decode kernel's own sampler at its position, like every later one: so a
    generation restarted from its prompt plus its first token continues with the same tokens. (With the first
    token drawn from another random stream than the decode steps, the restart would draw differently.)"""
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend=pk_backend)
    ids = model.reference.ids[:1]
    for seed in (3, 4, 5):
        config = greedy(6, temperature=1.5, top_k=50, top_p=0.9, seed=seed)
        whole = engine.generate(ids, config).tokens[0].tolist()
        resumed = engine.generate(torch.cat([ids, torch.tensor([whole[:1]])], 1),
                                  greedy(5, temperature=1.5, top_k=50, top_p=0.9, seed=seed)).tokens[0].tolist()
        assert resumed == whole[1:], f"seed {seed}: {whole} then, resumed after its first token, {resumed}"

# -- the PersistentKernel API ------------------------------------------------------------------


def spec_kernel(backend: str, **overrides):
    step = torch.tensor([0])
    tokens = torch.zeros(1, 64, dtype=torch.int64)
    args = dict(world_size=1, mpi_rank=0, num_workers=2, num_local_schedulers=1, num_remote_schedulers=0,
                max_seq_length=64, eos_token_id=2, meta_tensors=[step, tokens], profiler_tensor=None,
                spec_decode_config=None, backend=backend)
    args.update(overrides)
    return yr.PersistentKernel(**args)


def test_the_spec_constructor_fails_clearly_for_an_unavailable_backend() -> None:
    if yr.is_backend_available("mps"):
        pytest.skip("MPS is available here")
    with pytest.raises(yr.BackendUnavailableError, match="mps.*unavailable.*macOS"):
        spec_kernel("mps")


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(yr.NotSupportedError, match="world_size"):
        spec_kernel("reference", world_size=2)
    with pytest.raises(yr.NotSupportedError, match="speculative"):
        spec_kernel("reference", spec_decode_config={"k": 4})
    with pytest.raises(LayerError, match="meta_tensors"):
        spec_kernel("reference", meta_tensors=[torch.tensor([0])])


def test_layer_wiring_errors_are_caught_at_build_time() -> None:
    pk = spec_kernel("reference")
    embed = pk.attach_input(torch.randn(100, 32), "embed")
    x = pk.new_tensor((1, 32), name="x")
    y = pk.new_tensor((1, 48), name="y")
    norm, w = pk.attach_input(torch.ones(32), "norm"), pk.attach_input(torch.randn(48, 32), "w")
    with pytest.raises(LayerError, match="read before any layer writes it"):
        pk.rmsnorm_linear_layer(x, norm, w, y)
    pk.embed_layer(pk.tokens_tensor, embed, x, grid_dim=(4, 1, 1))
    with pytest.raises(LayerError, match="already written"):
        pk.embed_layer(pk.tokens_tensor, embed, x)
    with pytest.raises(LayerError, match=r"weight_linear must be \(N, 32\)"):
        pk.rmsnorm_linear_layer(x, norm, pk.attach_input(torch.randn(32, 48), "w_bad"), y)
    with pytest.raises(LayerError, match="do not split evenly"):
        pk.rmsnorm_linear_layer(x, norm, w, y, grid_dim=(5, 1, 1))
    other = spec_kernel("reference").new_tensor((1, 32), name="alien")
    with pytest.raises(LayerError, match="tensor of this PersistentKernel"):
        pk.rmsnorm_linear_layer(other, norm, w, y)
    with pytest.raises(LayerError, match="last layer must be argmax"):
        pk.compile()


def test_events_partition_the_shared_dimension_by_the_gcd_of_the_splits() -> None:
    from yirage.persistent.layers import Layer, PKTensor
    from yirage.persistent.task_graph import build_task_graph

    qkv = PKTensor("qkv", (1, 48), "float32", False, 0)
    x = PKTensor("x", (1, 8), "float32", False, 1)
    producer = Layer("rmsnorm_linear", 0, {"input": x}, qkv, tasks=6)
    consumer = Layer("attention", 1, {"input": qkv}, PKTensor("o", (1, 16), "float32", False, 2), tasks=4,
                     params={"kv_heads": 4, "group": 2, "head_dim": 4})
    graph = build_task_graph([producer, consumer])
    assert graph.num_events == 2  # gcd(6, 4)
    assert graph.event_trigger == [3, 3]
    assert graph.event_gates == [[6, 7], [8, 9]]
    assert graph.task_waits == [0] * 6 + [1] * 4
    assert [graph.task_events[t] for t in range(6)] == [[0], [0], [0], [1], [1], [1]]


def test_the_profiler_records_every_task(tmp_path, zoo, pk_backend) -> None:
    engine = InferEngine(zoo("llama-gqa").path, backend=pk_backend)
    engine.reset_cache(1, 16)
    engine._tokens[0, 0] = 3
    profile = torch.zeros(4096, dtype=torch.int64)
    pk = engine.model.build_decoder(engine._step, engine._tokens, backend=pk_backend, profiler_tensor=profile)
    pk(1)
    n = pk.task_graph.num_tasks
    starts, ends = profile[0:3 * n:3], profile[1:3 * n:3]
    assert bool((ends >= starts).all()) and int(ends.max()) > 0 and int(starts.min()) >= 0
    from yirage.persistent.trace import write_chrome_trace

    trace = json.loads(write_chrome_trace(pk, tmp_path / "trace.json").read_text())
    assert len(trace["traceEvents"]) == n
    kinds = {e["cat"] for e in trace["traceEvents"]}
    assert {"embed", "rmsnorm_linear", "attention", "argmax"} <= kinds


def test_any_worker_split_decodes_like_transformers(zoo) -> None:
    need_cpu()
    model = zoo("llama-gqa")
    for workers, schedulers in ((1, 0), (1, 1), (2, 0), (2, 1), (3, 2)):
        fast = InferEngine(model.path, backend="cpu", num_workers=workers, num_local_schedulers=schedulers)
        result = fast.generate(model.reference.ids, greedy(output_logits=True))
        assert_decode_matches(model.reference, result.tokens, result.logits,
                              label=f"{model.label}, {workers} workers, {schedulers} schedulers")


def test_any_task_split_decodes_like_transformers(zoo) -> None:
    need_cpu()
    model = zoo("mistral-gqa")
    for tasks in (1, 3, 7):
        fast = InferEngine(model.path, backend="cpu", tasks_per_layer=tasks)
        result = fast.generate(model.reference.ids, greedy(output_logits=True))
        assert_decode_matches(model.reference, result.tokens, result.logits, label=f"{model.label}, {tasks} tasks")
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="tasks_per_layer must be a positive int"):
            InferEngine(model.path, backend="cpu", tasks_per_layer=bad)


def test_sharded_checkpoints_load(tmp_path, zoo) -> None:
    model = zoo("llama-gqa")
    model.oracle.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="200KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    result = InferEngine(tmp_path / "sharded", backend="reference").generate(model.reference.ids,
                                                                             greedy(output_logits=True))
    assert_decode_matches(model.reference, result.tokens, result.logits, label=f"{model.label}, sharded")


def test_the_spec_snippet_builds_and_runs_on_cpu() -> None:
    """The spec's constructor (32 workers, 16 schedulers) on a hand-built one-layer model."""
    if not yr.is_backend_available("cpu"):
        pytest.skip("no cpu backend")
    torch.manual_seed(0)
    hidden, vocab, heads, dim = 32, 64, 2, 16

    def build(backend: str, tokens: torch.Tensor, step: torch.Tensor) -> yr.PersistentKernel:
        mpk = yr.PersistentKernel(world_size=1, mpi_rank=0, num_workers=32, num_local_schedulers=16,
                                  num_remote_schedulers=0, max_seq_length=24, eos_token_id=2,
                                  meta_tensors=[step, tokens], profiler_tensor=None, spec_decode_config=None,
                                  backend=backend)
        g = torch.Generator().manual_seed(3)
        w = {n: torch.randn(*s, generator=g) * 0.2 for n, s in
             {"embed": (vocab, hidden), "qkv": (heads * 3 * dim, hidden), "o": (hidden, heads * dim),
              "gu": (2 * 48, hidden), "down": (hidden, 48), "head": (vocab, hidden)}.items()}
        ones = mpk.attach_input(torch.ones(hidden), "ones")
        cos = mpk.attach_input(torch.ones(24, dim), "cos")
        sin = mpk.attach_input(torch.zeros(24, dim), "sin")
        x = mpk.new_tensor((1, hidden), name="x")
        mpk.embed_layer(mpk.tokens_tensor, mpk.attach_input(w["embed"], "embed"), x, grid_dim=(4, 1, 1))
        qkv = mpk.new_tensor((1, heads * 3 * dim), name="qkv")
        mpk.rmsnorm_linear_layer(x, ones, mpk.attach_input(w["qkv"], "wqkv"), qkv, grid_dim=(6, 1, 1))
        att = mpk.new_tensor((1, heads * dim), name="att")
        caches = [mpk.attach_input(torch.zeros(1, heads, 24, dim), n) for n in ("kc", "vc")]
        mpk.attention_layer(qkv, *caches, cos_pos_embed=cos, sin_pos_embed=sin, output=att, grid_dim=(1, heads, 1))
        x2 = mpk.new_tensor((1, hidden), name="x2")
        mpk.linear_with_residual_layer(att, mpk.attach_input(w["o"], "wo"), x, x2, grid_dim=(8, 1, 1))
        gu = mpk.new_tensor((1, 96), name="gu")
        mpk.rmsnorm_linear_layer(x2, ones, mpk.attach_input(w["gu"], "wgu"), gu, grid_dim=(3, 1, 1))
        x3 = mpk.new_tensor((1, hidden), name="x3")
        mpk.silu_mul_linear_with_residual_layer(gu, mpk.attach_input(w["down"], "wd"), x2, x3, grid_dim=(2, 1, 1))
        logits = mpk.new_tensor((1, vocab), name="logits")
        mpk.rmsnorm_linear_layer(x3, ones, mpk.attach_input(w["head"], "head"), logits, grid_dim=(4, 1, 1))
        mpk.argmax_layer(logits, mpk.new_tensor((1, 1), dtype=torch.int64, name="next"))
        return mpk.compile()

    runs = {}
    for backend in ("reference", "cpu"):
        tokens, step = torch.zeros(1, 24, dtype=torch.int64), torch.tensor([0])
        tokens[0, 0] = 5
        steps = build(backend, tokens, step)(10)
        runs[backend] = (steps, tokens.clone(), int(step[0]))
    assert runs["cpu"][0] == runs["reference"][0] >= 1
    assert torch.equal(runs["cpu"][1], runs["reference"][1]) and runs["cpu"][2] == runs["reference"][2]


def test_rows_after_eos_are_padded_not_stale(zoo) -> None:
    need_cpu()
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend="cpu")
    free = model.reference.tokens[:, :12].tolist()  # transformers' tokens, no EOS
    stop = free[0][3]
    result = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=12, eos_token_id=stop))
    for row, got, length in zip(free, result.tokens.tolist(), result.lengths, strict=True):
        end = row.index(stop) + 1 if stop in row else 12
        assert length == end and got == row[:end] + [stop] * (12 - end)  # padded with the EOS id after it


def test_out_of_range_meta_tensors_are_refused_before_running(zoo) -> None:
    need_cpu()
    engine = InferEngine(zoo("llama-gqa").path, backend="cpu")
    engine.reset_cache(1, 16)
    pk = engine.model.build_decoder(engine._step, engine._tokens, backend="cpu")
    engine._tokens[0, 0] = 10**9
    with pytest.raises(LayerError, match="not a token id"):
        pk(1)
    engine._tokens[0, 0] = 1
    engine._step[0] = 10**7
    with pytest.raises(LayerError, match="outside"):
        pk(1)


def test_narrow_activations_are_refused() -> None:
    pk = spec_kernel("reference")
    x = pk.new_tensor((1, 32), name="x")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(torch.randn(100, 32), "embed"), x)
    w = pk.attach_input(torch.randn(32, 32), "w")
    with pytest.raises(LayerError, match="attach activations"):
        pk.linear_with_residual_layer(x, w, pk.attach_input(torch.randn(1, 32, dtype=torch.bfloat16), "r"),
                                      pk.new_tensor((1, 32), name="y"))
    with pytest.raises(LayerError, match="weights must be one of"):
        pk.linear_with_residual_layer(x, pk.attach_input(torch.ones(32, 32, dtype=torch.int64), "wi"), x,
                                      pk.new_tensor((1, 32), name="z"))


def test_a_residual_that_is_its_own_output_is_refused() -> None:
    """The CPU tasks add the residual after their dots (pk_quant.finish_rows), so it must never be the output."""
    pk = spec_kernel("reference")
    x = pk.new_tensor((1, 32), name="x")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(torch.randn(100, 32), "embed"), x)
    y = pk.new_tensor((1, 32), name="y")
    with pytest.raises(LayerError, match="residual 'y' is read before any layer writes it"):
        pk.linear_with_residual_layer(x, pk.attach_input(torch.randn(32, 32), "w"), y, y)


def test_unsupported_model_options_are_refused() -> None:
    from yirage.models.config import LlamaConfig, ModelError

    base = hf_config("llama-gqa").to_dict()
    for key in ("mlp_bias", "attention_bias"):
        with pytest.raises(ModelError, match=key):
            LlamaConfig.from_dict({**base, key: True})


def test_engine_is_exported_and_takes_text_when_a_tokenizer_exists(zoo) -> None:
    assert yr.InferEngine is InferEngine and yr.GenerationConfig is GenerationConfig
    with pytest.raises(yr.YirageError, match="no tokenizer"):
        InferEngine(zoo("llama-gqa").path, backend="reference").generate("hello")
