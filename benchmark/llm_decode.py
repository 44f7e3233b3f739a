"""Decode speed (W4 and W6 of docs/benchmarks.md): yirage vs llama.cpp vs Hugging Face eager, interleaved in one run.

    python benchmark/llm_decode.py [--models w4 w6 smollm2] [--dtypes f32 bf16 f16 q8_0 q4_0] [--rounds 3]
                                   [--tokens 64] [--busy N] [--no-llama-cpp] [--no-hf] [--one-pass-head] [--sweep]
                                   [--profile] [--json]

Every model is a transformers Llama: W4 and W6 (the 30-layer SmolLM2 shape) with seeded random weights,
``smollm2`` the real SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized to f32). The very same weights are
written as GGUF for llama.cpp (``benchmark/llama_cpp_peer.py`` builds ``llama-bench`` once, outside the repo) and
saved as safetensors for yirage; HF eager runs the transformers model itself. Batch 1, 16-token prompt,
``--tokens`` new tokens, 2 threads each (the machine's physical cores).

Peers take turns round by round (drift hits them alike); each figure is min / median / max ms per token over
``--rounds``. The bound is weight bytes read per token / the measured read bandwidth (the faster of a torch
sum and a numba prange sum over 256 MiB). The host's bandwidth drifted by 15-60% between runs minutes apart on a shared
machine, so the bandwidth is probed again right before every peer's run and once after the last: each run's
share of the bound uses the faster of the two probes around it, and ``share`` is the median of those shares.
Ratios compare medians within one model and dtype.
``--one-pass-head`` adds yirage with its greedy LM head read in one pass (``YIRAGE_SCREEN_HEAD=0``; the default
screens the rows with the head's bf16 copy first, yirage.models.head_screen), the same engine, in the same rounds.
``--busy N`` repeats every round with N competing CPU-bound processes running and reports each peer's
slowdown against its own quiet median. q8_0 / q4_0: yirage quantizes the float weights on load with ggml's
quantizers, so it and llama.cpp (its GGUF written by the gguf package) decode the same blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch
import transformers
from yirage_backend_cpu.kernel_lib import racc

import yirage as yr
from yirage.engine import GenerationConfig, InferEngine
from yirage.models.head_screen import SCREEN_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_peer  # noqa: E402 - benchmark/hf_peer.py, beside this script
import llama_cpp_peer as llama_cpp  # noqa: E402 - benchmark/llama_cpp_peer.py, beside this script
from timing import busy  # noqa: E402 - benchmark/timing.py, beside this script

MODELS: dict[str, dict[str, Any]] = {
    "w4": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, vocab_size=32000,
               tie_word_embeddings=False),
    "w6": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
               rope_theta=100000.0, max_position_embeddings=8192),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "q8_0": "q8_0", "q4_0": "q4_0"}
BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # GGUF block sizes
QUANT = ("q8_0", "q4_0")
HF_DTYPES = ("f32", "bf16")  # HF eager in f16 on a CPU is an fp16-emulation benchmark, not a peer
YIRAGE, LLAMA, HF = "yirage cpu", "llama.cpp", "HF eager"
KV_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # --kv-dtypes, as peer names spell them


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- bandwidth -------------------------------------------------------------------------------------------------

@numba.njit(parallel=True, cache=False)
def _prange_sum(x: np.ndarray, parts: int) -> float:
    """One sequential stream per thread (a chunk each), summed with a reassociable add (vectorized)."""
    chunk = x.shape[0] // parts
    sums = np.zeros(parts, np.float32)
    for p in numba.prange(parts):
        acc = np.float32(0)
        for i in range(np.uint64(p * chunk), np.uint64((p + 1) * chunk)):  # unsigned: no wraparound check
            acc = racc(acc, x[i])
        sums[p] = acc
    return sums.sum()


def read_bandwidth() -> dict[str, float]:
    """GB/s of streaming reads over 256 MiB: torch sum and a numba prange sum, each the best of 3 buffers' medians
    (where a buffer lands in memory moves it by 20-30%); ``best`` is the bound's denominator."""
    out: dict[str, float] = {"torch_sum": 0.0, "numba_prange_sum": 0.0}
    threads = max(1, torch.get_num_threads())
    for _ in range(3):
        x = torch.ones(64 * 2**20)
        arr = x.numpy()
        probes: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("torch_sum", x.sum), ("numba_prange_sum", lambda arr=arr: _prange_sum(arr, threads)))
        for name, fn in probes:
            fn()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out[name] = max(out[name], x.numel() * 4 / statistics.median(times) / 1e9)
    out["best"] = max(out.values())
    return out


