"""A short PersistentKernel decode for compute-sanitizer (``make gpu-check`` runs it under memcheck and racecheck).

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sanitize_decode.py [--backend cuda]

A 2-layer random Llama (GQA, hidden 64) on the backend's device, 6 greedy steps, compared with the same decode on
the reference backend on the CPU. The runtime is whatever the backend's settings choose (for the cuda megakernel:
``YIRAGE_CUDA_PK_RUNTIME=megakernel``). Small on purpose: under a sanitizer every access is checked.
"""

from __future__ import annotations

import argparse
import sys


def decode(backend: str, steps: int) -> list[list[int]]:
    import torch

    from yirage.models.config import LlamaConfig
    from yirage.models.llama import LlamaModel
    from yirage.models.placement import Placement

    config = LlamaConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "vocab_size": 96})
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen) * 0.2 for n, s in config.weight_shapes().items()}
    from yirage.backend.selection import resolve

    placement = Placement.of_backend(resolve(backend, "--backend", need="persistent"))
    model = LlamaModel(config, weights, torch.float32, placement=placement)
    model.reset_cache(2, 16)
    device = model.device
    tokens = torch.zeros(2, 16, dtype=torch.int64, device=device)
    tokens[:, 0] = torch.tensor([3, 7])
    step = torch.zeros(2, dtype=torch.int64, device=device)
    decoder = model.build_decoder(step, tokens, backend=backend)
    decoder(steps)
    return tokens[:, :steps + 1].cpu().tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    got, want = decode(args.backend, args.steps), decode("reference", args.steps)
    print("tokens", got, "reference", want)
    if got != want:
        print("WRONG: the decode differs from the reference backend's")
        return 1
    print("decode ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
