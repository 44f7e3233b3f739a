"""The C-family PersistentKernel renderer (yirage.persistent.cstyle) and the runtimes built on it.

Oracles: the rendered source's own text parsed independently of the
renderer's tables (structure), NVRTC and ptxas (CUDA, no GPU needed), torch's
top-k / softmax over the logits each sampled token was drawn from (sampling),
float64 torch attention (the rendered OpenCL GQA attention, run on the device)
and transformers (the OpenCL device-copy mode). The greedy/logit comparisons
with transformers on every backend live in test_persistent.py, the breaks
they must catch in test_llm_ablation.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from pocl_layout import emulated_shuffles

import yirage as yr
from yirage.codegen.dialects import dialect
from yirage.engine import GenerationConfig, InferEngine
from yirage.persistent.cstyle import CTL, SCORES, STEP, XS, render_persistent

transformers = pytest.importorskip("transformers")

from llm_oracle import KINDS, assert_decode_matches, zoo_factory  # noqa: E402 - needs transformers

DIALECTS = ("opencl", "cuda", "hip", "metal")
SAMPLING = {"temperature": 1.5, "top_k": 50, "top_p": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


def program(zoo, kind: str, dtype=torch.float32, sampling=None, batch: int = 2, kv_dtype=None):
    """The frozen program of a zoo model's decoder (built on the reference backend: only the program is used)."""
    engine = InferEngine(zoo(kind, dtype).path, backend="reference", kv_cache_dtype=kv_dtype)
    engine.reset_cache(batch, 16)
    return engine.model.build_decoder(engine._step, engine._tokens, backend="reference", sampling=sampling).program


def kernels(source: str, kernel_word: str) -> dict[str, list[str]]:
    """kernel name -> parameter names, parsed from the source."""
    found = {}
    for m in re.finditer(rf"^{re.escape(kernel_word)} (?:__launch_bounds__\(\d+\) )?(\w+)\((.*)\) \{{$", source, re.M):
        found[m.group(1)] = [re.sub(r"\s*\[\[.*?\]\]", "", p).split()[-1].lstrip("*") for p in m.group(2).split(", ")]
    return found


def body(source: str, name: str) -> str:
    start = source.index("{", re.search(rf"\b{name}\(", source).start())
    depth = 0
    for j in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[j], 0)
        if depth == 0:
            return source[start:j + 1]
    raise AssertionError(f"unbalanced braces in {name}")


@pytest.mark.parametrize("lanes", (0, 8))
@pytest.mark.parametrize("dialect_name", DIALECTS)
def test_every_launch_names_a_kernel_whose_parameters_are_its_arguments(zoo, dialect_name, lanes) -> None:
    d = dialect(dialect_name)
    prog = program(zoo, "qwen2-bias-tied", torch.bfloat16, SAMPLING)  # biases, narrow weights, the sampler
    rendered = render_persistent(prog, d, lanes=lanes)
    source = rendered.source
    assert source.count("{") == source.count("}")
    sigs = kernels(source, d.kernel)
    ids = [p.split()[1] for p in d.id_params]
    names = {f"t{t.index}" for t in prog.tensors} | {CTL, STEP, XS, SCORES}
    for launch in (rendered.begin, *rendered.layers, rendered.commit):
        assert launch.kernel in sigs, f"{launch.kernel} is launched but not defined"
        assert len(sigs[launch.kernel]) == len(launch.args) + len(ids), launch
        assert set(launch.args) <= names and launch.groups >= 1 and launch.local >= 1
    assert set(sigs) == {x.kernel for x in (rendered.begin, *rendered.layers, rendered.commit)}, "dead kernels"
    assert {x.layer for x in rendered.layers} == {layer.index for layer in prog.layers}, "every layer runs"
    assert [x.layer for x in rendered.layers] == sorted(x.layer for x in rendered.layers), "layers in order"
    for name in sigs:
        text = body(source, name)
        shared = f"{d.local} " in text
        assert (d.barrier in text) == shared, f"{name}: barriers exactly where local memory is shared"
    # equal layers share one kernel: the two blocks of the model need no more kernels than one
    per_block = {x.kernel for x in rendered.layers if prog.layers[x.layer].output.name.endswith("1")}
    assert per_block and per_block <= {x.kernel for x in rendered.layers if
                                       prog.layers[x.layer].output.name.endswith("0")} | per_block