_probe_buffer: list[torch.Tensor] = []


def probe_bandwidth() -> float:
    """GB/s of one quick streaming read probe (the faster of a torch sum and a numba prange sum over the same
    256 MiB, best of 3 each: ~0.1 s), taken between runs so each run's bound reflects the host's bandwidth then."""
    if not _probe_buffer:
        _probe_buffer.append(torch.ones(64 * 2**20))
    x = _probe_buffer[0]
    arr, threads = x.numpy(), max(1, torch.get_num_threads())
    best = 0.0
    for fn in (x.sum, lambda: _prange_sum(arr, threads)):
        fn()
        for _ in range(3):
            start = time.perf_counter()
            fn()
            best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def weight_bytes(config: Any, dtype: str) -> float:
    """Bytes of weights one decode token reads: every projection, one embedding row, the LM head (norms aside)."""
    h, inter, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter
    weights = layers * per_layer + vocab * h + h  # LM head (tied or not: read whole once) + one embedding row
    return weights * BYTES_PER_WEIGHT[dtype]


# -- models ----------------------------------------------------------------------------------------------------

@dataclass
class Model:
    name: str
    hf: Any  # the transformers model (float32)
    path: str  # its safetensors directory, for yirage
    ids: torch.Tensor  # the prompt (1, prompt_len)
    tokenizer_gguf: Path | None  # a GGUF file whose tokenizer metadata llama.cpp gets (None: synthetic vocab)
    gguf: dict[str, Path] = field(default_factory=dict)


