"""The greedy LM head in two passes (yirage.models.head_screen, PersistentKernel.screened_logits_layer).

The oracle is float64: logits from the same normalized rows and weights, argmax per row. The heads are built
with near-ties (rows within 1e-4 of the winner, far below bf16's resolution and far above float32's), so a screen
that dropped a row it should keep, or kept the wrong one, picks a different token; a zero bound does (checked).
Each runtime with a body runs: the cpu runtime and the reference oracle runtime.
"""

from __future__ import annotations

import pytest
import torch

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine
from yirage.models.head_screen import SCREEN_ENV, bf16_screen
from yirage.persistent.layers import LayerError

transformers = pytest.importorskip("transformers")

from llm_oracle import zoo_factory  # noqa: E402 - needs transformers, checked just above

HIDDEN, VOCAB, BATCH, EPS = 64, 256, 3, 1e-5
RUNTIMES = ("cpu", "reference")


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


def need(backend: str) -> None:
    if not yr.is_backend_available(backend):
        pytest.skip(f"the {backend} backend is not available here")


def normalized(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * gain.double()


def near_tie_head(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(embed, gain, head, tokens): for each token's hidden row, 12 head rows whose logits sit within 1e-4
    (relative) of the winner's, in shuffled places: each is the hidden row's direction plus its own noise
    orthogonal to it, so their bf16 roundings differ and misorder them, while float32 orders them right."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    gain = 0.5 + torch.rand(HIDDEN, generator=g)
    head = torch.randn(VOCAB, HIDDEN, generator=g) * 0.05
    tokens = [3, 17, 40]
    places = torch.randperm(VOCAB, generator=g).tolist()
    for n, tok in enumerate(tokens):
        x = normalized(embed[tok], gain)
        unit = x / x.norm()
        for j in range(12):  # logits 0.3 * |x| * (1 + up to 1e-4)
            noise = torch.randn(HIDDEN, generator=g, dtype=torch.float64)
            noise = (noise - (noise @ unit) * unit) / noise.norm() * 0.3
            head[places[n * 12 + j]] = (unit * 0.3 * (1 + 1e-4 * torch.rand((), generator=g)) + noise).float()
    return embed, gain, head, tokens


def decode_one(backend: str, embed: torch.Tensor, gain: torch.Tensor, head: torch.Tensor, tokens: list[int],
               screen: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of embed -> LM head -> argmax (screened when ``screen`` is given): (picked, logits)."""
    toks = torch.zeros(BATCH, 4, dtype=torch.int64)
    toks[:, 0] = torch.tensor(tokens)
    step = torch.zeros(BATCH, dtype=torch.int64)
    pk = yr.PersistentKernel(num_workers=2, num_local_schedulers=0, max_seq_length=4, meta_tensors=[step, toks],
                             backend=backend)
    x = pk.new_tensor((BATCH, HIDDEN), name="x")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(embed, "embed"), x, grid_dim=2)
    norm, weight = pk.attach_input(gain, "norm"), pk.attach_input(head, "head")
    logits = pk.new_tensor((BATCH, VOCAB), name="logits")
    if screen is None:
        pk.rmsnorm_linear_layer(x, norm, weight, logits, grid_dim=4, eps=EPS)
    else:
        scores = pk.new_tensor((BATCH, VOCAB), name="scores")
        pk.rmsnorm_linear_layer(x, norm, pk.attach_input(screen[0], "screen"), scores, grid_dim=4, eps=EPS)
        pk.screened_logits_layer(scores, x, norm, weight, pk.attach_input(screen[1], "bound"), logits, eps=EPS)
    pk.argmax_layer(logits, pk.new_tensor((BATCH, 1), dtype=torch.int64, name="next"))
    pk.compile()
    assert pk(1) == 1
    return toks[:, 1].clone(), pk.read("logits").clone()


def oracle_picks(embed: torch.Tensor, gain: torch.Tensor, head: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return (normalized(embed[tokens], gain) @ head.double().t()).argmax(-1)


@pytest.mark.parametrize("backend", RUNTIMES)
def test_the_screened_pick_is_the_exact_argmax(backend) -> None:
    need(backend)
    embed, gain, head, tokens = near_tie_head()
    want = oracle_picks(embed, gain, head, tokens)
    plain, exact = decode_one(backend, embed, gain, head, tokens, None)
    picked, screened = decode_one(backend, embed, gain, head, tokens, bf16_screen(head))
    assert torch.equal(plain, want) and torch.equal(picked, want)
    kept = torch.isfinite(screened)
    assert (kept.sum(-1) >= 12).all() and (kept.sum(-1) < VOCAB // 4).all(), kept.sum(-1)  # the ties, few others
    assert torch.equal(screened[kept], exact[kept])  # the kept rows: the one-pass head's bits
    assert (screened[~kept] == -torch.inf).all()


@pytest.mark.parametrize("backend", RUNTIMES)
def test_a_zero_bound_picks_wrong_tokens_here(backend) -> None:
    """The near-tie heads need the bound: without it the bf16 order decides, and it is wrong for some row."""
    need(backend)
    embed, gain, head, tokens = near_tie_head()
    screen, bound = bf16_screen(head)
    picked, _ = decode_one(backend, embed, gain, head, tokens, (screen, torch.zeros_like(bound)))
    assert not torch.equal(picked, oracle_picks(embed, gain, head, tokens))


@pytest.mark.parametrize("backend", RUNTIMES)
def test_a_screen_that_is_not_finite_computes_every_row(backend) -> None:
    need(backend)
    embed, gain, head, tokens = near_tie_head()
    plain, exact = decode_one(backend, embed, gain, head, tokens, None)
    screen, bound = bf16_screen(head)
    bound[7] = torch.nan  # what LlamaModel.head_screen leaves where an updated head gets no screen
    picked, screened = decode_one(backend, embed, gain, head, tokens, (screen, bound))
    assert torch.equal(picked, plain) and torch.equal(screened, exact)
    embed = embed.clone()
    embed[tokens[1], 5] = torch.inf  # a hidden row that is not finite: NaN logits, the first NaN is picked
    plain, exact = decode_one(backend, embed, gain, head, tokens, None)
    picked, screened = decode_one(backend, embed, gain, head, tokens, bf16_screen(head))
    assert torch.equal(picked, plain) and torch.equal(screened.isnan(), exact.isnan())


def test_the_bound_holds_for_extreme_rows() -> None:
    """|screen . x - W . x| <= row_bound * |x|_1 (both dots in float32, any order) for rows of mixed scales,
    subnormals, zeros and large values, and large or tiny x."""
    g = torch.Generator().manual_seed(1)
    k = 576
    scales = torch.tensor([1e-40, 1e-30, 1e-3, 1.0, 1e3, 1e30])
    w = torch.randn(len(scales) * 40, k, generator=g) * scales.repeat_interleave(40)[:, None]
    w[0] = 0.0
    w[1, :k // 2] = 1e-44  # subnormal
    x0 = torch.randn(k, generator=g)
    w[2] = (1 + 2**-8) * x0.sign()  # every weight halfway between two bf16 values, rounded down, against x0's signs:
    # the screen's error is 2^-8 / (1 + 2^-8) of the bound's unit, all of one sign (a bound 2x too small fails)
    screen, bound = bf16_screen(w)
    for x_scale in (1e-20, 1.0, 1e5):
        x = torch.cat([x0[None], torch.randn(7, k, generator=g)]) * x_scale
        gap = ((x @ screen.float().t()).double() - (x @ w.t()).double()).abs()
        limit = bound.double()[None] * x.abs().double().sum(-1, keepdim=True)
        assert (gap <= limit).all(), (gap / limit.clamp_min(1e-300)).max()
    assert bf16_screen(w.bfloat16()) is None and bf16_screen(torch.full((4, k), torch.inf)) is None
    assert bf16_screen(torch.full((4, k), 3.4e38)) is None  # overflows bf16


def test_only_argmax_reads_screened_logits_and_other_runtimes_decline_it() -> None:
    need("cpu")
    embed, gain, head, tokens = near_tie_head()
    toks, step = torch.zeros(BATCH, 4, dtype=torch.int64), torch.zeros(BATCH, dtype=torch.int64)
    pk = yr.PersistentKernel(max_seq_length=4, meta_tensors=[step, toks], backend="cpu")
    assert pk.runs("screened_logits") and pk.runs("argmax")
    x = pk.new_tensor((BATCH, HIDDEN), name="x")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(embed, "embed"), x)
    screen, bound = bf16_screen(head)
    norm, weight = pk.attach_input(gain, "norm"), pk.attach_input(head, "head")
    scores, logits = pk.new_tensor((BATCH, VOCAB), name="scores"), pk.new_tensor((BATCH, VOCAB), name="logits")
    pk.rmsnorm_linear_layer(x, norm, pk.attach_input(screen, "screen"), scores)
    with pytest.raises(LayerError, match="row_bound"):
        pk.screened_logits_layer(scores, x, norm, weight, pk.attach_input(bound[:-1], "short"), logits)
    pk.screened_logits_layer(scores, x, norm, weight, pk.attach_input(bound, "bound"), logits)
    with pytest.raises(LayerError, match="only argmax_layer"):
        pk.sampling_layer(logits, pk.new_tensor((BATCH, 1), dtype=torch.int64, name="drawn"))
    if yr.is_backend_available("opencl"):  # a C-family runtime: no body, and a clear refusal
        other = yr.PersistentKernel(max_seq_length=4, meta_tensors=[step, toks], backend="opencl")
        assert not other.runs("screened_logits")


def screened(engine: InferEngine) -> list[bool]:
    return ["screened_logits" in [layer.kind for layer in d.program.layers] for d in engine._decoders.values()]


def test_engine_screens_greedy_float32_decodes_and_keeps_their_tokens(zoo, monkeypatch) -> None:
    need("cpu")
    model = zoo("llama-gqa")
    engine = InferEngine(model.path, backend="cpu")
    config = GenerationConfig(max_new_tokens=12, eos_token_id=())
    on = engine.generate(model.reference.ids, config)
    assert screened(engine) == [True]
    assert torch.equal(on.tokens, model.reference.tokens[:, :12])  # transformers' greedy tokens
    monkeypatch.setenv(SCREEN_ENV, "0")
    off = engine.generate(model.reference.ids, config)
    assert screened(engine) == [True, False] and torch.equal(off.tokens, on.tokens)
    monkeypatch.delenv(SCREEN_ENV)
    logits = engine.generate(model.reference.ids, GenerationConfig(max_new_tokens=4, eos_token_id=(),
                                                                  output_logits=True)).logits
    assert torch.isfinite(logits).all()  # every logit asked for: the one-pass head


def test_a_head_changed_in_place_reaches_the_screened_decode(zoo) -> None:
    """The screen is remade from the updated head before the next run, or, where the head gets no screen any more
    (a NaN), its bounds make the runtime compute every row: the tokens of a fresh engine either way."""
    need("cpu")
    model = zoo("llama-gqa")
    config = GenerationConfig(max_new_tokens=8, eos_token_id=())
    engine = InferEngine(model.path, backend="cpu")
    before = engine.generate(model.reference.ids, config)
    for change in (lambda h: h.mul_(-1.0), lambda h: h.__setitem__((5, 0), torch.nan)):
        change(engine.model.lm_head)
        after = engine.generate(model.reference.ids, config)
        fresh = InferEngine(model.path, backend="cpu")
        fresh.model.lm_head.copy_(engine.model.lm_head)
        want = fresh.generate(model.reference.ids, GenerationConfig(max_new_tokens=8, eos_token_id=(),
                                                                    output_logits=True))
        assert not torch.equal(after.tokens, before.tokens)
        assert torch.equal(after.tokens, want.tokens)
        before = after
    assert screened(engine) == [True]

