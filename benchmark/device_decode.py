"""Decode of a SmolLM2-shaped random model on each given backend, beside Hugging Face eager on the same device.

    python benchmark/device_decode.py --backends cuda triton [--dtypes float32 bfloat16] [--json out.json]
    python benchmark/device_decode.py --backends cuda:YIRAGE_CUDA_PK_RUNTIME=megakernel   # a runtime variant
    python benchmark/device_decode.py --backends cpu --small          # a smoke run of the same code on the CPU
    python benchmark/device_decode.py --shape llama1b --dtypes bfloat16 --backends cuda triton   # Llama-3.2-1B's
    python benchmark/device_decode.py --backends cuda --dtypes bfloat16 --sample   # seeded sampling's cost

The model has SmolLM2-135M's shape (30 layers, hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, vocab
49152, tied embeddings) and random weights initialised so its greedy output is diverse (tests/llm_oracle.py's
``diverse_init``): equal greedy tokens then mean something. One 16-token prompt, 64 new tokens, EOS off.

Per backend and dtype it prints yirage's ms/token (decode steps only: generate's own ``ms_per_token``), Hugging
Face eager's ms/token on the same device and weights (``model.generate``, the 64-token run minus the 1-token
run), their ratio (HF / yirage: > 1 means yirage is faster), and whether the greedy tokens equal the oracle's:
transformers in float32 on the same (rounded) weights, which is what yirage computes (narrow weights widened to
float32). Where the tokens differ, the oracle's top-2 logit margin at the first differing step says whether it
was a near-tie (``tie``: margin below 1e-3 of that step's logit range) or a wrong result (``WRONG``).
``--shape llama1b`` is Llama-3.2-1B's shape (16 layers, hidden 2048, intermediate 8192, 32 / 8 heads of 64, vocab
128256, tied embeddings). Each row also gives the bandwidth bound: the bytes a decode step must read (every weight
once, the tied table as the LM head; the KV cache is small at this length) over the device's read bandwidth,
measured in this run by a ``sum`` over a 1 GiB tensor, and yirage's share of it (bound / ms per token).
Every figure is measured in this run; nothing is compared with a number from elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # llm_oracle: the test models' init
sys.path.insert(0, str(Path(__file__).resolve().parent))  # profiling, when run from elsewhere
from profiling import file_label, profile_table  # noqa: E402 - after the path

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 8192}
SMALL = {**SMOLLM2, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512}
LLAMA1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 8192}
SHAPES = {"smollm2": SMOLLM2, "llama1b": LLAMA1B, "small": SMALL}
PROBE_BYTES = 1 << 30  # the bandwidth probe's tensor on a GPU (a CPU smoke run reads 64 MiB)
PROMPT, NEW_TOKENS = 16, 64
TIE = 1e-3  # a top-2 margin below this fraction of the logit range is a near-tie, not a wrong token


def sync(device: Any) -> None:
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def make_model(shape: dict[str, Any], dtype: Any, root: Path) -> tuple[Path, Any]:
    """A saved random Llama model of ``shape`` in ``dtype`` and its float32 oracle on the same rounded weights."""
    import torch
    import transformers
    from llm_oracle import diverse_init

    torch.manual_seed(0)
    oracle = diverse_init(transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval())
    oracle.generation_config.eos_token_id = None
    path = root / f"model-{str(dtype).removeprefix('torch.')}"
    saved = oracle if dtype == torch.float32 else transformers.LlamaForCausalLM(oracle.config).to(dtype)
    if dtype != torch.float32:
        saved.load_state_dict({k: v.to(dtype) for k, v in oracle.state_dict().items()})
        with torch.no_grad():  # the oracle computes in float32 on the rounded weights, as yirage does
            for p in oracle.parameters():
                p.copy_(p.to(dtype).float())
    saved.save_pretrained(path, safe_serialization=True)
    return path, oracle


def read_bandwidth(device: Any, rounds: int = 7) -> float:
    """Bytes per second a ``sum`` reads on ``device`` (median of ``rounds`` after a warm-up): the decode's bound."""
    import torch

    size = PROBE_BYTES if device.type != "cpu" else 64 << 20
    data = torch.ones(size // 4, dtype=torch.float32, device=device)
    times = []
    for i in range(rounds + 1):
        sync(device)
        start = time.perf_counter()
        data.sum()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    del data
    return size / statistics.median(times)


def step_bytes(oracle: Any, dtype: Any) -> int:
    """Bytes of every weight in ``dtype`` (shared tensors once: a tied table is read as the LM head)."""
    import torch

    unique = {p.data_ptr(): p.numel() for p in oracle.parameters()}
    return sum(unique.values()) * torch.empty((), dtype=dtype).element_size()


def oracle_tokens(oracle: Any, ids: Any, device: Any) -> tuple[list[list[int]], Any]:
    """The float32 oracle's greedy tokens and per-step logits, computed on ``device``."""
    import torch

    model = oracle.to(device)
    with torch.no_grad():
        out = model.generate(ids.to(device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[:, ids.shape[1]:].cpu().tolist()
    logits = torch.stack(out.logits, 1).float().cpu()
    oracle.to("cpu")
    return tokens, logits


def hf_ms_per_token(oracle: Any, dtype: Any, ids: Any, device: Any, rounds: int, sample: bool = False) -> float:
    """HF eager decode ms/token in ``dtype`` on ``device``: (64-token generate - 1-token generate) / 63 (greedy,
    or sampling with ``SAMPLING``)."""
    import copy

    import torch

    model = copy.deepcopy(oracle).to(device=device, dtype=dtype)
    ids = ids.to(device)
    kwargs = {"do_sample": sample, "eos_token_id": None, "pad_token_id": 0, **(SAMPLING if sample else {})}

    def timed(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync(device)
        return time.perf_counter() - start

    timed(2)  # warm-up: cuBLAS handles, kernels loaded
    return statistics.median((timed(NEW_TOKENS) - timed(1)) / (NEW_TOKENS - 1) * 1e3 for _ in range(rounds))


def verdict(ours: list[list[int]], theirs: list[list[int]], logits: Any) -> str:
    """"equal", "tie at step s" (a near-tie in the oracle's logits where they first differ) or "WRONG at step s"."""
    if ours == theirs:
        return "equal"
    for row, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                top = logits[row, step].double().topk(2).values
                spread = float(logits[row, step].max() - logits[row, step].min())
                margin = float(top[0] - top[1])
                return f"{'tie' if margin <= TIE * spread else 'WRONG'} at step {step} (margin {margin:.3g})"
    return "WRONG (lengths)"


#: ``--sample``'s decode: seeded, so every run draws the same tokens (HF's peer samples with the same settings)
SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}


def yirage_run(path: Path, backend: str, ids: Any, rounds: int, profile: Path | None = None,
               sample: bool = False) -> dict[str, Any]:
    """yirage's tokens (greedy, or seeded ``SAMPLING``) and median decode ms/token on ``backend`` (the first
    generate compiles: untimed)."""
    from yirage.engine import GenerationConfig, InferEngine

    engine = InferEngine(path, eager_start=False, backend=backend)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=(), **(SAMPLING | {"seed": 1} if sample else {}))
    start = time.perf_counter()
    first = engine.generate(ids, config)
    warm = time.perf_counter() - start
    runs = [engine.generate(ids, config) for _ in range(rounds)]
    if any(r.tokens.tolist() != first.tokens.tolist() for r in runs):
        return {"error": f"{'seeded' if sample else 'greedy'} tokens changed between runs of the same prompt"}
    if profile is not None:
        profile_table(lambda: engine.generate(ids, config), profile, engine.model.device.type,
                      f"one generate of {NEW_TOKENS} tokens on {backend}")
    return {"tokens": first.tokens.tolist(), "ms_per_token": statistics.median(r.ms_per_token for r in runs),
            "ttft_ms": statistics.median(r.ttft_ms for r in runs), "first_generate_s": warm,
            "device": str(engine.model.device)}


def variant(spec: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``cuda:YIRAGE_CUDA_PK_RUNTIME=megakernel,YIRAGE_CUDA_GRID_SYNC=tree`` -> the backend and the environment
    settings its run needs."""
    name, _, settings = spec.partition(":")
    pairs = []
    for setting in filter(None, settings.split(",")):
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise SystemExit(f"--backends {spec!r}: write a variant as BACKEND:VARIABLE=VALUE[,VARIABLE=VALUE...]")
        pairs.append((key, value))
    return name, tuple(pairs)


@contextlib.contextmanager
def environment(settings: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """``settings`` in os.environ for the block (the runtime reads them when the engine builds its decoder)."""
    before = {key: os.environ.get(key) for key, _ in settings}
    os.environ.update(dict(settings))
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main(argv: list[str] | None = None) -> int:
    import torch

    import yirage as yr
    from yirage.backend.selection import resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", required=True,
                        help="yirage backends to decode on; BACKEND:VARIABLE=VALUE[,VARIABLE=VALUE] runs one with "
                             "environment settings (cuda:YIRAGE_CUDA_PK_RUNTIME=megakernel,YIRAGE_CUDA_GRID_SYNC=tree)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3, help="timed generates per implementation (median)")
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2", help="the random model's shape")
    parser.add_argument("--small", action="store_true", help="--shape small: a 2-layer model (smoke)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--sample", action="store_true",
                        help="decode by seeded sampling (temperature 0.8, top-k 50, top-p 0.9) instead of greedily, "
                             "HF eager sampling the same way: the sampler's cost")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also profile one generate per row (torch.profiler) into DIR/<backend>-<dtype>.txt")
    args = parser.parse_args(argv)
    shape_name = "small" if args.small else args.shape
    shape = SHAPES[shape_name]
    bandwidth: dict[str, float] = {}  # device -> bytes/s, probed once per device
    ids = torch.randint(0, shape["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(2))
    rows: list[dict[str, Any]] = []
    oracles: dict[tuple[str, str], Any] = {}
    hf: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="yirage-device-decode-") as tmp:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            path, oracle = make_model(shape, dtype, Path(tmp))
            for spec in args.backends:
                if args.json:  # the rows so far: a backend that hangs (killed by a caller's timeout) keeps them
                    args.json.write_text(json.dumps(rows, indent=1) + "\n")
                name, setting = variant(spec)
                row: dict[str, Any] = {"backend": spec, "dtype": dtype_name}
                rows.append(row)
                try:
                    device = torch.device(resolve(name, "--backends", need="persistent").torch_device)
                except yr.YirageError as exc:  # unavailable here, or no PersistentKernel runtime: reported
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    continue
                if str(device) not in bandwidth:
                    bandwidth[str(device)] = read_bandwidth(device)
                row["read_gb_s"] = bandwidth[str(device)] / 1e9
                row["bound_ms"] = step_bytes(oracle, dtype) / bandwidth[str(device)] * 1e3
                key = (str(device), dtype_name)  # one oracle and one HF timing per device and dtype, shared by rows
                if key not in oracles:
                    oracles[key] = oracle_tokens(oracle, ids, device)
                theirs, logits = oracles[key]
                try:
                    with environment(setting):
                        where = args.profile and args.profile / f"{file_label(spec)}-{dtype_name}.txt"
                        row.update(yirage_run(path, name, ids, args.rounds, where, args.sample))
                except Exception as exc:  # noqa: BLE001 - one failing backend must not hide the others' rows
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    continue
                if "tokens" in row:
                    tokens = row.pop("tokens")
                    row["tokens_vs_oracle"] = "sampled (seeded: equal on every run)" if args.sample else verdict(
                        tokens, theirs, logits)
                if key not in hf:
                    hf[key] = hf_ms_per_token(oracle, dtype, ids, device, args.rounds, args.sample)
                row["hf_ms_per_token"] = hf[key]
                if row.get("ms_per_token"):
                    row["hf_over_yirage"] = row["hf_ms_per_token"] / row["ms_per_token"]
                    row["share_of_bound"] = row["bound_ms"] / row["ms_per_token"]
    print(f"{'sampled' if args.sample else 'greedy'} decode of a {shape_name}-shaped random model, {PROMPT}-token "
          f"prompt, {NEW_TOKENS} new tokens (ms/token: "
          f"median of {args.rounds}; bound: weight bytes / the read bandwidth a sum measured here)")
    width = max(10, *(len(r["backend"]) for r in rows))
    print(f"{'backend':{width}} {'dtype':9} {'yirage':>9} {'HF eager':>9} {'HF/yirage':>9} {'bound':>8} {'share':>6} "
          f"{'GB/s':>6}  tokens vs float32 oracle")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:{width}} {r['dtype']:9} ERROR {r['error'][:200]}")
            continue
        print(f"{r['backend']:{width}} {r['dtype']:9} {r['ms_per_token']:9.3f} {r['hf_ms_per_token']:9.3f} "
              f"{r['hf_over_yirage']:8.2f}x {r['bound_ms']:8.3f} {r['share_of_bound']:6.0%} {r['read_gb_s']:6.0f}  "
              f"{r['tokens_vs_oracle']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    wrong = [r for r in rows if "error" in r
             or not str(r.get("tokens_vs_oracle", "")).startswith(("equal", "tie", "sampled"))]
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
