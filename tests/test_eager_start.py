"""The eager start: a greedy generate whose decode kernel is still compiling decodes its first steps in torch
(yirage.reference.eager) on the kernel's own tensors, and the kernel takes over between steps. Checked against
transformers' greedy tokens (the independent oracle), on the cpu backend whose compile it waits out, with the
runtime's ``compiling()`` made to say "still compiling" for a chosen number of steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from yirage.config import ConfigError, eager_start
from yirage.engine import GenerationConfig, InferEngine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama (vocab 256) and its transformers twin; a prompt and transformers' 12 greedy tokens."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(7)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return path, ids, out[:, ids.shape[1]:]


def still_compiling(monkeypatch, runtime_class, calls: int) -> list[int]:
    """``runtime_class.compiling()`` says True for its first ``calls`` calls, then False; returns the call count."""
    seen = [0]

    def compiling(self) -> bool:
        seen[0] += 1
        return seen[0] <= calls

    monkeypatch.setattr(runtime_class, "compiling", compiling, raising=False)
    return seen


@pytest.mark.parametrize("calls", [1, 5, 40])  # the pick only; the pick and 4 steps; every step
def test_eager_steps_then_the_compiled_runtime_give_transformers_tokens(tiny, monkeypatch, calls) -> None:
    pytest.importorskip("numba")
    from yirage_backend_cpu.pk_runtime import CPUPersistentRuntime

    path, ids, want = tiny
    engine = InferEngine(path, backend="cpu", eager_start=True)
    seen = still_compiling(monkeypatch, CPUPersistentRuntime, calls)
    res = engine.generate(ids, GenerationConfig(max_new_tokens=12, eos_token_id=()))
    assert torch.equal(res.tokens, want), (res.tokens, want)
    # the pick asks once; each eager step asks again before the next: 11 steps after the picked first token
    assert res.timings["eager_steps"] == min(calls - 1, 11) and res.timings["steps"] == 11
    assert seen[0] >= min(calls, 12)
    still_compiling(monkeypatch, CPUPersistentRuntime, 0)  # compiled now
    again = engine.generate(ids, GenerationConfig(max_new_tokens=12, eos_token_id=()))
    assert torch.equal(again.tokens, want) and again.timings["eager_steps"] == 0


def test_eager_steps_stop_at_eos_like_the_runtime(tiny, monkeypatch) -> None:
    pytest.importorskip("numba")
    from yirage_backend_cpu.pk_runtime import CPUPersistentRuntime

    path, ids, want = tiny
    eos = int(want[0, 5])
    end = next(i for i, t in enumerate(want[0].tolist()) if t == eos) + 1  # the first time it appears
    engine = InferEngine(path, backend="cpu", eager_start=True)
    still_compiling(monkeypatch, CPUPersistentRuntime, 100)
    res = engine.generate(ids, GenerationConfig(max_new_tokens=12, eos_token_id=eos))
    assert res.lengths == [end] and torch.equal(res.tokens[:, :end], want[:, :end])
    assert res.timings["eager_steps"] == end - 1


def test_sampling_output_logits_a_spent_budget_and_eager_start_off_wait_for_the_compile(tiny, monkeypatch) -> None:
    pytest.importorskip("numba")
    from yirage_backend_cpu.pk_runtime import CPUPersistentRuntime

    path, ids, want = tiny
    still_compiling(monkeypatch, CPUPersistentRuntime, 1000)
    on = InferEngine(path, backend="cpu", eager_start=True)
    sampled = on.generate(ids, GenerationConfig(max_new_tokens=6, eos_token_id=(), temperature=0.8, seed=1))
    assert sampled.timings["eager_steps"] == 0  # the draws would depend on which runtime ran a step
    logits = on.generate(ids, GenerationConfig(max_new_tokens=6, eos_token_id=(), output_logits=True))
    assert logits.timings["eager_steps"] == 0 and torch.equal(logits.tokens, want[:, :6])
    from yirage.persistent import kernel

    monkeypatch.setattr(kernel, "EAGER_SECONDS", 0.0)  # the eager budget spent: the compile is waited for
    spent = InferEngine(path, backend="cpu", eager_start=True).generate(ids, GenerationConfig(max_new_tokens=6,
                                                                                              eos_token_id=()))
    assert spent.timings["eager_steps"] == 0 and torch.equal(spent.tokens, want[:, :6])
    off = InferEngine(path, backend="cpu", eager_start=False)
    res = off.generate(ids, GenerationConfig(max_new_tokens=6, eos_token_id=()))
    assert res.timings["eager_steps"] == 0 and torch.equal(res.tokens, want[:, :6])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantized_weights_give_the_oracles_tokens_and_wait_above_the_copy_budget(tiny, monkeypatch, fmt) -> None:
    pytest.importorskip("numba")
    from yirage_backend_cpu.pk_runtime import CPUPersistentRuntime

    from yirage.persistent import kernel

    path, ids, _ = tiny
    cfg = GenerationConfig(max_new_tokens=12, eos_token_id=())
    oracle = InferEngine(path, backend="reference", dtype=fmt, eager_start=False).generate(ids, cfg)
    still_compiling(monkeypatch, CPUPersistentRuntime, 100)
    res = InferEngine(path, backend="cpu", dtype=fmt, eager_start=True).generate(ids, cfg)
    assert res.timings["eager_steps"] == 11 and torch.equal(res.tokens, oracle.tokens)
    monkeypatch.setattr(kernel, "EAGER_FLOAT_COPIES", 4 * 64 * 64 - 1)  # less than one matrix's float32 copy
    res = InferEngine(path, backend="cpu", dtype=fmt, eager_start=True).generate(ids, cfg)
    assert res.timings["eager_steps"] == 0 and torch.equal(res.tokens, oracle.tokens)


def test_a_warm_process_runs_no_eager_step(tiny) -> None:
    pytest.importorskip("numba")
    path, ids, want = tiny
    engine = InferEngine(path, backend="cpu", eager_start=True)
    engine.generate(ids, GenerationConfig(max_new_tokens=2, eos_token_id=()))
    engine.wait_compiled()
    res = engine.generate(ids, GenerationConfig(max_new_tokens=12, eos_token_id=()))
    assert res.timings["eager_steps"] == 0 and torch.equal(res.tokens, want)


def test_the_switch_reads_yes_and_no_and_refuses_anything_else() -> None:
    assert eager_start({}) and eager_start({"YIRAGE_EAGER_START": "1"})
    assert not eager_start({"YIRAGE_EAGER_START": "0"}) and not eager_start({"YIRAGE_EAGER_START": "off"})
    with pytest.raises(ConfigError, match="YIRAGE_EAGER_START='maybe' is not a switch"):
        eager_start({"YIRAGE_EAGER_START": "maybe"})
    with pytest.raises(ValueError, match="eager_start must be True, False or None"):
        InferEngine("unused", backend="reference", eager_start="yes")


COLD = textwrap.dedent("""
    import json, sys, time
    import torch
    from yirage.engine import GenerationConfig, InferEngine
    path, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    engine = InferEngine(path, backend="cpu")
    cfg = GenerationConfig(max_new_tokens=12, eos_token_id=())
    first = engine.generate(ids, cfg)
    engine.wait_compiled()
    second = engine.generate(ids, cfg)
    print(json.dumps({"first": first.tokens.tolist(), "first_eager": first.timings["eager_steps"],
                      "second": second.tokens.tolist(), "second_eager": second.timings["eager_steps"]}))