# every test model in float32, greedy; the sampler, biases and narrow weights once each
CUDA_MODELS = [(kind, torch.float32, None, None) for kind in KINDS] + [
    ("llama-gqa", torch.float32, SAMPLING, None), ("qwen2-bias-tied", torch.bfloat16, SAMPLING, torch.bfloat16),
    ("mistral-gqa", torch.float16, None, torch.float16)]  # the last two with 16-bit KV caches (a store kernel)


def test_the_persistent_kernel_of_every_test_model_compiles_for_cuda(zoo) -> None:
    """Issue 9: NVRTC (and ptxas) compile the decoders of the LLM test models for sm_80 and sm_90, no warnings."""
    cuda = pytest.importorskip("yirage_backend_cuda")
    try:
        cuda.nvrtc.toolchain()
    except cuda.ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    sources = {f"{kind}-{str(dtype)[6:]}-{'sampling' if sampling else 'greedy'}-kv-{str(kv or torch.float32)[6:]}":
               render_persistent(program(zoo, kind, dtype, sampling, kv_dtype=kv), dialect("cuda")).source
               for kind, dtype, sampling, kv in CUDA_MODELS}
    # a 16-bit cache is written by its own store kernel (rounding), a float32 one by the attention itself
    assert all(("y_kv_store" in src) == (not name.endswith("kv-float32")) for name, src in sources.items())
    report = cuda.compile_check(sources, ("sm_80", "sm_90"), options=cuda.BUILD_OPTIONS)
    print(report.summary())
    assert report.ok and report.compiled == 2 * len(sources), report.summary() + "".join(
        f"\n{f.name} {f.arch}: {f.message[:2000]}" for f in report.failures)


def pk_backends() -> list[str]:
    from yirage.backend.selection import registry

    return [b.value for b in yr.get_available_backends()
            if type(registry().get(b.value)).persistent_runtime is not yr.Backend.persistent_runtime]


@pytest.mark.parametrize("backend", pk_backends())
@pytest.mark.parametrize("top_k, top_p", ((5, 1.0), (0, 0.5), (20, 0.8)))
def test_sampled_tokens_come_from_the_top_k_and_nucleus_of_their_logits(zoo, backend, top_k, top_p) -> None:
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend=backend)
    temperature = 2.0
    config = GenerationConfig(max_new_tokens=12, eos_token_id=(), temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=11, output_logits=True)
    result = engine.generate(model.reference.ids, config)
    drawn = set()
    for row in range(result.tokens.shape[0]):
        for step in range(1, result.tokens.shape[1]):  # token 0 comes from the prefill, not the decoder
            scores = result.logits[row, step].double() / temperature
            token = int(result.tokens[row, step])
            drawn.add(token)
            order = torch.argsort(scores, descending=True)
            rank = int((order == token).nonzero())
            if top_k:
                assert rank < top_k, f"step {step} row {row}: token {token} has rank {rank}, outside top_k={top_k}"
            kept = scores[order[: top_k or len(order)]]
            probs = torch.softmax(kept, 0)
            above = float(probs[:rank].sum())
            assert above < top_p + 1e-5, (f"step {step} row {row}: token {token} has {above:.4f} of the mass "
                                          f"ranked above it, outside the top_p={top_p} nucleus")
    assert len(drawn) > 2, f"only {sorted(drawn)} were drawn: the draw ignores the seed or the distribution"


def test_opencl_gpu_layout_and_device_copy_mode_match_transformers(zoo, monkeypatch) -> None:
    """The paths of GPUs, forced on PoCL: device copies (uploads, read-backs, value()), work-group GEMVs."""
    if not yr.is_backend_available("opencl"):
        pytest.skip("the opencl backend is not available here")
    from yirage_backend_opencl import OpenCLBackend
    from yirage_backend_opencl.pk_runtime import OpenCLPersistentRuntime

    made = []

    def device_copy(self, program, config):
        made.append(OpenCLPersistentRuntime(program, config, zero_copy=False, lanes=0))
        return made[-1]

    monkeypatch.setattr(OpenCLBackend, "persistent_runtime", device_copy)
    model = zoo("mistral-gqa")
    engine = InferEngine(model.path, backend="opencl")
    result = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=32, eos_token_id=(),
                                                                   output_logits=True))
    assert made and not made[0].zero_copy and "red[" in made[0].rendered.source  # the work-group GEMV
    assert_decode_matches(model.reference, result.tokens, result.logits, label=f"{model.label}, device-copy mode")


def rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one head: x * cos + rotate_half(x) * sin (float64)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


@pytest.mark.parametrize("layout", ("cpu", "gpu-tree", "gpu-shuffles"))
@pytest.mark.parametrize("seq, positions, d", ((8, (3, 5), 16), (48, (3, 37), 20), (80, (0, 79), 64)))
def test_rendered_opencl_attention_reads_each_query_heads_own_kv_head(seq, positions, d, layout, request) -> None:
    """The rendered OpenCL attention, run on a tiny GQA program (2 rows at ``positions``, 2 KV heads of 3 query
    heads each, caches pre-filled with different values per KV head), equals float64 torch attention: query head h
    reads KV head h // 3 of its own row, at every position up to its step, new K (RoPE'd) and V included. A K/V
    offset that reads another KV head (``kb`` with g = 0 or g + 1) or another row fails here. The second case
    covers the loops that issue cstyle.ILP loads at once (38 positions: 4 rounds and 6 single ones; head_dim 20:
    2 rounds and 4) and their remainders. The GPU layouts (``lanes=0``, as CUDA/HIP render it: up to 16 threads a
    position splitting its columns, several positions a round, summed by a local tree or by shuffles, emulated
    here) at 80 positions and head_dim 64 (SmolLM2's) also cover positions 0 and 79: one round and a last round
    that is mostly past ``pos``."""
    if not yr.is_backend_available("opencl"):
        pytest.skip("the opencl backend is not available here")
    if layout != "cpu":
        forced = request.getfixturevalue("gpu_layout")
        if layout == "gpu-shuffles":
            forced.dialect = emulated_shuffles(True)
    batch, kv, group, hidden, vocab = 2, 2, 3, 32, 40
    qkv_cols = kv * (group + 2) * d
    gen = torch.Generator().manual_seed(31)
    print("seed 31")
    step = torch.tensor(positions)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    k0, v0 = torch.randn(batch, kv, seq, d, generator=gen), torch.randn(batch, kv, seq, d, generator=gen)
    cos, sin = torch.randn(seq, d, generator=gen), torch.randn(seq, d, generator=gen)
    pk = yr.PersistentKernel(max_seq_length=seq, meta_tensors=[step, tokens], backend="opencl")
    att = pk.attach_input
    x = pk.new_tensor((batch, hidden), name="x")
    pk.embed_layer(pk.tokens_tensor, att(torch.randn(vocab, hidden, generator=gen), "embed"), x)
    qkv = pk.new_tensor((batch, qkv_cols), name="qkv")
    pk.rmsnorm_linear_layer(x, att(torch.ones(hidden), "ln"), att(torch.randn(qkv_cols, hidden, generator=gen) * 0.5,
                                                                    "wqkv"), qkv)
    out = pk.new_tensor((batch, kv * group * d), name="attn")
    pk.attention_layer(qkv, att(k0.clone(), "kc"), att(v0.clone(), "vc"), cos_pos_embed=att(cos, "cos"),
                       sin_pos_embed=att(sin, "sin"), output=out)
    logits = pk.new_tensor((batch, vocab), name="logits")
    pk.rmsnorm_linear_layer(out, att(torch.ones(kv * group * d), "ln2"),
                            att(torch.randn(vocab, kv * group * d, generator=gen), "head"), logits)
    pk.argmax_layer(logits, pk.new_tensor((batch, 1), dtype=torch.int64, name="next"))
    pk.compile()
    pos = step.clone()
    assert pk(1) == 1
    q_k_v = pk.read("qkv").double().view(batch, kv, group + 2, d)
    got = pk.read("attn").double().view(batch, kv, group, d)
    want = torch.empty_like(got)
    for b in range(batch):
        p = int(pos[b])
        keys, values = k0[b].double().clone(), v0[b].double().clone()
        keys[:, p] = rope64(q_k_v[b, :, group], cos[p].double(), sin[p].double())
        values[:, p] = q_k_v[b, :, group + 1]
        for g in range(kv):
            q = rope64(q_k_v[b, g, :group], cos[p].double(), sin[p].double())  # (group, d)
            weights = torch.softmax(q @ keys[g, :p + 1].t() / d ** 0.5, -1)
            want[b, g] = weights @ values[g, :p + 1]
        assert torch.allclose(pk.read("kc")[b, :, p].double(), keys[:, p], rtol=1e-5, atol=1e-5), f"row {b} new K"
    err = (got - want).abs().amax(-1)  # (batch, kv, group)
    assert bool((err < 1e-4).all()), f"max |attention - float64| per (row, kv head, query head): {err.tolist()}"
    if layout != "cpu":
        (source,) = {r.source for r in forced.rendered}
        attention = source.split("y_attention")[1]
        assert ("y_shfl_xor(" in attention) == (layout == "gpu-shuffles"), "the scores' lanes sum as the dialect says"
        assert "int lane = (int)(lid % 4);" in attention if d == 20 else "lid % 16" in attention


