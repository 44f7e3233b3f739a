"""Hugging Face transformers eager as a peer: how a user of ``model.generate`` decodes, timed the same way
by every benchmark (``llm_decode.py`` and ``llm_bench.py``)."""

from __future__ import annotations

import time
from typing import Any


def generate_seconds(model: Any, ids: Any, tokens: int) -> tuple[float, float]:
    """Seconds of a 1-token and of a ``tokens``-token greedy ``generate`` of the prompt ``ids`` (EOS off).

    The first is the time to the first token (the prompt's forward and one pick); the decode of the
    other ``tokens - 1`` tokens takes the difference.
    """
    import torch

    if tokens < 2:
        raise ValueError(f"tokens={tokens}: time at least 2 tokens (the first comes from the prompt's forward)")
    kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return time.perf_counter() - start

    return timed(1), timed(tokens)
