"""Memory safety of the PersistentKernel and InferEngine (issue 7, items 1, 2, 3, 6 and 9, and review follow-ups).

Raw tensor addresses reach the compiled CPU decode loop, so anything that
could crash runs in a subprocess: a segfault is a test failure, not a dead
test run. Oracles: Hugging Face transformers (greedy tokens) and the
single-threaded run of the same engine.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch

import yirage as yr
from yirage.models.config import ModelError
from yirage.persistent.layers import LayerError

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))  # child processes import this module as tests.test_pk_safety
from llm_oracle import distinct_per_row, zoo_factory  # noqa: E402 - needs transformers, checked just above

needs_cpu = pytest.mark.skipif(not yr.is_backend_available("cpu"), reason="no cpu backend")


def compiled_pk_backends() -> list[str]:
    """Available backends whose PersistentKernel runtime runs compiled code (all but the torch reference)."""
    from yirage.backend.selection import registry

    return [b.value for b in yr.get_available_backends() if b.value != "reference"
            and type(registry().get(b.value)).persistent_runtime is not yr.Backend.persistent_runtime]


COMPILED = compiled_pk_backends() or [pytest.param("cpu", marks=pytest.mark.skip(reason="no compiled PK runtime"))]
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


def run_python(code: str, timeout: float = TIMEOUT, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **env})
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc


# -- item 1: one engine, many threads ---------------------------------------------------------------


@needs_cpu
def test_concurrent_generate_on_one_engine_matches_single_threaded(tmp_path_factory) -> None:
    """4 threads sharing one engine, mixing batch sizes and greedy/sampled configs, get the tokens of the
    single-threaded run; the greedy ones are transformers' on llm_oracle's diverse llama-gqa (tokens that vary, so
    equal tokens mean something)."""
    zoo = zoo_factory(tmp_path_factory)("llama-gqa")
    path, model = zoo.path, zoo.oracle
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
    assert all(min(distinct_per_row(g[:, p.shape[1]:])) >= 3 for g, p in zip(greedy, prompts, strict=True))
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


def hand_built_kernel(backend: str, embed_rows: int = 64, vocab: int = 64, step=None, tokens=None, seq: int = 24):
    """A one-layer decoder with random weights, built with the PersistentKernel API."""
    g = torch.Generator().manual_seed(3)
    hidden, heads, dim = 32, 2, 16
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


@pytest.mark.parametrize("backend", COMPILED)
def test_decode_stops_instead_of_reading_past_the_embed_table(backend) -> None:
    """Defence in depth: even with the compile check bypassed, the decode bounds-checks the token."""
    proc = run_python(f"""
        import torch, tests.test_pk_safety as t
        pk = t.hand_built_kernel({backend!r}, embed_rows=8, vocab=64)
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


CTRL_C_CASES = [(b, False) for b in COMPILED] + [("cpu", True)]


@pytest.mark.parametrize(("backend", "own_handler"), CTRL_C_CASES,
                         ids=[f"{b}{'-own-sigint-handler' if h else ''}" for b, h in CTRL_C_CASES])
