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
from yirage.persistent.specs import SCREEN_UNDERFLOW

transformers = pytest.importorskip("transformers")

from llm_oracle import zoo_factory  # noqa: E402 - needs transformers, checked just above

HIDDEN, VOCAB, BATCH, EPS = 64, 250, 5, 1e-5  # a vocab that is no multiple of the scan's 8 lanes; batch rows past
# the one-pass head's 4-row tiles (their bits must equal the screened task's one-row recompute)
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
    tokens = [3, 17, 40, 41, 99]
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
        pk.rmsnorm_linear_layer(x, norm, weight, logits, grid_dim=5, eps=EPS)
    else:
        scores = pk.new_tensor((BATCH, VOCAB), name="scores")
        pk.rmsnorm_linear_layer(x, norm, pk.attach_input(screen[0], "screen"), scores, grid_dim=5, eps=EPS)
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
    for value in (torch.inf, -torch.inf):  # a screen row that is not finite: not trusted either
        bad = screen.clone()
        bad[9] = value
        picked, screened = decode_one(backend, embed, gain, head, tokens, (bad, bf16_screen(head)[1]))
        assert torch.equal(picked, plain) and torch.equal(screened, exact)
    embed = embed.clone()
    embed[tokens[1], 5] = torch.inf  # a hidden row that is not finite: NaN logits, the first NaN is picked
    plain, exact = decode_one(backend, embed, gain, head, tokens, None)
    picked, screened = decode_one(backend, embed, gain, head, tokens, bf16_screen(head))
    assert torch.equal(picked, plain) and torch.equal(screened.isnan(), exact.isnan())


@pytest.mark.parametrize("backend", RUNTIMES)
def test_an_exact_tie_picks_the_first_row(backend) -> None:
    need(backend)
    embed, gain, head, tokens = near_tie_head()
    x = normalized(embed[tokens[0]], gain)
    head[30] = head[200] = (x / x.norm() * 0.4).float()  # the same row twice, above every other logit of token 0
    picked, screened = decode_one(backend, embed, gain, head, tokens, bf16_screen(head))
    plain, _ = decode_one(backend, embed, gain, head, tokens, None)
    assert int(picked[0]) == 30 and torch.equal(picked, plain)
    assert screened[0, 30] == screened[0, 200]


@pytest.mark.parametrize("backend", RUNTIMES)
def test_logits_that_underflow_keep_their_tie(backend) -> None:
    """x = [2^-149, 0]: the exact logits of rows [2.5 + 2^-22, 0] and [2.75, 0] both round to 3 * 2^-149 (a tie:
    row 0 wins), their bf16 screens to 2 and 3 * 2^-149, a gap no relative bound covers: the bound's absolute term
    (K * SCREEN_UNDERFLOW) keeps row 0."""
    need(backend)
    toks, step = torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    pk = yr.PersistentKernel(max_seq_length=4, meta_tensors=[step, toks], backend=backend)
    embed = torch.ones(8, 2)
    head = torch.zeros(8, 2)
    head[0, 0], head[1, 0] = 2.5 + 2**-22, 2.75
    gain = torch.tensor([2.0**-149, 0.0])
    screen, bound = bf16_screen(head)
    x = pk.new_tensor((1, 2), name="x")
    pk.embed_layer(pk.tokens_tensor, pk.attach_input(embed, "embed"), x)
    norm, weight = pk.attach_input(gain, "norm"), pk.attach_input(head, "head")
    scores, logits = pk.new_tensor((1, 8), name="scores"), pk.new_tensor((1, 8), name="logits")
    pk.rmsnorm_linear_layer(x, norm, pk.attach_input(screen, "screen"), scores, eps=EPS)
    pk.screened_logits_layer(scores, x, norm, weight, pk.attach_input(bound, "bound"), logits, eps=EPS)
    pk.argmax_layer(logits, pk.new_tensor((1, 1), dtype=torch.int64, name="next"))
    pk.compile()
    assert pk(1) == 1
    got = pk.read("logits")[0]
    assert got[0] == got[1] == 3 * 2.0**-149 and scores_differ(pk) and int(toks[0, 1]) == 0


