"""LLM benchmark harness: TTFT, inter-token latency, prefill and decode tokens/s over a grid of shapes.

    python benchmark/llm_bench.py (--model-path DIR|FILE.gguf | --make-random-model [tiny|w4|w6])
        [--backend cpu] [--batch-size 1,2] [--input-len "[16,64]"] [--output-len 16] [--dtype f32]
        [--warmup 1] [--rounds 3] [--peers llamacpp,hf] [--output results.json|results.csv] [--prompt TEXT]

Each of ``--batch-size``, ``--input-len`` and ``--output-len`` takes ``4``, ``[1,2,4]`` or ``1,2,4``; the cases
are their Cartesian product, run smallest KV cache first (as InfiniLM's ``examples/bench.py``). Per case and
peer: warm-up runs (not timed; yirage compiles its decoder for the new shapes there), then ``--rounds`` timed
runs, the peers taking turns round by round; each figure is min / median / max over the rounds.

* TTFT: prompt forward + first token pick; ITL: decode time / decode steps (``output_len - 1`` steps, EOS
  ignored); prefill tok/s = batch x input_len / TTFT; decode tok/s = batch x steps / decode time; total: one
  whole run (yirage: the ``generate`` call).
* Peers (``--peers``): ``hf`` runs transformers' ``generate`` on the same weights, timed as llm_decode.py times it
  (``hf_peer.py``: a 1-token generate is TTFT); ``llamacpp`` runs ``llama-bench`` (``benchmark/llama_cpp_peer.py``
  builds it once, 5-10 minutes) on the same weights written as GGUF in ``--dtype``: TTFT is its ``-p input_len``
  time, ITL its ``-n output_len-1 -d input_len`` time; a batch runs ``llama-batched-bench -npl batch`` (built with
  it): TTFT its prefill of the batch's prompts, ITL its decode time per step of ``batch`` tokens.
  Ratios are peer median / yirage median (> 1: yirage faster).

Bad input (an unparsable list, a missing model, a KV cache larger than the free memory, ...) exits with status 2
and a message naming the cause and the fix. See docs/llm_bench.md.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # the benchmark scripts import each other as top-level modules

from llm_bench_cases import (  # noqa: E402 - needs the path above
    KV_BYTES,
    KV_DTYPE,
    Case,
    add_ratios,
    format_table,
    get_test_cases,
    hf_round,
    llama_round,
    parse_list,
    record,
    repeat_prompt,
    write_results,
    yirage_round,
)

DTYPES = ("f32", "bf16", "f16", "q8_0", "q4_0")  # as benchmark/llm_decode.py's --dtypes
TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
PEERS = {"llamacpp": "llama.cpp", "llama.cpp": "llama.cpp", "hf": "HF eager"}
LLAMA, HF = "llama.cpp", "HF eager"  # the peer names benchmark/llm_decode.py prints
RATIO_SUFFIX = {LLAMA: "llama_cpp", HF: "hf_eager"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)  # a seconds-long smoke model
SIZE_FLAGS = {"hidden_size": "--hidden-size", "intermediate_size": "--intermediate-size",
              "num_hidden_layers": "--layers", "num_attention_heads": "--heads",
              "num_key_value_heads": "--kv-heads", "vocab_size": "--vocab-size"}

def log(*args: Any) -> None:
    print("[llm_bench]", *args, file=sys.stderr, flush=True)


def parse_peers(text: str) -> list[str]:
    """``llamacpp,hf`` (or ``none``) as peer display names; an argparse ``type=``."""
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(unknown)} in {text!r}; choose from "
                                         "llamacpp, hf (comma-separated), or none")
    return list(dict.fromkeys(PEERS[n] for n in names))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm_bench.py", description=__doc__.splitlines()[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-path", help="a Hugging Face model directory or a .gguf file")
    model.add_argument("--make-random-model", nargs="?", const="w4", choices=("tiny", "w4", "w6"), metavar="PRESET",
                       help="a seeded random Llama in a temporary directory: tiny, w4 (default; the decode "
                            "benchmark's W4) or w6; the size flags below override the preset")
    for key, flag in SIZE_FLAGS.items():
        parser.add_argument(flag, type=int, dest=key, help=f"random model: {key}")
    parser.add_argument("--backend", default=None, help="yirage backend (default: the current one)")
    parser.add_argument("--batch-size", type=parse_list, default=[1], help="4, [1,2,4] or 1,2,4 (default 1)")
    parser.add_argument("--input-len", type=parse_list, default=[16], help="prompt tokens per sequence (default 16)")
    parser.add_argument("--output-len", type=parse_list, default=[32], help="tokens generated (default 32, >= 2)")
    parser.add_argument("--dtype", choices=DTYPES, default="f32", help="weight dtype (q8_0/q4_0: quantized on load)")
    parser.add_argument("--kv-dtype", choices=list(KV_BYTES), default=KV_DTYPE,
                        help="yirage's KV cache dtype (llama.cpp's is f16)")
    parser.add_argument("--prompt-dtype", choices=["bfloat16"], default=None,
                        help="round yirage's prompt activations to bf16 (bf16 weights; InferEngine(prompt_dtype=))")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per case and peer (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per case and peer (default 3)")
    parser.add_argument("--peers", type=parse_peers, default=[], help="llamacpp,hf, either one, or none (default)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (yirage's prefill, HF eager) and llama.cpp's (default: physical cores)")
    parser.add_argument("--prompt", default=None,
                        help="text repeated to each input length (default: seeded random token ids)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    parser.add_argument("--bandwidth", action="store_true", help="also measure read bandwidth (llm_decode's probe)")
    parser.add_argument("--output", type=Path, default=None, help="write the results to a .json or .csv file")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values before anything is loaded (parser.error: exit status 2)."""
    if any(o < 2 for o in args.output_len):
        parser.error(f"--output-len {args.output_len}: every value must be >= 2 (the first token comes from the "
                     "prefill; at least one decode step is needed to time decode)")
    for name in ("rounds", "warmup"):
        least = 1 if name == "rounds" else 0
        if getattr(args, name) < least:
            parser.error(f"--{name} {getattr(args, name)} must be >= {least}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be >= 1")
    if args.output is not None and args.output.suffix.lower() not in (".json", ".csv"):
        parser.error(f"--output {str(args.output)!r}: the file name must end in .json or .csv")
    if args.output is not None and not args.output.parent.is_dir():
        parser.error(f"--output {str(args.output)!r}: directory {str(args.output.parent)!r} does not exist; "
                     "create it first")
    problem = None if args.output is None else unwritable(args.output)
    if problem:
        parser.error(f"--output {str(args.output)!r} {problem}; pass a writable file path (checked before the "
                     "cases run, so no run is lost)")
    if args.model_path is not None:
        if not Path(args.model_path).expanduser().exists():
            parser.error(f"--model-path {args.model_path!r} does not exist; pass a Hugging Face model directory or "
                         "a .gguf file, or use --make-random-model")
        given = [flag for key, flag in SIZE_FLAGS.items() if getattr(args, key) is not None]
        if given:
            parser.error(f"{', '.join(given)} only size a --make-random-model model; drop them with --model-path")


