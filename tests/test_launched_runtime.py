"""The launched PersistentKernel runtime (Triton task kernels, one launch sequence per step) against transformers.

It is the PersistentKernel path of every backend whose kernels are Triton
(the domestic vendors' forks, ROCm, CUDA). Here it runs under Triton's
interpreter on CPU tensors, so these tests run only in the ``triton-interpret``
target (``TRITON_INTERPRET=1``; see the Makefile) and skip elsewhere with the
reason. Decodes are short (the interpreter runs every program instance in
Python): 8 tokens, compared per step with transformers' logits.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the launched runtime's Triton kernels run here only under TRITON_INTERPRET=1 (make triton-interpret)",
                allow_module_level=True)

from llm_oracle import assert_decode_matches, reference_generate, zoo_factory  # noqa: E402 - needs transformers
from test_llm_ablation import ABLATIONS, broken_engine  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


@pytest.fixture(scope="module")
def backend() -> str:
    if not yr.is_backend_available("triton"):
        pytest.skip(f"the triton backend is not available: {yr.get_backend_info('triton')}")
    return "triton"


def short(reference, n: int = NEW):
    """transformers' reference cut to the first ``n`` tokens (greedy: a prefix of a longer decode)."""
    return dataclasses.replace(reference, tokens=reference.tokens[:, :n], logits=reference.logits[:, :n])


def decode(engine: InferEngine, ids, **kw):
    return engine.generate(ids, GenerationConfig(max_new_tokens=NEW, eos_token_id=(), output_logits=True, **kw))


# every model kind once, and each weight dtype once (the interpreter is slow: the suite stays short)
@pytest.mark.parametrize("kind, dtype", [("llama-gqa", torch.float32), ("qwen2-bias-tied", torch.bfloat16),
                                         ("mistral-gqa", torch.float16)], ids=str)
def test_launched_decode_matches_transformers(zoo, backend, kind, dtype, monkeypatch) -> None:
    """The qwen2 case decodes with the GEMV blocks ``_gemv_blocks`` picks from the SM count a backend passes (2
    programs per SM), forced to a 4-SM count (few programs: the interpreter runs each in Python): 8-32 columns a
    program instead of 64. The others keep the fixed blocks."""
    from yirage.persistent import launched

    chosen: list[tuple[int, int]] = []
    if kind == "qwen2-bias-tied":
        blocks = launched.LaunchedRuntime._gemv_blocks
        init = launched.LaunchedRuntime.__init__
        monkeypatch.setattr(launched.LaunchedRuntime, "__init__",
                            lambda self, program, config, processors=0: init(self, program, config, 4))
        monkeypatch.setattr(launched.LaunchedRuntime, "_gemv_blocks",
                            lambda self, *a: chosen.append(blocks(self, *a)) or chosen[-1])
    model = zoo(kind, dtype)
    engine = InferEngine(model.path, backend=backend)
    result = decode(engine, model.reference.ids)
    assert_decode_matches(short(model.reference), result.tokens, result.logits, label=f"{model.label} on {backend}")
    fast = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=NEW, eos_token_id=()))
    assert fast.tokens.tolist() == model.reference.tokens[:, :NEW].tolist()  # the whole decode in one call
    assert all(bn <= 32 for bn, _ in chosen) and bool(chosen) == (kind == "qwen2-bias-tied"), chosen


@pytest.mark.parametrize("kv_dtype", (torch.bfloat16, torch.float16), ids=str)
def test_launched_decode_with_16_bit_kv_caches(zoo, backend, kv_dtype) -> None:
    """The store kernel rounds the new key and value to the cache (bfloat16 by hand: the interpreter's cast
    truncates); the oracle is transformers rounding every key and value entering its cache."""
    model = zoo("llama-gqa")
    rounded = reference_generate(model.oracle, model.reference.ids, NEW, kv_dtype=kv_dtype)
    engine = InferEngine(model.path, backend=backend, kv_cache_dtype=kv_dtype)
    result = decode(engine, model.reference.ids)
    assert engine.model.k_cache[0].dtype == kv_dtype
    assert_decode_matches(rounded, result.tokens, result.logits, label=f"{model.label}, {kv_dtype} cache")


@pytest.mark.parametrize("name", ["no-rope", "qkv-bias-dropped"])
def test_a_broken_decoder_fails_the_comparison(zoo, backend, name, monkeypatch) -> None:
    kind, dtype, ablate = ABLATIONS[name]
    model = zoo(kind, dtype)
    result = decode(broken_engine(model.path, backend, ablate, "decoder", monkeypatch), model.reference.ids)
    with pytest.raises(AssertionError, match="decode logits differ from transformers"):
        assert_decode_matches(short(model.reference), result.tokens, result.logits, label=name)