@pytest.mark.parametrize("vocab", (300, 3001))
def test_rendered_opencl_argmax_takes_the_first_maximum_and_propagates_nan(vocab) -> None:
    """The rendered OpenCL argmax (one pass below cstyle.ARGMAX_CHUNK logits, else chunk partials then a pick)
    returns, per row, the first index of the maximum, or of the first NaN where a row has one: the oracle is that
    rule applied in Python to the logits the kernel read (read back). Logits of a one-element hidden state make
    the head's weights the logits (times the norm's ~1 or ~-1 per row), so planted ties, NaNs and infinities sit
    in different chunks: row 0 ties its maximum at two indices far apart, row 1 (the weights negated) has +inf
    values and three NaNs, the first two read by the last and the first thread of one work-group."""
    if not yr.is_backend_available("opencl"):
        pytest.skip("the opencl backend is not available here")
    gen = torch.Generator().manual_seed(5)
    print("seed 5")
    weights = torch.randperm(vocab, generator=gen).float() - vocab / 2  # distinct values, both signs
    top, low = int(weights.argmax()), int(weights.argmin())
    weights[vocab - 2] = weights[top]  # row 0: a tie for its maximum, the first index must win
    weights[[vocab // 3, vocab - 1]] = -math.inf  # row 1 (negated): +inf, beaten by the NaNs below
    # NaNs at 64 and 63 of a chunk: thread 0 reads the first, thread 63 the second (the tree must pick 63)
    base = vocab // 1024 * 512
    nans = [base + 64, base + 63, vocab - 3]
    weights[nans] = math.nan
    weights[min(low + 1, vocab - 4)] = 0.0
    for nan_row in (False, True):
        w = weights.clone()
        if not nan_row:
            w[nans] = 1.0
        pk = yr.PersistentKernel(max_seq_length=4, meta_tensors=[torch.zeros(2, dtype=torch.int64),
                                                                 torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]])],
                                 backend="opencl")
        x = pk.new_tensor((2, 1), name="x")
        table = torch.ones(vocab, 1)
        table[1] = -1.0  # row 1's token
        pk.embed_layer(pk.tokens_tensor, pk.attach_input(table, "embed"), x)
        logits = pk.new_tensor((2, vocab), name="logits")
        pk.rmsnorm_linear_layer(x, pk.attach_input(torch.ones(1), "ln"), pk.attach_input(w[:, None].clone(), "head"),
                                logits)
        pk.argmax_layer(logits, pk.new_tensor((2, 1), dtype=torch.int64, name="next"))
        pk.compile()
        assert pk(1) == 1
        got = pk.read("next").view(-1).tolist()
        for row, values in enumerate(pk.read("logits").tolist()):
            nans = [j for j, v in enumerate(values) if v != v]
            want = nans[0] if nans else values.index(max(values))
            assert got[row] == want, (f"vocab {vocab}, NaNs planted: {nan_row}, row {row}: argmax {got[row]} "
                                      f"({values[got[row]]}), want {want} ({values[want]})")
        if not nan_row:
            assert got[0] == top, "row 0's maximum is tied at index vocab - 2: the first index must win"