def build_model(name: str, prompt_len: int, workdir: Path) -> Model:
    from yirage.models.downloads import DownloadError, smollm2_gguf

    try:
        smol: Path | None = smollm2_gguf(download=False)  # its tokenizer serves every 49152-token model
    except DownloadError as exc:
        if name == "smollm2":
            raise SystemExit(f"--models smollm2: {exc}") from exc
        smol = None
    if name == "smollm2":
        assert smol is not None
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(Path(smol).parent), gguf_file=Path(smol).name,
                                                                   torch_dtype=torch.float32)
        config = loaded.config
        config.__dict__.pop("quantization_config", None)  # transformers marks GGUF-loaded models unsaveable
        hf = transformers.LlamaForCausalLM(config)
        hf.load_state_dict(loaded.state_dict())
    else:
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODELS[name]))
    hf = hf.eval()
    hf.generation_config.eos_token_id = None
    path = workdir / name
    hf.save_pretrained(path, safe_serialization=True)
    ids = torch.randint(0, hf.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    same_vocab = smol is not None and hf.config.vocab_size == 49152
    return Model(name, hf, str(path), ids, smol if same_vocab else None)


def gguf_for(model: Model, dtype: str, workdir: Path) -> Path:
    from yirage.models.gguf_export import export_gguf

    if dtype not in model.gguf:
        path = workdir / f"{model.name}-{dtype}.gguf"
        export_gguf(path, model.hf.config, model.hf.state_dict(), dtype.upper(), tokenizer_from=model.tokenizer_gguf)
        model.gguf[dtype] = path
    return model.gguf[dtype]


# -- one measurement per peer ----------------------------------------------------------------------------------

def yirage_run(engine: InferEngine, ids: torch.Tensor, tokens: int) -> float:
    result = engine.generate(ids, GenerationConfig(max_new_tokens=tokens, eos_token_id=()))
    assert result.ms_per_token is not None
    return result.ms_per_token


@contextlib.contextmanager
def one_pass_head() -> Iterator[None]:
    """``YIRAGE_SCREEN_HEAD=0`` for the calls within: the engine builds (or reuses) its one-pass-head decoder."""
    saved = os.environ.get(SCREEN_ENV)
    os.environ[SCREEN_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[SCREEN_ENV]
        else:
            os.environ[SCREEN_ENV] = saved


def one_pass_run(engine: InferEngine, ids: torch.Tensor, tokens: int) -> float:
    with one_pass_head():
        return yirage_run(engine, ids, tokens)


def yirage_peer(kv_dtype: str) -> str:
    """yirage's peer name with KV caches of ``kv_dtype`` (float32: the plain name)."""
    return YIRAGE if kv_dtype == "float32" else f"{YIRAGE} kv {KV_SHORT[kv_dtype]}"


def hf_run(model: Any, ids: torch.Tensor, tokens: int) -> float:
    """Decode ms/token: (time of an N-token generate - time of a 1-token generate) / (N - 1)."""
    first, total = hf_peer.generate_seconds(model, ids, tokens)
    return (total - first) / (tokens - 1) * 1e3


def peers_for(model: Model, dtype: str, args: argparse.Namespace, workdir: Path) -> dict[str, Callable[[], float]]:
    peers: dict[str, Callable[[], float]] = {}
    for kv in args.kv_dtypes:
        engine = InferEngine(model.path, eager_start=False, backend="cpu", dtype=DTYPES[dtype],  # q8_0 / q4_0:
                             kv_cache_dtype=kv)  # quantized on load
        yirage_run(engine, model.ids, 4)  # JIT / cache load
        peers[yirage_peer(kv)] = lambda engine=engine: yirage_run(engine, model.ids, args.tokens)
        if args.one_pass_head:  # the same engine, its greedy LM head read in one pass (yirage.models.head_screen)
            with one_pass_head():
                yirage_run(engine, model.ids, 4)
            peers[f"{yirage_peer(kv)} 1-pass"] = lambda engine=engine: one_pass_run(engine, model.ids, args.tokens)
    if not args.no_llama_cpp:
        path = gguf_for(model, dtype, workdir)
        peers[LLAMA] = lambda: llama_cpp.bench_decode(path, tokens=args.tokens, threads=args.threads,
                                                      depth=args.prompt_len)["ms_per_token"]
    if not args.no_hf and dtype in HF_DTYPES:
        hf = model.hf if dtype == "f32" else _cast(model.hf, DTYPES[dtype])
        hf_run(hf, model.ids, 4)
        peers[HF] = lambda: hf_run(hf, model.ids, args.tokens)
    return peers


_casts: dict[tuple[int, Any], Any] = {}


def _cast(model: Any, dtype: Any) -> Any:
    key = (id(model), dtype)
    if key not in _casts:
        _casts[key] = copy.deepcopy(model).to(dtype)
    return _casts[key]


@dataclass
class Samples:
    """Each peer's ms/token per round, and the read bandwidth probed around each of its runs."""

    ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    gb_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # max(probe before, after)


def measure(peers: dict[str, Callable[[], float]], rounds: int,
            probe: Callable[[], float] = probe_bandwidth) -> Samples:
    """Each peer once per round, in turn, with a bandwidth probe between every two runs."""
    samples = Samples()
    before = probe()
    for r in range(rounds):
        for name, run in peers.items():
            ms = run()
            after = probe()
            samples.ms[name].append(ms)
            samples.gb_s[name].append(max(before, after))
            log(f"    round {r + 1}/{rounds} {name}: {ms:.2f} ms/token (read bandwidth around it: {before:.1f} "
                f"then {after:.1f} GB/s)")
            before = after
    return samples


def summarize(samples: Samples, weight_gb: float) -> dict[str, dict[str, float]]:
    """min / median / max ms per token, and the median share of the bound measured run by run (``weight_gb``:
    GB of weights one token reads)."""
    out = {}
    for name, ms in samples.ms.items():
        med = statistics.median(ms)
        bw = samples.gb_s[name]
        shares = [weight_gb / gb_s * 1e3 / t for gb_s, t in zip(bw, ms, strict=True)]
        out[name] = {"min": min(ms), "median": med, "max": max(ms), "tokens_per_s": 1e3 / med,
                     "share_of_bound": statistics.median(shares), "bandwidth_min": min(bw),
                     "bandwidth_max": max(bw)}
    for name, row in out.items():
        for peer, key in ((LLAMA, "vs_llama_cpp"), (HF, "vs_hf_eager")):
            if peer in out and peer != name:
                row[key] = out[peer]["median"] / row["median"]  # > 1: this peer is faster
    return out


def greedy_agreement(model: Model, tokens: int, dtype: str = "f32") -> float:
    """Share of the first ``tokens`` greedy tokens where yirage equals transformers in float32, up to the first
    difference counted as all different after it (a decode that diverges once continues from other text).

    q8_0 / q4_0: transformers runs on the weights quantized and dequantized by the gguf package (what yirage
    keeps as blocks), the issue's reference; other dtypes compare with the f32 weights."""
    ours = InferEngine(model.path, eager_start=False, backend="cpu",
                       dtype=DTYPES[dtype] if dtype in QUANT else None).generate(
        model.ids, GenerationConfig(max_new_tokens=tokens, eos_token_id=())).tokens[0].tolist()
    oracle = model.hf
    if dtype in QUANT:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        kind = GGMLQuantizationType[dtype.upper()]
        oracle = copy.deepcopy(model.hf)
        with torch.no_grad():
            for p in oracle.parameters():
                if p.dim() == 2:
                    p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), kind), kind)).view(p.shape))
    with torch.no_grad():
        theirs = oracle.generate(model.ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, model.ids.shape[1]:].tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))
    return same / len(ours)