def unwritable(path: Path) -> str | None:
    """Why the results cannot be written to ``path``, or None. Why a probe: permissions alone miss /proc, read-only
    mounts and root's rights, and the cases can run for hours before the file is written. A file the probe
    creates is removed again."""
    if path.is_dir():
        return "is a directory"
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"cannot be written ({type(exc).__name__}: {exc.strerror or exc})"
    if not existed:
        path.unlink(missing_ok=True)
    return None


def make_random_model(preset: str, overrides: dict[str, int | None], workdir: Path) -> Path:
    """A seeded random transformers Llama saved as safetensors, sized as llm_decode.py sizes its W4 / W6."""
    import torch
    import transformers

    if preset == "tiny":
        config = dict(TINY)
    else:
        from llm_decode import MODELS

        config = dict(MODELS[preset])
    config.update({k: v for k, v in overrides.items() if v is not None})
    if any(v < 1 for k, v in config.items() if k in SIZE_FLAGS):
        raise ValueError(f"random model sizes must be >= 1, got {config}")
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config.get(
        "num_key_value_heads", config["num_attention_heads"])
    if hidden % heads or (hidden // heads) % 2 or heads % kv_heads:
        raise ValueError(f"random model: --hidden-size {hidden} must be a multiple of --heads {heads} with an even "
                         f"head size (RoPE pairs), and --heads a multiple of --kv-heads {kv_heads}; e.g. "
                         "--hidden-size 64 --heads 4 --kv-heads 2")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.generation_config.eos_token_id = None
    path = workdir / f"random-{preset}"
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(model_path: Path, gguf: bool) -> Any:
    """The transformers model of ``model_path`` in float32 (a GGUF file dequantized, as yirage reads it)."""
    import torch
    import transformers

    if gguf:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                                  dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    return model.eval()


# -- the run -----------------------------------------------------------------------------------------------------

def load_engine(args: argparse.Namespace, model_path: Path) -> Any:
    """yirage's InferEngine on ``--backend`` with the weights in ``--dtype`` (q8_0 / q4_0: quantized on load)."""
    import torch

    from yirage.engine import InferEngine

    dtype = getattr(torch, TORCH_DTYPES[args.dtype]) if args.dtype in TORCH_DTYPES else args.dtype
    return InferEngine(model_path, eager_start=False, backend=args.backend, dtype=dtype, kv_cache_dtype=args.kv_dtype,
                       prompt_dtype=args.prompt_dtype)


def progress(cases: list[Case]) -> Iterator[Case]:
    """The cases under a tqdm bar on stderr, or one plain line per case without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        for i, case in enumerate(cases):
            log(f"[{i + 1}/{len(cases)}] {case.label}")
            yield case
        return
    with tqdm(cases, desc="llm_bench", unit="case", file=sys.stderr) as bar:
        for case in bar:
            bar.set_postfix_str(case.label)
            yield case


def prompt_ids(engine: Any, args: argparse.Namespace, cases: Iterable[Case]) -> list[int]:
    """The base prompt: the tokenized ``--prompt``, or seeded random ids as long as the longest input."""
    import torch

    if args.prompt is None:
        longest = max(c.input_len for c in cases)
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, engine.config.vocab, (longest,), generator=gen).tolist()
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("--prompt needs the model's tokenizer, but this model has none; drop --prompt to use "
                         "random token ids")
    ids = tokenizer(args.prompt)["input_ids"]
    if not ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens; pass some text")
    return ids


def preflight(engine: Any, cases: list[Case]) -> None:
    """Every case's KV cache fits the free memory and the model's attention span, before any case runs."""
    from yirage.models.config import ModelError

    window = engine.config.sliding_window
    for case in cases:
        max_len = case.input_len + case.output_len + 1  # as InferEngine.generate sizes its cache
        if window is not None and max_len > window:
            raise ModelError(f"case ({case.label}): {max_len} positions exceed the model's sliding window "
                             f"({window}); lower --input-len / --output-len")
        try:
            engine.model.check_cache_fits(case.batch_size, max_len)
        except ModelError as exc:
            raise ModelError(f"case ({case.label}) does not fit: {exc}; here: drop the values that make it too big "
                             "from --batch-size / --input-len / --output-len") from exc


def metadata(args: argparse.Namespace, engine: Any, model_name: str, model_format: str,
             threads: int) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    import yirage as yr
    from yirage import system

    host = system.host_facts()
    info = yr.get_backend_info(engine.backend.name)
    c = engine.config
    meta: dict[str, Any] = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": engine.backend.name, "backend_description": info.get("description"),
        "device": (info.get("device") or {}).get("name"), "model": model_name, "model_format": model_format,
        "model_config": {"layers": c.layers, "hidden": c.hidden, "intermediate": c.intermediate, "heads": c.heads,
                         "kv_heads": c.kv_heads, "head_dim": c.head_dim, "vocab": c.vocab},
        "dtype": args.dtype, "kv_dtype": args.kv_dtype, "prompt_dtype": args.prompt_dtype,
        "warmup": args.warmup, "rounds": args.rounds,
        "peers": args.peers, "peer_threads": threads, "prompt": args.prompt or f"random ids (seed {args.seed})",
        "yirage": yr.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    meta.update({k: host.get(k) for k in ("cpu_model", "physical_cores", "logical_cores", "ram_total", "os",
                                          "machine")})
    return meta


def setup_peers(args: argparse.Namespace, model_path: Path, gguf: bool, workdir: Path,
                threads: int) -> dict[str, Any]:
    """The peers' state: the HF model (cast to --dtype) and/or llama-bench with the GGUF file of the same weights.

    The GGUF file for llama.cpp is written in --dtype from the float32 weights yirage loads: a GGUF model's
    tensors dequantized by yirage's reader (as ``llama_cpp_peer.export_smollm2`` does), a directory's through
    transformers.
    """
    state: dict[str, Any] = {}
    if not args.peers:
        return state
    import torch

    hf = load_hf(model_path, gguf) if HF in args.peers or not gguf else None
    if LLAMA in args.peers:
        import llama_cpp_peer

        from yirage.models.gguf import read_gguf
        from yirage.models.gguf_export import export_gguf

        binary = llama_cpp_peer.llama_bench_path()  # builds it on first use (5-10 minutes)
        log(f"llama-bench: {binary}")
        config, weights = (read_gguf(model_path)[:2] if gguf else (hf.config, hf.state_dict()))
        path = workdir / f"weights-{args.dtype}.gguf"
        export_gguf(path, config, weights, args.dtype.upper(), tokenizer_from=model_path if gguf else None)
        state[LLAMA] = (binary, path)
    if HF in args.peers:
        from llm_decode import HF_DTYPES  # f16 eager on a CPU emulates it: not a peer

        if args.dtype in HF_DTYPES:
            state[HF] = hf if args.dtype == "f32" else hf.to(getattr(torch, TORCH_DTYPES[args.dtype]))
        else:
            state[f"{HF} skipped"] = (f"HF eager has no {args.dtype} CPU path comparable to yirage's (it would "
                                      f"emulate it); rerun with --dtype {' or '.join(HF_DTYPES)} to compare "
                                      "against HF eager")
    return state


def run_case(case: Case, engine: Any, peers: dict[str, Any], base: list[int], args: argparse.Namespace,
             threads: int, ours: str) -> list[dict[str, Any]]:
    import torch

    ids = torch.tensor([repeat_prompt(base, case.input_len)] * case.batch_size, dtype=torch.int64)
    runners = {ours: lambda: yirage_round(engine, ids, case.output_len)}
    rows = []
    if HF in peers:
        runners[HF] = lambda: hf_round(peers[HF], ids, case.output_len)
    elif f"{HF} skipped" in peers:
        rows.append(record(HF, case, skipped=peers[f"{HF} skipped"]))
    if LLAMA in peers:
        binary, gguf = peers[LLAMA]
        runners[LLAMA] = lambda: llama_round(binary, gguf, case.input_len, case.output_len, threads, case.batch_size)
    for name, run in runners.items():
        if name != LLAMA:  # llama-bench runs its own warm-up
            for _ in range(args.warmup):
                run()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(args.rounds):  # peers take turns round by round: drift hits them alike
        for name, run in runners.items():
            samples[name].append(run())
    timed = [record(name, case, rounds) for name, rounds in samples.items()]
    return timed + rows


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    from yirage import system
    from yirage.errors import YirageError
    from yirage.models.gguf import is_gguf_file

    threads = args.threads or system.host_facts()["physical_cores"] or 1
    import torch

    torch.set_num_threads(threads)  # yirage's prefill and HF eager run torch: the same threads for both
    with tempfile.TemporaryDirectory(prefix="yirage-llm-bench-") as tmp:
        workdir = Path(tmp)
        if args.make_random_model:
            try:
                model_path = make_random_model(args.make_random_model, {k: getattr(args, k) for k in SIZE_FLAGS},
                                               workdir)
            except ValueError as exc:
                parser.error(str(exc))
            model_name = f"random {args.make_random_model} (seed 0)"
        else:
            model_path = Path(args.model_path).expanduser()
            model_name = str(model_path)
        gguf = is_gguf_file(model_path)
        try:
            engine = load_engine(args, model_path)
            cases = get_test_cases(args.batch_size, args.input_len, args.output_len, kv_heads=engine.config.kv_heads,
                                   head_dim=engine.config.head_dim, layers=engine.config.layers,
                                   dtype_bytes=KV_BYTES[args.kv_dtype])
            preflight(engine, cases)
            base = prompt_ids(engine, args, cases)
        except (YirageError, ValueError) as exc:
            parser.error(f"{type(exc).__name__}: {exc}")
        log(f"{len(cases)} cases on {engine.backend.name}, smallest KV cache first: "
            + "; ".join(c.label for c in cases))
        meta = metadata(args, engine, model_name, "gguf" if gguf else "hf", threads)
        if args.bandwidth:
            from llm_decode import read_bandwidth

            meta["read_bandwidth_gb_s"] = read_bandwidth()
        try:
            peers = setup_peers(args, model_path, gguf, workdir, threads)
        except (YirageError, RuntimeError, OSError, ValueError) as exc:  # LlamaCppError is a RuntimeError
            parser.error(f"setting up the peers {args.peers}: {type(exc).__name__}: {exc}")
        ours = f"yirage {engine.backend.name}"
        rows = []
        for case in progress(cases):
            rows.extend(run_case(case, engine, peers, base, args, threads, ours))
    add_ratios(rows, ours, {p: RATIO_SUFFIX[p] for p in args.peers})
    document = {"schema": 1, "metadata": meta, "cases": [asdict(c) for c in cases], "results": rows}
    if args.output is not None:
        try:
            write_results(args.output, document)
        except OSError as exc:  # it was writable at the start; the disk filled or the path changed since
            print(format_table(document))
            parser.error(f"--output {str(args.output)!r}: writing the results failed ({type(exc).__name__}: {exc}); "
                         "the table above has them; pass a writable path")
        log(f"results written to {args.output}")
    print(f"{meta['model']} ({meta['model_format']}, {args.dtype}) on yirage {meta['backend']} ({meta['device']}); "
          f"{args.rounds} rounds after {args.warmup} warm-up; median [min-max]")
    print(format_table(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
