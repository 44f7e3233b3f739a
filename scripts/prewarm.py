"""Compile the cpu backend's decode and prompt kernels once, at set-up, so a first generate does not wait for numba.

    python scripts/prewarm.py [--dtypes float32 bfloat16 q8_0 q4_0]

The cpu PersistentKernel's numba functions are typed by dtypes and array ranks, not by shapes, and numba caches
them on disk: a 2-layer random model decoded once per weight format fills the cache a real model (SmolLM2, 30
layers) then hits. Measured on 2 cores: ``make demo``'s first generate went from 49.7 s (JIT + compile) to 0.57 s
after a float32 pre-warm. ``make setup`` runs it; it prints each format's seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

FORMATS = ("float32", "bfloat16", "q8_0", "q4_0")


def warm(dtype: str) -> float:
    import torch

    from yirage.backend.selection import resolve
    from yirage.models.config import LlamaConfig
    from yirage.models.llama import LlamaModel

    config = LlamaConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "vocab_size": 96})
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen) * 0.2 for n, s in config.weight_shapes().items()}
    model = LlamaModel(config, weights, dtype)
    if dtype == "bfloat16":  # and attention over 16-bit KV caches (InferEngine(kv_cache_dtype=...)), compiled apart
        model.kv_dtype = torch.bfloat16
    model.reset_cache(1, 16)
    tokens, step = torch.zeros(1, 16, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    start = time.perf_counter()
    resolve("cpu", "prewarm").prepare_decode(model.kv_dtype)  # the decode in a child from now, as InferEngine does
    model.build_decoder(step, tokens, backend="cpu")(4)
    if dtype == "float32":  # the sampling picker (GenerationConfig(do_sample=True)), compiled apart
        model.build_decoder(step, tokens, backend="cpu", sampling={"temperature": 0.8, "top_k": 8, "seed": 1})(1)
    # the prefill's projections (Backend.prompt_linear: one numba parallel region over W's parts)
    linear = resolve("cpu", "prewarm").prompt_linear()
    ids = torch.zeros(1, 4, dtype=torch.int64)
    model.forward(ids, torch.arange(4).expand(1, 4), last_only=True, linear=linear)
    if dtype == "bfloat16":  # InferEngine(prompt_dtype="bfloat16"): bf16 dot products where the CPU has them
        linear(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(FORMATS), choices=FORMATS)
    args = parser.parse_args(argv)
    os.environ["YIRAGE_EAGER_START"] = "0"  # compile here, every kernel, rather than run anything in torch meanwhile
    import yirage as yr

    if not yr.is_backend_available("cpu"):
        print("prewarm: the cpu backend is not available here; nothing to compile")
        return 0
    for dtype in args.dtypes:
        print(f"prewarm: cpu decode kernels for {dtype} weights ... {warm(dtype):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
