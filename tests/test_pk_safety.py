"""Memory safety of the PersistentKernel and InferEngine (issue 7, items 1, 2, 3 and 6).

Raw tensor addresses reach the compiled CPU decode loop, so anything that
could crash runs in a subprocess: a segfault is a test failure, not a dead
test run. Oracles: Hugging Face transformers (greedy tokens) and the
single-threaded run of the same engine.
"""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import yirage as yr
from yirage.models.llama import ModelError
from yirage.persistent.layers import LayerError

transformers = pytest.importorskip("transformers")
needs_cpu = pytest.mark.skipif(not yr.is_backend_available("cpu"), reason="no cpu backend")
TIMEOUT = 900  # a cold numba compile of the decode loop takes up to a minute or two on a busy machine
ROOT = Path(__file__).resolve().parents[1]  # children import this module as tests.test_pk_safety


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer GQA Llama (vocab 256) saved with safetensors; returns (path, transformers model)."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=65536, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def run_python(code: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc


# -- item 1: one engine, many threads ---------------------------------------------------------------


@needs_cpu
def test_concurrent_generate_on_one_engine_matches_single_threaded(tiny) -> None:
    path, model = tiny
    prompts = [torch.randint(0, 256, (b, 4 + b), generator=torch.Generator().manual_seed(b)) for b in (1, 2, 3)]
    with torch.no_grad():
        greedy = [model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=6, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
                  for p in prompts]
    proc = run_python(f"""
        import threading, torch
        from yirage.engine import InferEngine, GenerationConfig
        engine = InferEngine({str(path)!r}, backend="cpu")
        prompts = [torch.randint(0, 256, (b, 4 + b), generator=torch.Generator().manual_seed(b)) for b in (1, 2, 3)]
        configs = [GenerationConfig(max_new_tokens=6, eos_token_id=()),
                   GenerationConfig(max_new_tokens=6, eos_token_id=(), temperature=1.3, top_k=20, seed=5)]
        jobs = [(p, c) for p in range(3) for c in range(2)]
        expected = {{job: engine.generate(prompts[job[0]], configs[job[1]]).tokens for job in jobs}}
        print("greedy", [expected[(p, 0)].tolist() for p in range(3)])
        bad, errors = [], []
        def work(seed):
            try:
                for i in range(20):
                    job = jobs[(seed * 7 + i) % len(jobs)]  # every thread mixes batch sizes and pickers
                    got = engine.generate(prompts[job[0]], configs[job[1]]).tokens
                    if not torch.equal(got, expected[job]):
                        bad.append((seed, i, job))
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        print("bad", len(bad), bad[:3], "errors", errors[:3])
    """)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["greedy"] == str([g[:, p.shape[1]:].tolist() for g, p in zip(greedy, prompts, strict=True)])
    assert lines["bad"] == "0 [] errors []"


# -- item 2: the token producer must fit the consumer ---------------------------------------------------


def test_checkpoint_tensors_must_match_config_json(tiny, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from yirage.engine import InferEngine

    path, _ = tiny
    weights = load_file(str(path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text().replace('"vocab_size": 256',
                                                                                     '"vocab_size": 512'))
    bad = dict(weights)
    bad["lm_head.weight"] = torch.randn(512, 64)  # the picker could emit ids 256..511 into a 256-row table
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"'embed_tokens.weight' has shape \(256, 64\).*\(512, 64\)"):
        InferEngine(tmp_path, backend="reference")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    bad = dict(weights)
    bad["model.layers.1.self_attn.k_proj.weight"] = torch.randn(48, 64)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"'layers.1.self_attn.k_proj.weight' has shape \(48, 64\).*\(32, 64\)"):
        InferEngine(tmp_path, backend="reference")


def hand_built_kernel(backend: str, embed_rows: int = 64, vocab: int = 64, step=None, tokens=None):
    """A one-layer decoder with random weights, built with the PersistentKernel API."""
    g = torch.Generator().manual_seed(3)
    hidden, heads, dim, seq = 32, 2, 16, 24
    step = torch.zeros(1, dtype=torch.int64) if step is None else step
    tokens = torch.zeros(1, seq, dtype=torch.int64) if tokens is None else tokens
    pk = yr.PersistentKernel(num_workers=2, num_local_schedulers=0, max_seq_length=seq, meta_tensors=[step, tokens],
                             backend=backend)
    weights = {name: pk.attach_input(torch.randn(*shape, generator=g) * 0.5, name) for name, shape in
               {"embed": (embed_rows, hidden), "wqkv": (heads * 3 * dim, hidden), "wo": (hidden, heads * dim),
                "head": (vocab, hidden)}.items()}
    ones = pk.attach_input(torch.ones(hidden), "ones")
    x = pk.new_tensor((1, hidden), name="x")
    pk.embed_layer(pk.tokens_tensor, weights["embed"], x)
    qkv = pk.new_tensor((1, heads * 3 * dim), name="qkv")
    pk.rmsnorm_linear_layer(x, ones, weights["wqkv"], qkv)
    att = pk.new_tensor((1, heads * dim), name="att")
    caches = [pk.attach_input(torch.zeros(1, heads, seq, dim), n) for n in ("kc", "vc")]
    pk.attention_layer(qkv, *caches, cos_pos_embed=pk.attach_input(torch.ones(seq, dim), "cos"),
                       sin_pos_embed=pk.attach_input(torch.zeros(seq, dim), "sin"), output=att)
    x2 = pk.new_tensor((1, hidden), name="x2")
    pk.linear_with_residual_layer(att, weights["wo"], x, x2)
    logits = pk.new_tensor((1, vocab), name="logits")
    pk.rmsnorm_linear_layer(x2, ones, weights["head"], logits)
    pk.argmax_layer(logits, pk.new_tensor((1, 1), dtype=torch.int64, name="next"))
    return pk


