"""yirage generation demo: decode a Llama-family model with a PersistentKernel, beside Hugging Face eager.

Loads a Hugging Face model directory (config.json + *.safetensors), prefills a prompt, decodes
``--max-new-tokens`` tokens on a yirage backend and, unless ``--no-compare-hf``, runs transformers'
eager ``generate`` on the same weights (upcast to float32) for the same prompt, then prints both
tokens/s, their ratio and whether the greedy tokens are identical (a MISMATCH exits with status 1).

    python demo/generate.py --make-random-model /tmp/yr-w4 --config w4          # random weights, no download
    python demo/generate.py --model-path /tmp/yr-w4 --dtype bfloat16 --json      # one JSON object on stdout
    python demo/generate.py --model-path DIR --prompt "Once upon a time" --temperature 0.8 --top-p 0.9

Without a tokenizer in the model directory the prompt is ``--prompt-len`` random token ids (seed 0).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine

CONFIGS: dict[str, dict[str, Any]] = {
    "w4": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
           "vocab_size": 32000},
    "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 8000},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_TEXT = "Once upon a time,"


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def byte_tokenizer(vocab_size: int) -> Any:
    """A byte-level tokenizer built offline: ids 0-255 are the bytes, the rest decode as ``<|id|>`` placeholders."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}  # GPT-2's byte -> printable character map
    extra = iter(range(256, 512))
    vocab = {chr(b) if b in keep else chr(next(extra)): b for b in range(256)}
    vocab.update({f"<|{i}|>": i for i in range(256, vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def make_random_model(path: Path, name: str, overwrite: bool) -> None:
    import transformers

    if (path / "config.json").exists() and not overwrite:
        log(f"reusing the model in {path} (config.json exists; --overwrite rebuilds it)")
        return
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIGS[name], tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    if config.vocab_size >= 256:
        byte_tokenizer(config.vocab_size).save_pretrained(path)
        log(f"wrote a random {name!r} Llama and a byte-level tokenizer to {path}")
    else:
        log(f"wrote a random {name!r} Llama to {path} (no tokenizer: vocab < 256)")


def load_tokenizer(path: Path) -> Any:
    import transformers

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        log(f"no usable tokenizer in {path} ({type(exc).__name__}: {exc}); prompts are token ids")
        return None


def hf_generate(path: Path, dtype: torch.dtype | None, ids: torch.Tensor, gen: GenerationConfig) -> tuple[Any, Any]:
    """HF eager generate on the same weights in float32; returns (tokens, ms per decoded token or None).

    Timing: ``generate(max_new_tokens=n) - generate(max_new_tokens=1)`` (best of two 1-token runs)
    divided by n - 1, i.e. the decode steps alone with prefill and first-token pick removed, which is
    what yirage's ms_per_token measures (decode_s / steps).
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or "auto", attn_implementation="eager", local_files_only=True).float().eval()
    model.generation_config.eos_token_id = None  # never stop early: both sides decode the same number of tokens
    kwargs: dict[str, Any] = {"eos_token_id": None, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    if gen.temperature > 0:
        kwargs.update(do_sample=True, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)

    def run(n: int) -> tuple[Any, float]:
        torch.manual_seed(gen.seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return out[:, ids.shape[1]:], time.perf_counter() - start

    run(2)  # warm-up
    one = min(run(1)[1] for _ in range(2))
    tokens, total = run(gen.max_new_tokens)
    n = gen.max_new_tokens
    return tokens, ((total - one) / (n - 1) * 1e3 if n > 1 else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", type=Path)
    p.add_argument("--make-random-model", type=Path, metavar="DIR")
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="weights dtype in memory (default: as stored)")
    p.add_argument("--prompt", help=f"text, when the model has a tokenizer (default {DEFAULT_TEXT!r})")
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt ids, when there is no tokenizer")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int)
    p.add_argument("--num-local-schedulers", type=int)
    p.add_argument("--compare-hf", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, progress on stderr")
    args = p.parse_args(argv)
    if args.make_random_model is None and args.model_path is None:
        p.error("--model-path is required unless --make-random-model is given")
    if args.make_random_model and args.model_path and args.make_random_model != args.model_path:
        p.error("--make-random-model DIR is the model used: drop --model-path or make them equal")
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the report / the JSON object
        report, ok = run(args)
    if args.json:
        print(json.dumps(report), file=out)
    else:
        print_text(report, out)
    return 0 if ok else 1


def run(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    path: Path = args.make_random_model or args.model_path
    if args.make_random_model:
        make_random_model(path, args.config, args.overwrite)
    yr.set_backend(args.backend)
    backend = yr.get_backend().value
    dtype = DTYPES.get(args.dtype) if args.dtype else None
    engine = InferEngine(path, backend=backend, dtype=dtype, num_workers=args.num_workers,
                         num_local_schedulers=args.num_local_schedulers)
    cfg = engine.config
    tokenizer = load_tokenizer(path)
    if tokenizer is not None:
        ids = torch.tensor([tokenizer(args.prompt or DEFAULT_TEXT)["input_ids"]] * args.batch_size, dtype=torch.int64)
    else:
        if args.prompt:
            log(f"--prompt ignored: {path} has no tokenizer; using {args.prompt_len} random token ids")
        seeded = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab, (args.batch_size, args.prompt_len), generator=seeded)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, eos_token_id=(), seed=args.seed)  # no early stop: fixed token count
    log(f"backend {backend}; warm-up generation (JIT / compile caches)...")
    start = time.perf_counter()
    engine.generate(ids, dataclasses.replace(gen, max_new_tokens=min(4, gen.max_new_tokens)))
    warmup_s = time.perf_counter() - start
    log(f"warm-up {warmup_s:.2f} s; timed generation of {gen.max_new_tokens} tokens...")
    res = engine.generate(ids, gen)
    hf_ms = identical = None
    if args.compare_hf:
        log("Hugging Face eager generate on the same weights in float32...")
        hf_tokens, hf_ms = hf_generate(path, dtype, ids, gen)
        if gen.temperature == 0:
            identical = bool(torch.equal(hf_tokens[:, :res.tokens.shape[1]], res.tokens))
    hf_tps = args.batch_size / hf_ms * 1e3 if hf_ms else None
    decode = (lambda t: [tokenizer.decode(row) for row in t.tolist()]) if tokenizer is not None else None
    report = {
        "tokens": res.tokens.tolist(), "ttft_ms": res.ttft_ms, "ms_per_token": res.ms_per_token,
        "tokens_per_s": res.tokens_per_s, "backend": res.backend, "hf_tokens_per_s": hf_tps,
        "identical_to_hf": identical, "hf_ms_per_token": hf_ms,
        "timings": {"warmup_s": warmup_s, **res.timings},
        "config": {**dataclasses.asdict(cfg), "dtype": args.dtype or "as stored", "batch_size": args.batch_size,
                   "prompt_len": ids.shape[1], "max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature,
                   "top_k": gen.top_k, "top_p": gen.top_p, "seed": gen.seed, "tokenizer": tokenizer is not None},
        "prompt": decode(ids[:1])[0] if decode else ids[0].tolist(),
        "text": decode(res.tokens) if decode else None,
    }
    if identical is False:
        log(f"MISMATCH: yirage greedy tokens differ from Hugging Face's\n  yirage {res.tokens.tolist()}\n"
            f"  hf     {hf_tokens.tolist()}")
    return report, identical is not False


def print_text(r: dict[str, Any], out: Any) -> None:
    c, t = r["config"], r["timings"]
    lines = [
        f"backend      {r['backend']}",
        f"model        {c['model_type']}: hidden {c['hidden']}, intermediate {c['intermediate']}, "
        f"{c['layers']} layers, {c['heads']} heads ({c['kv_heads']} kv), vocab {c['vocab']}, weights {c['dtype']}",
        f"batch        {c['batch_size']} x prompt {c['prompt_len']} tokens, {c['max_new_tokens']} new tokens, "
        + ("greedy" if c["temperature"] == 0 else f"T={c['temperature']} top_k={c['top_k']} top_p={c['top_p']}"),
        f"prompt       {r['prompt']!r}" if c["tokenizer"] else f"prompt ids   {r['prompt']}",
    ]
    for i, row in enumerate(r["text"] or r["tokens"]):
        lines.append(f"output[{i}]    {row!r}" if r["text"] else f"output[{i}]    {row}")
        if r["text"]:
            lines.append(f"  token ids   {r['tokens'][i]}")
    ratio = r["tokens_per_s"] / r["hf_tokens_per_s"] if r["hf_tokens_per_s"] and r["tokens_per_s"] else None
    lines += [
        f"warm-up      {t['warmup_s']:.2f} s (first generate: JIT + compile); timed run compile {t['compile_s']:.3f} s",
        f"TTFT         {r['ttft_ms']:.1f} ms",
        (f"decode       {r['ms_per_token']:.2f} ms/token, {r['tokens_per_s']:.1f} tokens/s ({t['steps']} steps)"
         if r["ms_per_token"] else "decode       (one token: no decode step)"),
        "HF eager     " + (f"{r['hf_ms_per_token']:.2f} ms/token, {r['hf_tokens_per_s']:.1f} tokens/s, "
                           f"yirage/HF = {ratio:.2f}x" if ratio else "skipped (--no-compare-hf or < 2 new tokens)"),
    ]
    if r["identical_to_hf"] is not None:
        lines.append("greedy       " + ("identical to HF" if r["identical_to_hf"] else "MISMATCH with HF"))
    print("\n".join(lines), file=out)


if __name__ == "__main__":
    sys.exit(main())