def test_sampling_stays_in_the_top_k_and_nucleus_and_follows_the_seed(zoo, backend) -> None:
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend=backend)
    temperature, top_k, top_p = 2.0, 20, 0.8
    result = decode(engine, model.reference.ids, temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    # (8 steps x 2 rows checked below; the seed checks use 6-token decodes: the interpreter is slow)
    for row in range(result.tokens.shape[0]):
        for step in range(1, result.tokens.shape[1]):
            scores = result.logits[row, step].double() / temperature
            order = torch.argsort(scores, descending=True)
            rank = int((order == int(result.tokens[row, step])).nonzero())
            assert rank < top_k, f"row {row} step {step}: rank {rank} is outside top_k={top_k}"
            above = float(torch.softmax(scores[order[:top_k]], 0)[:rank].sum())
            assert above < top_p + 1e-5, f"row {row} step {step}: {above:.4f} of the mass ranks above the token"
    hot = GenerationConfig(max_new_tokens=6, eos_token_id=(), temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=11)
    again = engine.generate(model.reference.ids, hot).tokens
    other = engine.generate(model.reference.ids, dataclasses.replace(hot, seed=12)).tokens
    assert torch.equal(result.tokens[:, :6], again) and not torch.equal(again, other)


def test_rows_stop_at_eos_and_are_padded(zoo, backend) -> None:
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend=backend)
    free = model.reference.tokens[:, :NEW].tolist()
    stop = free[0][3]
    result = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=NEW, eos_token_id=stop))
    for row, got, length in zip(free, result.tokens.tolist(), result.lengths, strict=True):
        end = row.index(stop) + 1 if stop in row else NEW
        assert length == end and got == row[:end] + [stop] * (NEW - end)


def test_a_captured_step_is_replayed_and_decodes_the_same(zoo, backend, monkeypatch) -> None:
    """Where the device has a graph API the step is recorded once and replayed (StepGraph).

    CUDA graphs cannot run here, so the recording is a stand-in that keeps the step function and calls it
    on replay: this proves the runtime replays exactly one step's work per step (tokens and logits still
    match transformers) and captures only after an eager first step, not that CUDA capture works.
    """
    from yirage.persistent import launched

    recorded = []

    class Recorded:
        def __init__(self, step):
            self.step, self.replays = step, 0
            recorded.append(self)

        def replay(self):
            self.replays += 1
            self.step()

    monkeypatch.setattr(launched.StepGraph, "for_device", classmethod(lambda cls, device: Recorded))
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend=backend)
    fast = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=NEW, eos_token_id=()))
    assert fast.tokens.tolist() == model.reference.tokens[:, :NEW].tolist()
    assert len(recorded) == 1 and recorded[0].replays == NEW - 2  # step 1 eager (then captured), the rest replayed


def test_a_failed_capture_runs_the_step_eagerly_retries_then_decodes_without_a_graph(zoo, backend, monkeypatch,
                                                                                       caplog) -> None:
    """A capture that fails (CUDA reports an invalidated capture) recorded nothing and ran nothing: the tokens must
    still equal transformers', the next step runs eagerly, one retry is made, then no graph is tried again."""
    from yirage.persistent import launched

    attempts = []

    def failing(step):
        attempts.append(step)
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(launched.StepGraph, "for_device", classmethod(lambda cls, device: failing))
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend=backend)
    with caplog.at_level("WARNING", logger=launched.__name__):
        got = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=NEW, eos_token_id=()))
    assert got.tokens.tolist() == model.reference.tokens[:, :NEW].tolist()
    assert len(attempts) == launched.CAPTURE_TRIES
    assert "decoding without a graph from now on" in caplog.text and "recording again" in caplog.text


def test_a_step_is_recorded_with_the_garbage_collector_off_and_thread_local_capture_errors() -> None:
    """A collection during the capture could destroy an older engine's graph, which invalidates the capture."""
    import contextlib
    import gc

    from yirage.persistent.launched import StepGraph

    seen = {}

    class Module:
        @staticmethod
        @contextlib.contextmanager
        def graph(graph, pool=None, stream=None, capture_error_mode="global"):
            seen["mode"] = capture_error_mode
            yield

    StepGraph(Module, object, lambda: seen.setdefault("collecting", gc.isenabled()))
    assert seen == {"mode": "thread_local", "collecting": False} and gc.isenabled()


def test_devices_with_a_graph_api_get_a_capture_and_the_cpu_does_not() -> None:
    from yirage.persistent.launched import StepGraph

    assert StepGraph.for_device(torch.device("cpu")) is None
    assert callable(StepGraph.for_device(torch.device("cuda")))  # torch.cuda.CUDAGraph + torch.cuda.graph