@pytest.mark.parametrize("top_k, top_p", ((40, 1.0), (0, 0.3), (200, 0.6)))
def test_rendered_opencl_sampler_over_a_wide_vocabulary_stays_in_the_top_k_and_nucleus(top_k, top_p) -> None:
    """The C-family sampler over 3001 logits on PoCL, 16 batch rows (each its own random stream): every drawn token
    lies in the top_k and the top_p nucleus of its row's logits as the kernel read them (softmax in float64 of
    logits / temperature), and the rows draw different tokens. Logits: the head weights times a one-element
    hidden state of ~1 (token 0) or ~-1 (token 1, every fourth row)."""
    if not yr.is_backend_available("opencl"):
        pytest.skip("the opencl backend is not available here")
    vocab, temperature, batch = 3001, 2.0, 16
    gen = torch.Generator().manual_seed(9)
    print("seed 9")
    weights = torch.randn(vocab, generator=gen) * 3
    first = torch.tensor([1 if r % 4 == 1 else 0 for r in range(batch)])
    pk = yr.PersistentKernel(max_seq_length=4, meta_tensors=[torch.zeros(batch, dtype=torch.int64),
                                                             torch.stack([first, *[first * 0] * 3], 1)],
                             backend="opencl")
    x = pk.new_tensor((batch, 1), name="x")
    table = torch.ones(vocab, 1)
    table[1] = -1.0
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(table, "embed"), x)
    logits = pk.new_tensor((batch, vocab), name="logits")
    pk.rmsnorm_linear_layer(x, pk.attach_input(torch.ones(1), "ln"), pk.attach_input(weights[:, None].clone(), "head"),
                            logits)
    pk.sampling_layer(logits, pk.new_tensor((batch, 1), dtype=torch.int64, name="next"), temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=5)
    pk.compile()
    assert pk(1) == 1
    got = pk.read("next").view(-1).tolist()
    for row, values in enumerate(pk.read("logits").double()):
        scores = values / temperature
        order = torch.argsort(scores, descending=True)
        rank = int((order == got[row]).nonzero())
        if top_k:
            assert rank < top_k, f"row {row}: token {got[row]} has rank {rank}, outside top_k={top_k}"
        probs = torch.softmax(scores[order[: top_k or vocab]], 0)
        above = float(probs[:rank].sum())
        assert above < top_p + 1e-5, f"row {row}: {above:.4f} of the mass ranks above the drawn token"
    assert len(set(got)) > 4, got


def test_rendered_opencl_sampler_with_nothing_to_draw_from_takes_the_raw_argmax() -> None:
    """Every score -inf or NaN (NaN scores count as -inf): the sampler returns the argmax of the raw logits, NaN
    first (the first NaN), as the CPU runtime's sample_row does."""
    if not yr.is_backend_available("opencl"):
        pytest.skip("the opencl backend is not available here")
    vocab = 3001
    weights = torch.full((vocab,), -math.inf)
    weights[[1234, 2000]] = math.nan
    pk = yr.PersistentKernel(max_seq_length=4, meta_tensors=[torch.zeros(1, dtype=torch.int64),
                                                             torch.zeros(1, 4, dtype=torch.int64)], backend="opencl")
    x = pk.new_tensor((1, 1), name="x")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(torch.ones(vocab, 1), "embed"), x)
    logits = pk.new_tensor((1, vocab), name="logits")
    pk.rmsnorm_linear_layer(x, pk.attach_input(torch.ones(1), "ln"), pk.attach_input(weights[:, None].clone(), "head"),
                            logits)
    pk.sampling_layer(logits, pk.new_tensor((1, 1), dtype=torch.int64, name="next"), temperature=1.0, top_k=5,
                      top_p=0.5, seed=3)
    pk.compile()
    assert pk(1) == 1
    assert pk.read("next").view(-1).tolist() == [1234]