def test_compile_refuses_a_picker_wider_than_the_embed_table() -> None:
    pk = hand_built_kernel("reference", embed_rows=32, vocab=64)
    with pytest.raises(LayerError, match=r"argmax_layer picks token ids in \[0, 64\).*'embed' has only 32 rows"):
        pk.compile()
    hand_built_kernel("reference", embed_rows=64, vocab=32).compile()  # a narrower picker is fine


@needs_cpu
def test_cpu_decode_stops_instead_of_reading_past_the_embed_table() -> None:
    """Defence in depth: even with the compile check bypassed, the EMBED task bounds-checks the token."""
    proc = run_python("""
        import torch, tests.test_pk_safety as t
        pk = t.hand_built_kernel("cpu", embed_rows=8, vocab=64)
        pk._check_token_range = lambda: None  # bypass the compile-time check on purpose
        pk.compile()
        pk.tokens[0, 0] = 5
        try:
            pk(20)
            print("no error", pk.tokens[0, :6].tolist())
        except Exception as exc:
            step = int(pk.step[0])
            print(type(exc).__name__, exc, "| step", step, "| tokens", pk.tokens[0, :step + 1].tolist())
    """)
    out = proc.stdout
    assert out.startswith("LayerError") and "is not a row of the embed table" in out, out
    step = int(out.split("| step ")[1].split()[0])
    tokens = ast.literal_eval(out.split("| tokens ")[1].strip())
    assert all(0 <= tok < 8 for tok in tokens[:-1]) and tokens[-1] >= 8 and len(tokens) == step + 1


# -- item 3: meta tensors and attached tensors handed to compiled code ----------------------------------


def test_meta_tensors_with_unsafe_layouts_are_refused_at_construction() -> None:
    guard = torch.zeros(64, dtype=torch.int64)
    cases = {
        "expanded step": dict(step=torch.zeros(1, dtype=torch.int64).expand(2),
                              tokens=torch.zeros(2, 24, dtype=torch.int64)),
        "expanded tokens view": dict(step=torch.zeros(2, dtype=torch.int64),
                                     tokens=guard[16:40].view(1, 24).expand(2, 24)),
        "transposed tokens": dict(step=torch.zeros(2, dtype=torch.int64),
                                  tokens=torch.zeros(24, 2, dtype=torch.int64).t()),
        "column-sliced tokens": dict(step=torch.zeros(2, dtype=torch.int64),
                                     tokens=torch.zeros(2, 48, dtype=torch.int64)[:, ::2]),
        "strided step": dict(step=torch.zeros(4, dtype=torch.int64)[::2],
                             tokens=torch.zeros(2, 24, dtype=torch.int64)),
    }
    for label, meta in cases.items():
        with pytest.raises(LayerError, match="not contiguous row-major"):
            print(label)
            yr.PersistentKernel(max_seq_length=24, meta_tensors=[meta["step"], meta["tokens"]], backend="reference")
    buf = torch.zeros(1 + 24, dtype=torch.int64)
    with pytest.raises(LayerError, match="overlaps"):
        yr.PersistentKernel(max_seq_length=24, meta_tensors=[buf[:1], buf[:24].view(1, 24)], backend="reference")
    with pytest.raises(LayerError, match="this backend reads cpu tensors"):
        yr.PersistentKernel(max_seq_length=24, backend="reference",
                            meta_tensors=[torch.zeros(1, dtype=torch.int64, device="meta"),
                                          torch.zeros(1, 24, dtype=torch.int64)])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(LayerError, match="plain torch.Tensor.*FakeTensor"):
        yr.PersistentKernel(max_seq_length=24, meta_tensors=[fake, torch.zeros(1, 24, dtype=torch.int64)],
                            backend="reference")
    pk = yr.PersistentKernel(max_seq_length=24, meta_tensors=[torch.zeros(1, dtype=torch.int64),
                                                              torch.zeros(1, 24, dtype=torch.int64)],
                             backend="reference")
    with pytest.raises(LayerError, match="negated"):
        pk.attach_input(torch.randn(4, 4)._neg_view(), "neg")
    with pytest.raises(LayerError, match="not contiguous"):
        pk.attach_input(torch.randn(4, 8)[:, :4], "sliced")