def sweep(model: Model, tokens: int) -> dict[str, float]:
    """tokens/s of yirage f32 per (num_workers, num_local_schedulers) asked for, and per tasks_per_layer."""
    out = {}
    for workers, schedulers in ((1, 0), (2, 0), (1, 1), (2, 1), (4, 0)):
        engine = InferEngine(model.path, eager_start=False, backend="cpu", num_workers=workers,
                             num_local_schedulers=schedulers)
        yirage_run(engine, model.ids, 4)
        ms = statistics.median(yirage_run(engine, model.ids, tokens) for _ in range(2))
        _, ran_w, ran_s = next(iter(engine._decoders.values())).runtime.effective()
        out[f"asked {workers}+{schedulers}, ran {ran_w} workers + {ran_s} schedulers"] = 1e3 / ms
    for tasks in (2, 4, 8, 16):
        engine = InferEngine(model.path, eager_start=False, backend="cpu", tasks_per_layer=tasks)
        yirage_run(engine, model.ids, 4)
        ms = statistics.median(yirage_run(engine, model.ids, tokens) for _ in range(2))
        out[f"tasks_per_layer={tasks} (LM head {2 * tasks})"] = 1e3 / ms
    return out


def profile_breakdown(model: Model) -> dict[str, float]:
    """Per-layer-kind task time (µs, summed over tasks) of one f32 decode step, from the profiler tensor (the
    engine's greedy decoder: its LM head screened, yirage.models.head_screen)."""
    engine = InferEngine(model.path, eager_start=False, backend="cpu")
    engine.generate(model.ids, GenerationConfig(max_new_tokens=2, eos_token_id=()))
    pk = engine.model.build_decoder(engine._step, engine._tokens, backend="cpu", screen=True,
                                    profiler_tensor=torch.zeros(3 * 16384, dtype=torch.int64))
    pk(1)
    prof, graph = pk.profiler_tensor, pk.task_graph
    per_kind: dict[str, float] = defaultdict(float)
    for task in range(graph.num_tasks):
        per_kind[pk.layers[graph.task_layer[task]].kind] += float(prof[3 * task + 1] - prof[3 * task]) / 1e3
    return dict(per_kind)


