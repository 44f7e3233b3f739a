"""The CPU runtime's flash-decoding split (yirage_backend_cpu.pk_split): which layers split, the expanded task
graph's waits and trigger counts, the profile folded back per core task, and decodes through split attention
against transformers (uneven and empty chunks, float32 and bfloat16 caches)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import yirage as yr

pytest.importorskip("numba")
if not yr.is_backend_available("cpu"):
    pytest.skip("the cpu backend is not available", allow_module_level=True)

from yirage_backend_cpu import pk_runtime  # noqa: E402
from yirage_backend_cpu.pk_split import CHUNK_MIN_SEQ, attention_chunks, expand, fold_profile  # noqa: E402


def test_chunks_balance_the_workers_only_where_it_pays() -> None:
    long = CHUNK_MIN_SEQ
    assert attention_chunks(3, 2, long) == 2  # SmolLM2 at batch 1: 6 tasks, 3 per worker
    assert attention_chunks(1, 2, long) == 2
    assert attention_chunks(3, 3, long) == 1  # already one each
    assert attention_chunks(3, 4, long) == 4
    assert attention_chunks(3, 16, long) == 4  # no count up to 4 balances 16 workers: the most
    assert attention_chunks(8, 2, long) == 1  # 4 tasks per worker already
    assert attention_chunks(3, 2, long - 1) == 1  # a short cache: the merge costs more than the idle worker
    assert attention_chunks(3, 1, long) == 1


def test_expanded_copies_wait_like_their_task_and_count_toward_its_events() -> None:
    # layer 0: tasks 0, 1 trigger event 0 (needs 2), which gates layer 1's task 2; task 2 triggers event 1
    g = expand([0, 0, 1], [0, 1, 0], [[0], [0], [1]], [0, 0, 1], [2, 1], [[2], []], {0: 3})
    assert g.task_layer.tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert g.task_index.tolist() == [0, 1, 2, 3, 4, 5, 0]
    assert g.origin.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert g.event_trigger.tolist() == [6, 1]  # all six chunks finish before layer 1 starts
    assert g.task_waits.tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert g.event_gates == [[6], []]
    gated = expand([0, 1, 1], [0, 0, 1], [[0], [], []], [0, 1, 1], [1], [[1, 2]], {1: 2})
    assert gated.event_gates == [[1, 2, 3, 4]]  # every copy of a gated task is released
    assert gated.task_waits.tolist() == [0, 1, 1, 1, 1]


def test_a_split_task_is_profiled_from_its_first_chunk_to_its_last() -> None:
    # core task 0 split in two chunks (records 0, 1), core task 1 whole (record 2)
    profile = np.array([10, 20, 0, 5, 30, 1, 31, 40, 0], np.int64)
    assert fold_profile(profile, np.array([0, 0, 1]), 2).tolist() == [5, 30, 1, 31, 40, 0]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    pytest.importorskip("transformers")
    from llm_oracle import zoo_factory

    return zoo_factory(tmp_path_factory)


@pytest.mark.parametrize("kv_dtype", (None, torch.bfloat16), ids=str)
def test_split_attention_decodes_like_transformers(kv_dtype, zoo, monkeypatch) -> None:
    """2, 3 and 5 chunks per KV head on a short context: uneven chunks, and empty ones at the first steps."""
    from llm_oracle import assert_decode_matches, reference_generate

    from yirage.engine import GenerationConfig, InferEngine

    model = zoo("mistral-gqa")
    oracle = model.reference if kv_dtype is None else reference_generate(model.oracle, model.reference.ids,
                                                                         kv_dtype=kv_dtype)
    for chunks in (2, 3, 5):
        asked: list[int] = []
        monkeypatch.setattr(pk_runtime, "attention_chunks",
                            lambda tasks, workers, seq, c=chunks, asked=asked: asked.append(c) or c)
        engine = InferEngine(model.path, backend="cpu", kv_cache_dtype=kv_dtype)
        result = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=oracle.tokens.shape[1],
                                                                       eos_token_id=(), output_logits=True))
        assert asked, "the runtime never asked how to split its attention"
        assert_decode_matches(oracle, result.tokens, result.logits, label=f"{model.label}, {chunks} chunks, "
                                                                          f"{kv_dtype or 'float32'} cache")


def test_every_core_task_of_a_split_kernel_is_profiled(zoo, monkeypatch) -> None:
    monkeypatch.setattr(pk_runtime, "attention_chunks", lambda tasks, workers, seq: 3)
    from yirage.engine import InferEngine

    engine = InferEngine(zoo("llama-gqa").path, backend="cpu")
    engine.reset_cache(1, 16)
    engine._tokens[0, 0] = 3
    profile = torch.zeros(4096, dtype=torch.int64)
    pk = engine.model.build_decoder(engine._step, engine._tokens, backend="cpu", profiler_tensor=profile)
    pk(1)
    n = pk.task_graph.num_tasks
    starts, ends = profile[0:3 * n:3], profile[1:3 * n:3]
    assert bool((ends > starts).all()) and int(starts.min()) >= 0
    assert int(profile[3 * n:].abs().sum()) == 0  # nothing past the core's tasks