def test_a_kv_cache_sharing_memory_with_a_weight_is_refused_at_compile() -> None:
    pk = hand_built_kernel("reference")
    pk.torch_tensors["kc"].set_(pk.torch_tensors["embed"].untyped_storage(), 0, (1, 2, 24, 16))
    with pytest.raises(LayerError, match="'kc' overlaps 'embed'"):
        pk.compile()


@needs_cpu
def test_unsafe_meta_tensors_never_reach_compiled_code_and_in_place_swaps_are_caught() -> None:
    """Each case crashed, corrupted memory or decoded wrong rows before; each must now raise a clear error."""
    proc = run_python("""
        import torch, tests.test_pk_safety as t
        from yirage.persistent.layers import LayerError

        def attempt(label, fn):
            try:
                fn()
                print(label, "ran")
            except LayerError as exc:
                print(label, "refused:", str(exc).replace("\\n", " "))

        def run_with(step, tokens):
            pk = t.hand_built_kernel("cpu", step=step, tokens=tokens).compile()
            pk(4)

        guard = torch.zeros(64, dtype=torch.int64)
        attempt("expand-step", lambda: run_with(torch.zeros(1, dtype=torch.int64).expand(2),
                                                torch.zeros(2, 24, dtype=torch.int64)))
        attempt("guard-view", lambda: run_with(torch.zeros(2, dtype=torch.int64),
                                               guard[16:40].view(1, 24).expand(2, 24)))
        print("guard intact", bool((guard == 0).all()))

        pk = t.hand_built_kernel("cpu").compile()
        pk.tokens[0, 0] = 3
        pk(2)
        pk.tokens.set_(torch.zeros(1, 24, dtype=torch.int64).untyped_storage())  # the old storage is freed
        attempt("tokens-set", lambda: pk(2))
        pk = t.hand_built_kernel("cpu").compile()
        pk.torch_tensors["head"].resize_(4, 32)
        attempt("weight-resize", lambda: pk(2))
        pk = t.hand_built_kernel("cpu").compile()
        pk.step.resize_(0)
        attempt("step-resize", lambda: pk(2))
    """)
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["expand-step"].startswith("refused:") and "not contiguous row-major" in out["expand-step"]
    assert out["guard-view"].startswith("refused:") and out["guard"] == "intact True"
    assert "'tokens' changed after the PersistentKernel was built" in out["tokens-set"]
    assert "rebuild the PersistentKernel" in out["tokens-set"]
    assert "'head' changed" in out["weight-resize"] and "shape (64, 32) -> (4, 32)" in out["weight-resize"]
    assert "'step' changed" in out["step-resize"]


# -- item 6: Ctrl-C -------------------------------------------------------------------------------------------


@needs_cpu
def test_ctrl_c_stops_a_long_generate_quickly_and_the_engine_stays_usable(tiny) -> None:
    path, _ = tiny
    child = textwrap.dedent(f"""
        import time, torch
        from yirage.engine import InferEngine, GenerationConfig
        engine = InferEngine({str(path)!r}, backend="cpu")
        ids = torch.tensor([[1, 2, 3]])
        short = GenerationConfig(max_new_tokens=12, eos_token_id=())
        engine.generate(ids, short)  # compile first
        print("go", flush=True)
        try:
            engine.generate(ids, GenerationConfig(max_new_tokens=8000, eos_token_id=()))  # ~30 s uninterrupted
            print("finished", time.time(), flush=True)
        except KeyboardInterrupt:
            stamp, step = time.time(), int(engine._step[0])
            kept = engine._tokens[0, 3:step + 1].clone()  # the first token (prefill) and every completed step
            beyond = int(engine._tokens[0, step + 1:].abs().sum())
            again = engine.generate(ids, short).tokens  # the interrupted engine is still usable
            fresh = InferEngine({str(path)!r}, backend="cpu")
            same = torch.equal(again, fresh.generate(ids, short).tokens)
            prefix = fresh.generate(ids, GenerationConfig(max_new_tokens=step - 2, eos_token_id=())).tokens[0]
            print("interrupted", stamp, step, beyond, same, torch.equal(kept, prefix), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        first = proc.stdout.readline().strip()
        assert first == "go", first + proc.stderr.read()
        time.sleep(1.5)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    words = out.split()
    assert words[0] == "interrupted", out
    assert float(words[1]) - sent < 3.0, f"KeyboardInterrupt came {float(words[1]) - sent:.2f} s after SIGINT"
    step, beyond = int(words[2]), int(words[3])
    assert step > 3 + 1, "no decode step completed before the interrupt"
    assert beyond == 0, "a token was written after the last completed step"
    assert words[4:6] == ["True", "True"], "the engine misbehaved after the interrupt, or the kept tokens differ"
