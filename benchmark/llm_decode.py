"""W4 of BENCHMARKS.md: small Llama decode, yirage PersistentKernel vs Hugging Face in one run.

Builds the W4 model from its config with random weights (no download),
saves it with safetensors, and measures decode ms/token at batch 1 after a
16-token prompt for: yirage (float32 and bfloat16 weights), HF eager
(DynamicCache) and HF + torch.compile (StaticCache). Prints the bandwidth
bound (weight bytes per token / measured DRAM read bandwidth), each
peer's share of it, ratios, a num_workers / num_local_schedulers sweep and
the per-layer time breakdown from the profiler.

    python benchmark/llm_decode.py [--tokens 64] [--skip-compile] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
import transformers

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine

W4 = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, vocab_size=32000,
          tie_word_embeddings=False)


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def dram_bandwidth() -> float:
    """GB/s of a STREAM-like read (torch sum over 256 MiB): the best of three buffers' medians.

    Read speed here depends on where a buffer lands in memory (seen: 23-30 GB/s
    for buffers allocated back to back), so one buffer can understate the bound.
    """
    best = 0.0
    for _ in range(3):
        x = torch.ones(64 * 2**20)
        x.sum()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - start)
        best = max(best, x.numel() * 4 / statistics.median(times) / 1e9)
    return best


def weight_bytes(engine: InferEngine) -> int:
    m = engine.model
    tensors = [m.embed[:1], m.norm, m.lm_head] + [t for blk in m.blocks for t in blk.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def yirage_ms(path: str, ids: torch.Tensor, tokens: int, dtype: Any, workers: int | None = None,
              schedulers: int | None = None, repeats: int = 3) -> tuple[float, list[int], InferEngine]:
    engine = InferEngine(path, backend="cpu", dtype=dtype, num_workers=workers, num_local_schedulers=schedulers)
    config = GenerationConfig(max_new_tokens=tokens, eos_token_id=())
    engine.generate(ids, GenerationConfig(max_new_tokens=4, eos_token_id=()))  # JIT / cache load
    runs = [engine.generate(ids, config) for _ in range(repeats)]
    return statistics.median(r.ms_per_token for r in runs), runs[0].tokens[0].tolist(), engine


def hf_ms(model: Any, ids: torch.Tensor, tokens: int, cache: str = "dynamic", repeats: int = 3) -> tuple[float, list]:
    """Decode ms/token: (time of N-token generate - time of 1-token generate) / (N - 1)."""
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation=None)
    if cache == "static":
        kwargs["cache_implementation"] = "static"

    def timed(n: int) -> tuple[float, Any]:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return time.perf_counter() - start, out

    timed(4)
    full = [timed(tokens) for _ in range(repeats)]
    one = [timed(1)[0] for _ in range(repeats)]
    ms = (statistics.median(t for t, _ in full) - statistics.median(one)) / (tokens - 1) * 1e3
    return ms, full[0][1][0, ids.shape[1]:].tolist()


def profile_breakdown(engine: InferEngine, ids: torch.Tensor) -> dict[str, float]:
    """Per-layer-kind share of one decode step's task time, from the profiler tensor."""
    engine.generate(ids, GenerationConfig(max_new_tokens=2, eos_token_id=()))
    pk = engine.model.build_decoder(engine._step, engine._tokens, backend="cpu",
                                    profiler_tensor=torch.zeros(3 * 4096, dtype=torch.int64))
    pk(1)
    prof = pk.profiler_tensor
    graph = pk.task_graph
    per_kind: dict[str, float] = defaultdict(float)
    for task in range(graph.num_tasks):
        kind = pk.layers[graph.task_layer[task]].kind
        per_kind[kind] += float(prof[3 * task + 1] - prof[3 * task]) / 1e3
    return dict(per_kind)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--skip-compile", action="store_true", help="skip HF + torch.compile (slow to compile)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(yr.get_backend_info("cpu")["device"]["compute_units"])
    config = transformers.LlamaConfig(**W4)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tempfile.mkdtemp(prefix="yirage-w4-")
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    bandwidth = dram_bandwidth()
    log(f"DRAM read bandwidth {bandwidth:.1f} GB/s")

    results: dict[str, Any] = {"config": W4, "batch": 1, "prompt_len": args.prompt_len, "tokens": args.tokens,
                               "dram_gb_s": bandwidth, "torch": torch.__version__, "peers": {}}
    ours32, tokens32, engine = yirage_ms(path, ids, args.tokens, None)
    ours16, tokens16, engine16 = yirage_ms(path, ids, args.tokens, torch.bfloat16)
    bytes32, bytes16 = weight_bytes(engine), weight_bytes(engine16)
    eager, hf_tokens = hf_ms(model, ids, args.tokens)
    static, _ = hf_ms(model, ids, args.tokens, "static")
    peers = {"yirage f32": (ours32, bytes32), "yirage bf16": (ours16, bytes16), "HF eager (dynamic cache)":
             (eager, bytes32), "HF eager (static cache)": (static, bytes32)}
    if not args.skip_compile:
        compiled = torch.compile(model.forward, dynamic=False)
        model.forward = compiled
        hf_compiled, _ = hf_ms(model, ids, args.tokens, "static")
        peers["HF + torch.compile (static cache)"] = (hf_compiled, bytes32)
    results["identical_to_hf"] = tokens32 == hf_tokens
    results["bf16_matches_f32_tokens"] = sum(a == b for a, b in zip(tokens16, tokens32, strict=True)) / len(tokens32)
    for name, (ms, nbytes) in peers.items():
        bound_ms = nbytes / bandwidth / 1e6
        results["peers"][name] = {"ms_per_token": ms, "tokens_per_s": 1e3 / ms, "bound_ms": bound_ms,
                                  "share_of_bound": bound_ms / ms}
    sweep = {}
    for workers, schedulers in ((1, 0), (2, 0), (1, 1), (2, 1), (4, 0)):
        ms, _, swept = yirage_ms(path, ids, args.tokens, None, workers, schedulers, repeats=2)
        decoder = next(iter(swept._decoders.values()))
        _, ran_w, ran_s = decoder.runtime.effective()
        sweep[f"asked {workers}+{schedulers}, ran {ran_w} workers + {ran_s} schedulers"] = 1e3 / ms
    results["sweep_tokens_per_s"] = sweep
    results["breakdown_us"] = profile_breakdown(engine, ids)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"W4 decode: Llama {W4}, batch 1, prompt {args.prompt_len}, {args.tokens} new tokens, torch "
          f"{torch.__version__}, DRAM {bandwidth:.1f} GB/s; weights {bytes32 / 2**20:.1f} MiB f32, "
          f"{bytes16 / 2**20:.1f} MiB bf16")
    print(f"{'peer':<36}{'ms/token':>10}{'tok/s':>9}{'bound ms':>10}{'share':>8}{'vs HF eager':>13}")
    for name, r in results["peers"].items():
        print(f"{name:<36}{r['ms_per_token']:>10.2f}{r['tokens_per_s']:>9.1f}{r['bound_ms']:>10.2f}"
              f"{r['share_of_bound']:>7.0%}{eager / r['ms_per_token']:>12.2f}x")
    print(f"greedy tokens identical to HF: {results['identical_to_hf']}; bf16 run agrees with f32 on "
          f"{results['bf16_matches_f32_tokens']:.0%} of tokens")
    print("num_workers / num_local_schedulers sweep (tokens/s):")
    for name, tps in sweep.items():
        print(f"  {name:<44}{tps:8.1f}")
    print("one decode step, task time per layer kind (µs, summed over tasks):")
    for kind, us in sorted(results["breakdown_us"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<34}{us:10.1f}")
    return 0 if results["identical_to_hf"] else 1


if __name__ == "__main__":
    sys.exit(main())
