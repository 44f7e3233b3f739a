"""Cases, their timed runs per peer, statistics and result files of ``benchmark/llm_bench.py`` (the LLM harness).

Kept apart from the command line so these parts (list parsing, the Cartesian product sorted by KV-cache bytes,
one timed round per peer, min/median/max over rounds, JSON/CSV writing) load without torch or a backend (the
round functions import theirs when called), and so tests check them directly.
Names follow InfiniLM's ``examples/bench.py`` (``parse_list``, ``get_test_cases``, ``repeat_prompt``).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KV_DTYPE, KV_DTYPE_BYTES = "float32", 4  # yirage's KV caches by default (--kv-dtype: bfloat16 / float16, 2 bytes)
KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
METRICS = ("ttft_ms", "itl_ms", "prefill_tok_s", "decode_tok_s", "total_s")
STATS = ("min", "median", "max")
RATIOS = ("ttft_vs_llama_cpp", "itl_vs_llama_cpp", "ttft_vs_hf_eager", "itl_vs_hf_eager")
CSV_META = ("backend", "model", "model_format", "dtype", "yirage", "torch", "cpu_model", "physical_cores")


def parse_list(text: str) -> list[int]:
    """``"4"``, ``"[1,2,4]"`` or ``"1,2,4"`` as a list of positive ints (an argparse ``type=``)."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    parts = [p.strip() for p in body.split(",")]
    values = []
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a positive integer or a list of them ({part!r} is not an integer >= 1); "
                "write one value (4), a JSON list ([1,2,4]) or a comma-separated list (1,2,4)")
        values.append(int(part))
    return values


@dataclass(frozen=True)
class Case:
    """One run shape: ``batch_size`` prompts of ``input_len`` tokens, each generating ``output_len`` tokens."""

    batch_size: int
    input_len: int
    output_len: int
    kv_bytes: int  # 2 (K and V) x batch x (input + output) x kv_heads x head_dim x layers x KV dtype bytes

    @property
    def label(self) -> str:
        return f"batch {self.batch_size}, in {self.input_len}, out {self.output_len}"


def kv_cache_bytes(batch_size: int, seq_len: int, kv_heads: int, head_dim: int, layers: int,
                   dtype_bytes: int = KV_DTYPE_BYTES) -> int:
    """Bytes of keys and values for ``batch_size`` sequences of ``seq_len`` positions."""
    return 2 * batch_size * seq_len * kv_heads * head_dim * layers * dtype_bytes


def get_test_cases(batch_sizes: Iterable[int], input_lens: Iterable[int], output_lens: Iterable[int], *,
                   kv_heads: int, head_dim: int, layers: int, dtype_bytes: int = KV_DTYPE_BYTES) -> list[Case]:
    """The Cartesian product of the three lists, smallest KV cache first (ties: batch, input, output).

    Small first, as InfiniLM's bench does: a case that runs out of memory then cannot hide the results of the
    smaller ones. Duplicates in a list are dropped.
    """
    cases = {
        (b, i, o): Case(b, i, o, kv_cache_bytes(b, i + o, kv_heads, head_dim, layers, dtype_bytes))
        for b, i, o in itertools.product(batch_sizes, input_lens, output_lens)
    }
    return sorted(cases.values(), key=lambda c: (c.kv_bytes, c.batch_size, c.input_len, c.output_len))


def repeat_prompt(input_ids: Sequence[int], target_length: int) -> list[int]:
    """``input_ids`` repeated and cut to ``target_length`` tokens (a short prompt stretched to a case's length)."""
    if not input_ids:
        raise ValueError("repeat_prompt needs at least one token to repeat; pass a non-empty prompt")
    times = math.ceil(target_length / len(input_ids))
    return (list(input_ids) * times)[:target_length]


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """min / median / max of one metric over the timed rounds."""
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def round_metrics(batch: int, input_len: int, steps: int, ttft_s: float, decode_s: float,
                  total_s: float) -> dict[str, float]:
    """The per-round figures from three timings: first token, the ``steps`` decode steps after it, the whole run."""
    return {"ttft_ms": ttft_s * 1e3, "itl_ms": decode_s / steps * 1e3, "prefill_tok_s": batch * input_len / ttft_s,
            "decode_tok_s": batch * steps / decode_s, "total_s": total_s}


def record(peer: str, case: Case, rounds: Sequence[dict[str, float]] | None = None,
           skipped: str | None = None) -> dict[str, Any]:
    """One result row: a peer on a case, with min/median/max per metric, or the reason it did not run."""
    row: dict[str, Any] = {"peer": peer, "batch_size": case.batch_size, "input_len": case.input_len,
                           "output_len": case.output_len, "kv_bytes": case.kv_bytes,
                           "status": "skipped" if skipped else "ok", "reason": skipped,
                           "rounds": len(rounds or ())}
    for metric in METRICS:
        row[metric] = summarize([r[metric] for r in rounds]) if rounds else None
    return row


def add_ratios(rows: list[dict[str, Any]], ours: str, peers: dict[str, str]) -> None:
    """On each of ``ours``'s rows: peer median / our median of TTFT and inter-token latency (> 1: ours faster).

    ``peers`` maps a peer name to its ratio suffix (``llama_cpp``, ``hf_eager``); a peer that skipped a case
    leaves that case's ratios None.
    """
    by_case = {(r["peer"], r["batch_size"], r["input_len"], r["output_len"]): r for r in rows}
    for row in rows:
        if row["peer"] != ours:
            continue
        for peer, suffix in peers.items():
            other = by_case.get((peer, row["batch_size"], row["input_len"], row["output_len"]))
            for metric in ("ttft", "itl"):
                ok = other is not None and other["status"] == "ok" and row["status"] == "ok"
                row[f"{metric}_vs_{suffix}"] = (other[f"{metric}_ms"]["median"] / row[f"{metric}_ms"]["median"]
                                                if ok else None)