# -- main ------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=[*MODELS, "smollm2"], default=["w4", "w6"])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["f32", "bf16", "f16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="threads per peer (default: physical cores)")
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="also run every round beside N CPU hogs")
    parser.add_argument("--kv-dtypes", nargs="+", choices=list(KV_SHORT), default=["float32"],
                        help="yirage's KV cache dtypes, one yirage peer each (llama.cpp's cache is f16)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (no build, no GGUF files)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF eager")
    parser.add_argument("--one-pass-head", action="store_true",
                        help="also time yirage with its greedy LM head read in one pass (YIRAGE_SCREEN_HEAD=0)")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep yirage's workers/schedulers and tasks per layer (f32)")
    parser.add_argument("--profile", action="store_true", help="also print yirage's per-layer-kind task time")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1:
        parser.error("--tokens must be >= 2 and --rounds >= 1")
    args.threads = args.threads or yr.get_backend_info("cpu")["device"]["compute_units"]
    torch.set_num_threads(args.threads)
    if not args.no_llama_cpp:
        log(f"llama-bench: {llama_cpp.llama_bench_path()}")
    bandwidth = read_bandwidth()
    log(f"read bandwidth (GB/s): {bandwidth}")
    results: dict[str, Any] = {"batch": 1, "prompt_len": args.prompt_len, "tokens": args.tokens,
                               "rounds": args.rounds, "threads": args.threads, "busy": args.busy,
                               "bandwidth_gb_s": bandwidth, "torch": torch.__version__, "yirage": yr.__version__,
                               "models": {}}
    workdir = Path(tempfile.mkdtemp(prefix="yirage-llm-decode-"))
    for name in args.models:
        model = build_model(name, args.prompt_len, workdir)
        entry: dict[str, Any] = {"config": {k: getattr(model.hf.config, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings")}, "dtypes": {}}
        for dtype in args.dtypes:
            log(f"{name} {dtype}:")
            peers = peers_for(model, dtype, args, workdir)
            weight_gb = weight_bytes(model.hf.config, dtype) / 1e9
            row: dict[str, Any] = {"bound_ms": weight_gb / bandwidth["best"] * 1e3, "weight_gb": weight_gb,
                                   "quiet": summarize(measure(peers, args.rounds), weight_gb)}
            if dtype == "f32":  # yirage's greedy head reads the head's bf16 copy (yirage.models.head_screen)
                row["screened_weight_gb"] = weight_gb - model.hf.config.vocab_size * model.hf.config.hidden_size * 2e-9
            if args.busy:
                with busy(args.busy):
                    row["busy"] = summarize(measure(peers, args.rounds), weight_gb)
                for peer, stats in row["busy"].items():
                    stats["slowdown"] = stats["median"] / row["quiet"][peer]["median"]
            entry["dtypes"][dtype] = row
        if not args.no_hf:
            entry["greedy_tokens_match_hf_f32"] = greedy_agreement(model, args.tokens)
            for dtype in (d for d in args.dtypes if d in QUANT):  # against transformers on the dequantized weights
                entry[f"greedy_tokens_match_hf_{dtype}"] = greedy_agreement(model, args.tokens, dtype)
        if args.sweep:
            entry["sweep_tokens_per_s"] = sweep(model, args.tokens)
        if args.profile:
            entry["breakdown_us"] = profile_breakdown(model)
        results["models"][name] = entry
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_report(results)
    return 0


def print_report(results: dict[str, Any]) -> None:
    bw = results["bandwidth_gb_s"]
    print(f"decode: batch 1, prompt {results['prompt_len']}, {results['tokens']} new tokens, {results['rounds']} "
          f"rounds, {results['threads']} threads each; read bandwidth {bw['best']:.1f} GB/s (torch sum "
          f"{bw['torch_sum']:.1f}, numba prange sum {bw['numba_prange_sum']:.1f}); torch {results['torch']}")
    print("ms/token min / median / max; share = median over runs of bound / ms, the bound from the bandwidth probed "
          "around each run (range in 'probe GB/s'); vs = peer median / this median (> 1: this faster)")
    for name, entry in results["models"].items():
        print(f"\n== {name}: {entry['config']} ==")
        head = (f"{'dtype':<6}{'peer':<19}{'min':>8}{'median':>8}{'max':>8}{'share':>7}{'probe GB/s':>12}"
                f"{'vs llama.cpp':>14}{'vs HF':>8}")
        busy = results["busy"]
        print(head + (f"{'busy med':>10}{'slowdown':>10}" if busy else ""))
        for dtype, row in entry["dtypes"].items():
            for peer, s in row["quiet"].items():
                probe = f"{s['bandwidth_min']:.1f}-{s['bandwidth_max']:.1f}"
                line = (f"{dtype:<6}{peer:<19}{s['min']:>8.2f}{s['median']:>8.2f}{s['max']:>8.2f}"
                        f"{s['share_of_bound']:>7.0%}{probe:>12}{_ratio(s.get('vs_llama_cpp')):>14}"
                        f"{_ratio(s.get('vs_hf_eager')):>8}")
                if busy:
                    b = row["busy"][peer]
                    line += f"{b['median']:>10.2f}{b['slowdown']:>9.2f}x"
                print(line)
            print(f"{'':<6}bound {row['bound_ms']:.2f} ms/token at the first probe's {bw['best']:.1f} GB/s "
                  f"({row['weight_gb'] * 1e3:.0f} MB of weights per token)")
            if "screened_weight_gb" in row:
                print(f"{'':<6}(yirage's screened greedy head reads the head's bf16 copy and a few float32 rows: "
                      f"{row['screened_weight_gb'] * 1e3:.0f} MB per token, so its share of this bound can pass "
                      "100%; '1-pass' reads the float32 head)")
        for key in (k for k in entry if k.startswith("greedy_tokens_match_hf_")):
            dtype = key.removeprefix("greedy_tokens_match_hf_")
            against = "on the same dequantized weights" if dtype in QUANT else "in f32"
            print(f"  greedy tokens ({dtype}) equal to transformers' ({against}) for the first "
                  f"{entry[key]:.0%} of the {results['tokens']}")
        for dtype, row in entry["dtypes"].items():
            if busy and YIRAGE in row.get("busy", {}):
                print("  " + busy_verdict(dtype, row, busy))
        for kind, us in sorted(entry.get("breakdown_us", {}).items(), key=lambda kv: -kv[1]):
            print(f"  profile {kind:<34}{us:10.1f} µs")
        for what, tps in entry.get("sweep_tokens_per_s", {}).items():
            print(f"  sweep {what:<46}{tps:8.1f} tok/s")


def busy_verdict(dtype: str, row: dict[str, Any], hogs: int) -> str:
    """Issue 11's goals beside N busy processes: at least HF eager's speed, and keeping at least 0.9x the share of
    its own quiet speed that llama.cpp keeps."""
    busy, quiet = row["busy"], row["quiet"]
    ours = quiet[YIRAGE]["median"] / busy[YIRAGE]["median"]  # share of the quiet speed kept
    parts = [f"{dtype} beside {hogs} busy: yirage keeps {ours:.0%} of its quiet speed"]
    if HF in busy:
        faster = busy[HF]["median"] / busy[YIRAGE]["median"]
        parts.append(f"{faster:.2f}x HF eager's busy speed ({'met' if faster >= 1 else 'NOT met'}: >= 1x)")
    if LLAMA in busy:
        theirs = quiet[LLAMA]["median"] / busy[LLAMA]["median"]
        verdict = "met" if ours >= 0.9 * theirs else "NOT met"
        parts.append(f"llama.cpp keeps {theirs:.0%} ({verdict}: >= 0.9x its share)")
    return "; ".join(parts)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