@pytest.mark.parametrize("backend", RUNTIMES)
def test_logits_that_overflow_are_computed_exactly(backend) -> None:
    """x = [b, b] with b just below 2^64 / 1.5: row 0, [a, -a] with a = (1.5 + 2^-9) * 2^64, overflows in float32
    (its exact logit is NaN or inf: picked), while its bf16 screen [1.5, -1.5] * 2^64 scores a finite 0, far
    below row 1's 1e38. Its bound reaches SCREEN_OVERFLOW, so every row is computed: the one-pass pick."""
    need(backend)
    b = 2.0**64 / (1.5 + 2**-10)
    a = (1.5 + 2**-9) * 2.0**64
    head = torch.zeros(8, 2)
    head[0] = torch.tensor([a, -a])
    head[1] = 1e38 / (2 * b)
    picks = []
    for screened in (False, True):
        toks, step = torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        pk = yr.PersistentKernel(max_seq_length=4, meta_tensors=[step, toks], backend=backend)
        x = pk.new_tensor((1, 2), name="x")
        pk.embed_layer(pk.tokens_tensor, pk.attach_input(torch.ones(8, 2), "embed"), x)
        norm, weight = pk.attach_input(torch.full((2,), b), "norm"), pk.attach_input(head, "head")
        logits = pk.new_tensor((1, 8), name="logits")
        if screened:
            screen, bound = bf16_screen(head)
            scores = pk.new_tensor((1, 8), name="scores")
            pk.rmsnorm_linear_layer(x, norm, pk.attach_input(screen, "screen"), scores, eps=0.0)
            pk.screened_logits_layer(scores, x, norm, weight, pk.attach_input(bound, "bound"), logits, eps=0.0)
        else:
            pk.rmsnorm_linear_layer(x, norm, weight, logits, eps=0.0)
        pk.argmax_layer(logits, pk.new_tensor((1, 1), dtype=torch.int64, name="next"))
        pk.compile()
        assert pk(1) == 1
        picks.append(int(toks[0, 1]))
        if screened:
            assert torch.isfinite(pk.read("scores")[0, :2]).all()  # the screen alone would have dropped row 0
    assert picks == [0, 0]


def scores_differ(pk) -> bool:
    scores = pk.read("scores")[0]
    return bool(scores[0] == 2 * 2.0**-149 and scores[1] == 3 * 2.0**-149)


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
    for x_scale in (1e-25, 1e-20, 1.0, 1e5):  # 1e-25: products of the 1e-30 and 1e-40 rows underflow
        x = torch.cat([x0[None], torch.randn(7, k, generator=g)]) * x_scale
        gap = ((x @ screen.float().t()).double() - (x @ w.t()).double()).abs()
        limit = bound.double()[None] * x.abs().double().sum(-1, keepdim=True) + k * SCREEN_UNDERFLOW
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


def test_a_decoder_built_by_hand_follows_its_head(zoo) -> None:
    """LlamaModel.build_decoder(screen=True) outside an engine: an in-place change of the head reaches the next run
    (the screen is remade before it: PersistentKernel.before_each_run), and after ``lm_head`` is replaced by another
    tensor the old decoder keeps the head it was given and computes every row exactly (its bounds NaN). The oracle
    is a one-pass decoder over the same tensors (the caches start from zeros: no prefill, the same for both)."""
    need("cpu")
    model = zoo("llama-gqa")
    lm = InferEngine(model.path, backend="cpu").model
    ids = model.reference.ids
    batch, prompt = ids.shape
    lm.reset_cache(batch, prompt + 8)
    tokens, step = torch.zeros(batch, prompt + 8, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64)

    def run(decoder):
        tokens.zero_()
        tokens[:, :prompt] = ids
        step.fill_(prompt - 1)
        decoder(6)
        return tokens[:, prompt:prompt + 6].clone()

    screened = lm.build_decoder(step, tokens, backend="cpu", eos_token_id=[], screen=True)
    plain = lm.build_decoder(step, tokens, backend="cpu", eos_token_id=[])
    assert "screened_logits" in [layer.kind for layer in screened.program.layers]
    before = run(plain)
    assert torch.equal(run(screened), before)
    lm.lm_head.mul_(-1.0)
    after = run(plain)
    assert not torch.equal(after, before) and torch.equal(run(screened), after)
    lm.lm_head = lm.lm_head.flip(0).contiguous()  # another tensor: the decoders built above keep theirs
    assert torch.equal(run(screened), after)
    assert torch.isnan(screened.program.values["lm_head_row_bound"]).all()


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