# -- one timed run of a case per peer ---------------------------------------------------------------------------

def yirage_round(engine: Any, ids: Any, output_len: int) -> dict[str, float]:
    """One ``InferEngine.generate`` of ``output_len`` tokens (EOS ignored), timed by the engine and around it."""
    from yirage.engine import GenerationConfig

    start = time.perf_counter()
    result = engine.generate(ids, GenerationConfig(max_new_tokens=output_len, eos_token_id=()))
    total = time.perf_counter() - start
    steps = result.timings["steps"]
    if steps != output_len - 1:
        raise RuntimeError(f"yirage decoded {steps} steps instead of {output_len - 1} although EOS was disabled; "
                           "this is a bug in the decode loop: report it with the case shape")
    return round_metrics(ids.shape[0], ids.shape[1], steps, result.ttft_ms / 1e3, result.timings["decode_s"], total)


def hf_round(model: Any, ids: Any, output_len: int) -> dict[str, float]:
    """transformers eager ``generate`` (the decode benchmark's peer run): TTFT and the rest from one generate
    (hf_peer.generate_seconds)."""
    import hf_peer

    first, total = hf_peer.generate_seconds(model, ids, output_len)
    return round_metrics(ids.shape[0], ids.shape[1], output_len - 1, first, total - first, total)


def llama_round(binary: Path, gguf: Path, input_len: int, output_len: int, threads: int, batch: int = 1
                ) -> dict[str, float]:
    """Batch 1: llama-bench's prompt time (TTFT) and its decode after ``input_len`` tokens (the decode
    benchmark's run). A batch: llama-batched-bench (``binary``'s sibling) prefilling ``batch`` prompts, then
    decoding them together, timed apart by itself."""
    import llama_cpp_peer

    steps = output_len - 1
    if batch > 1:
        run = llama_cpp_peer.bench_batched(gguf, batch, input_len, steps, threads,
                                           binary=binary.with_name("llama-batched-bench"))
        ttft, decode_s = run["pp_seconds"], run["tg_seconds"]
        return round_metrics(batch, input_len, steps, ttft, decode_s, ttft + decode_s)
    ttft = llama_cpp_peer.bench_prompt(gguf, input_len, threads, binary=binary)["seconds"]
    decode = llama_cpp_peer.bench_decode(gguf, tokens=steps, threads=threads, depth=input_len, binary=binary)
    decode_s = decode["ms_per_token"] * steps / 1e3
    return round_metrics(1, input_len, steps, ttft, decode_s, ttft + decode_s)  # llama-bench times them apart


def write_results(path: Path, document: dict[str, Any]) -> None:
    """``document`` as JSON (``.json``) or CSV (``.csv``: one row per case and peer, metadata in columns)."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        path.write_text(json.dumps(document, indent=1) + "\n")
        return
    if suffix != ".csv":
        raise ValueError(f"--output {str(path)!r}: the file name must end in .json or .csv")
    meta = document["metadata"]
    columns = [*CSV_META, "peer", "batch_size", "input_len", "output_len", "kv_bytes", "status", "reason", "rounds",
               *(f"{m}_{s}" for m in METRICS for s in STATS), *RATIOS]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for row in document["results"]:
            flat = {k: meta.get(k) for k in CSV_META}
            flat.update({k: v for k, v in row.items() if k not in METRICS})
            for metric in METRICS:
                for stat in STATS:
                    flat[f"{metric}_{stat}"] = row[metric][stat] if row[metric] else None
            writer.writerow(flat)


def format_table(document: dict[str, Any]) -> str:
    """The results as a text table: medians with [min - max], ratios against the peers, skipped peers' reasons."""
    head = (f"{'case':<20}{'peer':<12}{'TTFT ms':>26}{'ITL ms':>26}{'prefill tok/s':>15}{'decode tok/s':>14}"
            f"{'total s':>10}{'KV MiB':>10}  peer/yirage TTFT/ITL (> 1: yirage faster)")
    lines = [head]
    for row in document["results"]:
        label = f"b{row['batch_size']} in{row['input_len']} out{row['output_len']}"[:19]
        if row["status"] != "ok":
            lines.append(f"{label:<20}{row['peer']:<12}  skipped: {row['reason']}")
            continue
        ratios = "  ".join(
            f"{name} {_ratio(row.get(f'ttft_vs_{p}'))}/{_ratio(row.get(f'itl_vs_{p}'))}"
            for p, name in (("llama_cpp", "llama.cpp"), ("hf_eager", "HF")) if f"ttft_vs_{p}" in row)
        lines.append(f"{label:<20}{row['peer']:<12}{_span(row['ttft_ms'], '.2f'):>26}{_span(row['itl_ms'], '.3f'):>26}"
                     f"{row['prefill_tok_s']['median']:>15.0f}{row['decode_tok_s']['median']:>14.0f}"
                     f"{row['total_s']['median']:>10.3f}{row['kv_bytes'] / 2**20:>10.2f}  {ratios}")
    return "\n".join(lines)


def _span(stats: dict[str, float], fmt: str) -> str:
    return f"{stats['median']:{fmt}} [{stats['min']:{fmt}}-{stats['max']:{fmt}}]"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