""")


def test_a_cold_process_answers_before_its_compile_ends_and_then_decodes_compiled(tiny, tmp_path) -> None:
    """The real thing: empty numba and yirage caches, the default switch (on): the first generate runs eager steps
    while the children compile; after wait_compiled the second runs none; both give transformers' tokens."""
    pytest.importorskip("numba")
    path, ids, want = tiny
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "YIRAGE_CACHE_DIR": str(tmp_path / "yirage")}
    env.pop("YIRAGE_EAGER_START")  # the users' default
    env.pop("YIRAGE_CPU_COMPILE_APART", None)
    done = subprocess.run([sys.executable, "-c", COLD, str(path), json.dumps(ids.tolist())], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["first"] == want.tolist() and out["second"] == want.tolist()
    assert out["first_eager"] > 0, "a cold cache: the first steps should not have waited for the compile"
    assert out["second_eager"] == 0


def test_a_prompt_runs_torch_while_its_tiles_compile_and_the_tiles_once_they_can(monkeypatch) -> None:
    """prompt_linear with the eager start on: None (torch's GEMM) while a child has the tiles' entry point to
    compile, the tiles once it is compiled or cached; with it off, the tiles (waiting for their compile)."""
    pytest.importorskip("numba")
    from yirage_backend_cpu import prompt_linear as pl
    from yirage_backend_cpu.prompt_rows import CAPS, Fixed

    tiles = pl.PromptLinear(Fixed(dict(CAPS)))
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(64, 32, generator=g), torch.randn(4, 32, generator=g)
    want = x.double() @ w.double().t()
    entry = pl.linear_entry
    monkeypatch.setenv("YIRAGE_EAGER_START", "1")
    monkeypatch.setattr(entry, "_wrapper_address", None)  # as in a process that has not compiled it
    monkeypatch.setattr(pl, "pending", lambda job: job is entry)  # a child has it
    assert tiles(x, w) is None
    monkeypatch.setenv("YIRAGE_EAGER_START", "0")
    out = tiles(x, w)  # waits for (here: loads or compiles) the entry, as before
    assert out is not None and torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("YIRAGE_EAGER_START", "1")
    assert tiles(x, w) is not None  # compiled in this process now: no child to wait for