def test_ctrl_c_stops_a_long_generate_quickly_and_the_engine_stays_usable(tiny, backend, own_handler) -> None:
    """With Python's default SIGINT handler the cpu decode runs in the main thread and Ctrl-C reaches it through
    the wakeup fd; with the application's own handler it runs in a helper thread while the main thread waits in
    interruptible slices (backends/cpu/yirage_backend_cpu/pk_calls.py): both must stop within seconds."""
    path, _ = tiny
    handler = "signal.signal(signal.SIGINT, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt()))" \
        if own_handler else "pass"
    child = textwrap.dedent(f"""
        import signal, threading, time, torch
        from yirage.engine import InferEngine, GenerationConfig
        engine = InferEngine({str(path)!r}, backend={backend!r})
        ids = torch.tensor([[1, 2, 3]])
        short = GenerationConfig(max_new_tokens=12, eos_token_id=())
        engine.generate(ids, short)  # compile first
        {handler}
        print("go", flush=True)

        def announce():  # the interrupt must land in the decode loop, however slow its set-up is on a busy machine
            while int(engine._step[0]) < 3 + 20:
                time.sleep(0.01)
            print("decoding", flush=True)

        threading.Thread(target=announce, daemon=True).start()
        try:
            engine.generate(ids, GenerationConfig(max_new_tokens=60000, eos_token_id=()))  # > 30 s uninterrupted
            print("finished", time.time(), flush=True)
        except KeyboardInterrupt:
            stamp, step = time.time(), int(engine._step[0])
            kept = engine._tokens[0, 3:step + 1].clone()  # the first token (prefill) and every completed step
            beyond = int(engine._tokens[0, step + 1:].abs().sum())
            again = engine.generate(ids, short).tokens  # the interrupted engine is still usable
            fresh = InferEngine({str(path)!r}, backend={backend!r})
            same = torch.equal(again, fresh.generate(ids, short).tokens)
            prefix = fresh.generate(ids, GenerationConfig(max_new_tokens=step - 2, eos_token_id=())).tokens[0]
            print("interrupted", stamp, step, beyond, same, torch.equal(kept, prefix), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        first = proc.stdout.readline().strip()
        assert first == "go", first + proc.stderr.read()
        running = proc.stdout.readline().strip()  # 20 steps into the long generation, well inside its ~30 s decode
        assert running == "decoding", running + proc.stderr.read()
        time.sleep(0.2)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err[-3000:]
    words = out.split()
    assert words[0] == "interrupted", out
    assert float(words[1]) - sent < 3.0, f"KeyboardInterrupt came {float(words[1]) - sent:.2f} s after SIGINT"
    step, beyond = int(words[2]), int(words[3])
    assert step > 3 + 1, "no decode step completed before the interrupt"
    assert beyond == 0, "a token was written after the last completed step"
    assert words[4:6] == ["True", "True"], "the engine misbehaved after the interrupt, or the kept tokens differ"


# -- follow-ups from a hostile-user review ------------------------------------------------------------------


@needs_cpu
def test_a_meta_device_context_or_fake_mode_never_reaches_the_cpu_runtime() -> None:
    """compile() under torch.device("meta") put the runtime's buffers on meta (address 0): a segfault."""
    expected = hand_built_kernel("reference")
    expected.tokens[0, 0] = 3
    expected(3)
    proc = run_python("""
        import torch, tests.test_pk_safety as t
        from torch._subclasses.fake_tensor import FakeTensorMode
        from yirage.persistent.layers import LayerError

        pk = t.hand_built_kernel("cpu")
        with torch.device("meta"):
            pk.compile()
        pk.tokens[0, 0] = 3
        pk(3)
        print("tokens", pk.tokens[0, :4].tolist())
        for label, action in (("compile", pk.compile), ("call", lambda: pk(1))):
            try:
                with FakeTensorMode():
                    action()
                print(label, "ran")
            except LayerError as exc:
                print(label, "refused:", exc)
    """)
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["tokens"] == str(expected.tokens[0, :4].tolist())
    for label in ("compile", "call"):
        assert out[label].startswith("refused:") and "FakeTensorMode is active" in out[label], out[label]
        assert "call it outside FakeTensorMode" in out[label]


@pytest.mark.parametrize("backend", COMPILED)
def test_a_storage_swapped_out_during_a_run_stays_alive_and_the_next_run_reports_it(backend) -> None:
    """Another thread's tokens.set_(...) mid-decode freed the memory the decode loop was writing."""
    proc = run_python(f"""
        import threading, torch, tests.test_pk_safety as t
        import yirage as yr
        from yirage.persistent.layers import LayerError

        seq = 2048
        # 64 MB: above glibc's largest mmap threshold, so freeing it unmaps it and a later write faults
        tokens = torch.zeros(1, 8 * 2**20, dtype=torch.int64)
        pk = t.hand_built_kernel({backend!r}, tokens=tokens, seq=seq).compile()
        pk.tokens[0, 0] = 3
        swapped = {{}}

        def swap():
            while int(pk.step[0]) < 8:  # the decode is under way
                pass
            swapped["at"] = int(pk.step[0])
            pk.tokens.set_(torch.zeros(1, seq, dtype=torch.int64))  # drops the only user reference to the old one
            swapped["done"] = True

        thread = threading.Thread(target=swap)
        thread.start()
        steps = pk(seq - 20)
        thread.join()
        print("mid-run", swapped["at"] < steps, swapped.get("done"))
        try:
            pk(1)
            print("next ran")
        except LayerError as exc:
            print("next refused:", exc)
    """)
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["mid-run"] == "True True", out
    assert out["next"].startswith("refused:") and "'tokens' changed after the PersistentKernel was built" in out["next"]


def small_kernel(backend: str, tied: bool = False, caches=None):
    """Embedding and lm_head read from one tensor (attached twice, ``tied``) or from two equal copies."""
    g = torch.Generator().manual_seed(5)
    hidden, heads, dim, seq, vocab = 32, 2, 16, 24, 64
    pk = yr.PersistentKernel(num_workers=2, num_local_schedulers=0, max_seq_length=seq, backend=backend,
                             meta_tensors=[torch.zeros(1, dtype=torch.int64), torch.zeros(1, seq, dtype=torch.int64)])
    table = torch.randn(vocab, hidden, generator=g)
    embed = pk.attach_input(table, "embed")
    head = pk.attach_input(table if tied else table.clone(), "head")
    ones = pk.attach_input(torch.ones(hidden), "ones")
    x = pk.new_tensor((1, hidden), name="x")
    pk.embed_layer(pk.tokens_tensor, embed, x)
    qkv = pk.new_tensor((1, heads * 3 * dim), name="qkv")
    pk.rmsnorm_linear_layer(x, ones, pk.attach_input(torch.randn(heads * 3 * dim, hidden, generator=g), "wqkv"), qkv)
    att = pk.new_tensor((1, heads * dim), name="att")
    kc, vc = caches(pk) if caches else (pk.attach_input(torch.zeros(1, heads, seq, dim), n) for n in ("kc", "vc"))
    pk.attention_layer(qkv, kc, vc, cos_pos_embed=pk.attach_input(torch.ones(seq, dim), "cos"),
                       sin_pos_embed=pk.attach_input(torch.zeros(seq, dim), "sin"), output=att)
    logits = pk.new_tensor((1, vocab), name="logits")
    pk.rmsnorm_linear_layer(x, ones, head, logits)
    pk.argmax_layer(logits, pk.new_tensor((1, 1), dtype=torch.int64, name="next"))
    return pk


def test_a_written_kv_cache_may_not_alias_anything_but_read_only_sharing_works() -> None:
    def same_pk_tensor(pk):
        cache = pk.attach_input(torch.zeros(1, 2, 24, 16), "kc")
        return cache, cache

    with pytest.raises(LayerError, match="k_cache and v_cache are the same tensor 'kc'"):
        small_kernel("reference", caches=same_pk_tensor)
    shared = torch.zeros(1, 2, 24, 16)  # one torch tensor attached under two names
    pk = small_kernel("reference", caches=lambda pk: (pk.attach_input(shared, "kc"), pk.attach_input(shared, "vc")))
    with pytest.raises(LayerError, match="'kc' overlaps 'vc' in memory, and decoding writes 'kc'"):
        pk.compile()

    def tokens_attached_again(pk):
        pk.attach_input(pk.tokens, "tokens_again")  # the buffer the decode loop writes, attached as an input
        return (pk.attach_input(torch.zeros(1, 2, 24, 16), n) for n in ("kc", "vc"))

    with pytest.raises(LayerError, match="'tokens' overlaps 'tokens_again'"):
        small_kernel("reference", caches=tokens_attached_again).compile()
    pk = small_kernel("reference")
    qkv, cos, sin = (pk.tensors[n] for n in ("qkv", "cos", "sin"))
    with pytest.raises(LayerError, match="'kc' is already the k_cache"):  # two layers writing one cache
        pk.attention_layer(qkv, pk.tensors["kc"], pk.attach_input(torch.zeros(1, 2, 24, 16), "vc2"),
                           cos_pos_embed=cos, sin_pos_embed=sin, output=pk.new_tensor((1, 32), name="att2"))
    # tied embeddings: one table read by embed and lm_head decodes exactly like two equal copies
    tied, copies = small_kernel("reference", tied=True), small_kernel("reference", tied=False)
    for pk in (tied, copies):
        pk.tokens[0, 0] = 7
        pk(6)
    assert tied.tokens.tolist() == copies.tokens.tolist()


@needs_cpu
def test_a_child_forked_while_another_thread_decodes_can_decode() -> None:
    """The child inherited the kernel's lock held by a thread that does not exist there: it hung forever.

    Runs on numba's fork-safe TBB layer (on the default OpenMP layer the child gets a ForkError instead,
    tests/test_cpu_safety.py), so what is tested is the lock.
    """
    pytest.importorskip("numba")
    try:
        metadata.distribution("tbb")
    except metadata.PackageNotFoundError:
        pytest.skip("the tbb wheel is not installed: pip install 'yirage-backend-cpu[tbb]'")
    expected = hand_built_kernel("reference")
    expected.tokens[0, 0] = 3
    expected(3)
    proc = run_python("""
        import os, threading, time, torch, tests.test_pk_safety as t

        seq = 2048
        pk = t.hand_built_kernel("cpu", seq=seq).compile()
        stop = []

        def spin():
            while not stop:
                pk.step.zero_()
                pk.tokens[0, 0] = 5
                pk(seq - 20)  # long: the thread holds the kernel's lock almost all the time

        thread = threading.Thread(target=spin)
        thread.start()
        while int(pk.step[0]) < 8:  # inside a call
            pass
        pid = os.fork()
        if pid == 0:
            try:
                torch.set_num_threads(1)
                pk.step.zero_()
                pk.tokens.zero_()
                pk.tokens[0, 0] = 3
                pk(3)
                print("child", pk.tokens[0, :4].tolist(), flush=True)
                os._exit(0)
            except BaseException as exc:
                print("child raised", type(exc).__name__, exc, flush=True)
                os._exit(3)
        deadline = time.time() + 120
        status = None
        while time.time() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(code)
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        stop.append(True)
        thread.join()
        print("status", status, flush=True)
    """, NUMBA_THREADING_LAYER="tbb")
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["status"] == "0", f"the child hung or failed: {proc.stdout}"
    assert out["child"] == str(expected.tokens[0, :4].tolist())


@needs_cpu
def test_ctrl_c_in_the_main_thread_stops_a_decode_running_in_a_worker_thread(tiny) -> None:
    """Python joins non-daemon threads before exiting: the process waited for the whole decode."""
    path, _ = tiny
    child = textwrap.dedent(f"""
        import threading, torch
        from yirage.engine import InferEngine, GenerationConfig
        engine = InferEngine({str(path)!r}, backend="cpu")
        ids = torch.tensor([[1, 2, 3]])
        engine.generate(ids, GenerationConfig(max_new_tokens=4, eos_token_id=()))  # compile first
        wanted = 60000  # tens of seconds uninterrupted

        def work():
            try:
                result = engine.generate(ids, GenerationConfig(max_new_tokens=wanted, eos_token_id=()))
                print("worker finished", result.tokens.shape[1], "of", wanted, flush=True)
            except BaseException as exc:
                print("worker stopped", type(exc).__name__, int(engine._step[0]) - 3, "of", wanted, flush=True)

        thread = threading.Thread(target=work)
        thread.start()
        while engine._step is None or int(engine._step[0]) < 3 + 8:  # the decode is under way
            pass
        print("interrupting", flush=True)
        raise KeyboardInterrupt
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        first = proc.stdout.readline().strip()
        assert first == "interrupting", first + proc.stderr.read()
        proc.wait(timeout=300)  # a hang detector only: it exits within a step or so
        # read() through the same buffer: readline may already hold the worker's line (communicate() would bypass
        # that buffer and lose it); the outputs are a few lines, so waiting first cannot fill a pipe
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        proc.kill()
    words = out.split()
    assert words[:3] == ["worker", "stopped", "InterpreterExitingError"], (
        f"exit code {proc.returncode}: {out}{err[-2000:]}")
    assert int(words[3]) < 60000
    assert "KeyboardInterrupt" in err
