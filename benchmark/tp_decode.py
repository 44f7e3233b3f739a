"""Tensor-parallel decode speed: ms/token of the fused PersistentKernel decode for tp = 1, 2, 3 ... on one machine,
and each rank's communication share (time inside collectives / decode time, measured on the rank).

    python benchmark/tp_decode.py --make-model /tmp/yr-w6kv6 --config w6-kv6      # random weights, once
    python benchmark/tp_decode.py --model-path /tmp/yr-w6kv6 --tp 1 2 3            # one torchrun per tp > 1

Configs (random weights in float32; speed, not answers):

- ``w6``: docs/benchmarks.md's W6 shape (SmolLM2-135M: hidden 576, 30 layers, 9 query / 3 KV heads of 64, ff 1536,
  vocab 49152). 3 KV heads: tp = 1 or 3 only.
- ``w6-kv6``: W6 with 12 query / 6 KV heads of 48 (the same hidden size and attention width; q/k/v a little
  larger), so that tp = 2 is possible (valid tp: 1, 2, 3, 6).

Each tp > 1 runs under ``python -m torch.distributed.run --nproc-per-node N`` (torchrun) with ranks on gloo; the
workers per rank default to the machine's cores / N. Do not run it beside other work: it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
W6 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152,
      "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
CONFIGS = {
    "w6": {**W6, "num_attention_heads": 9, "num_key_value_heads": 3},
    "w6-kv6": {**W6, "num_attention_heads": 12, "num_key_value_heads": 6},
}


def make_model(path: Path, name: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIGS[name])).eval().save_pretrained(
        path, safe_serialization=True)
    print(f"wrote a random {name} Llama to {path}", file=sys.stderr)


def worker(args: argparse.Namespace) -> None:
    """One rank (or the single process of tp=1): warm up, then time one generation; print this rank's figures."""
    import torch

    from yirage.engine import GenerationConfig, InferEngine

    tp = args.worker_tp
    engine = InferEngine(args.model_path, eager_start=False, backend="cpu", dtype=args.dtype, tp=tp if tp > 1 else None,
                         num_workers=args.num_workers)
    ids = torch.randint(0, engine.config.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    gen = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=())
    engine.generate(ids, GenerationConfig(max_new_tokens=4, eos_token_id=()))  # compile caches, decoder built
    res = engine.generate(ids, gen)
    decoder = next(iter(engine._decoders.values()))
    comm = getattr(decoder.runtime, "last_comm", None) if tp > 1 else None
    rank = engine.world.rank if engine.world is not None else 0
    share = comm["comm_s"] / comm["decode_s"] if comm and comm["decode_s"] else 0.0
    row = json.dumps({"tp": tp, "rank": rank, "ms_per_token": res.ms_per_token, "comm_share": share,
                            "collectives_per_token": comm["calls"] / max(1, res.timings["steps"]) if comm else 0,
                            "tokens": res.tokens[0, :8].tolist(), "workers": decoder.config.values()["num_workers"],
                      "rss_mb": _rss_mb()})
    (args.results / f"rank{rank}.json").write_text(row)  # a file per rank: torchrun interleaves their stdout


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def launch(args: argparse.Namespace, tp: int) -> list[dict[str, Any]]:
    results = Path(tempfile.mkdtemp(prefix="yirage-tp-bench-"))
    cmd = [sys.executable, __file__, "--worker-tp", str(tp), "--model-path", str(args.model_path),
           "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--results", str(results)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.num_workers:
        cmd += ["--num-workers", str(args.num_workers)]
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), *cmd[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(f.read_text()) for f in sorted(results.glob("rank*.json"))]
    shutil.rmtree(results, ignore_errors=True)
    if proc.returncode != 0 or len(rows) != tp:
        raise SystemExit(f"tp={tp} failed (exit {proc.returncode}, {len(rows)} of {tp} ranks reported, "
                         f"{time.monotonic() - start:.0f} s):\n{proc.stderr[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", type=Path)
    p.add_argument("--make-model", type=Path, metavar="DIR", help="write a random model of --config there and exit")
    p.add_argument("--config", choices=sorted(CONFIGS), default="w6-kv6")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "q8_0", "q4_0"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--num-workers", type=int, help="per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker-tp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.make_model:
        make_model(args.make_model, args.config)
        return 0
    if args.model_path is None:
        p.error("pass --model-path DIR (make one with --make-model DIR --config w6-kv6)")
    if args.worker_tp:
        worker(args)
        return 0
    base = None
    print(f"{'tp':>3} {'rank':>4} {'workers':>7} {'ms/token':>9} {'speed-up':>8} {'comm share':>10} "
          f"{'coll./token':>11} {'RSS MB':>7}")
    for tp in args.tp:
        rows = launch(args, tp)
        for r in rows:
            ms = r["ms_per_token"]
            base = ms if base is None and tp == 1 else base
            speed = f"{base / ms:.2f}x" if base and ms else "-"
            print(f"{tp:>3} {r['rank']:>4} {r['workers']:>7} {ms:>9.2f} {speed:>8} {100 * r['comm_share']:>9.1f}% "
                  f"{r['collectives_per_token']:>11.0f} {r['rss_mb']:>7.0f}", flush=True)
        if len({tuple(r["tokens"]) for r in rows}) != 1:
            print(f"tp={tp}: the ranks' tokens differ: {[r['tokens'] for r in rows]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
