"""Hugging Face transformers eager as a peer: how a user of ``model.generate`` decodes, timed the same way
by every benchmark (``llm_decode.py`` and ``llm_bench.py``)."""

from __future__ import annotations

import time
from typing import Any


def generate_seconds(model: Any, ids: Any, tokens: int) -> tuple[float, float]:
    """Seconds to the first token and to the last of one ``tokens``-token greedy ``generate`` of ``ids`` (EOS off).

    Both come from the same run: a streamer stamps the moment ``generate`` hands over the first new token (after
    the prompt's forward and one pick), so the decode of the other ``tokens - 1`` tokens (the difference) can
    never come out negative, as it could when a separate 1-token run was timed on a busy machine.
    """
    import torch

    if tokens < 2:
        raise ValueError(f"tokens={tokens}: time at least 2 tokens (the first comes from the prompt's forward)")
    stamps: list[float] = []

    class FirstToken:
        """transformers' streamer protocol: ``put`` gets the prompt first, then each new token."""

        def put(self, value: Any) -> None:
            stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                       pad_token_id=0, streamer=FirstToken())
    total = time.perf_counter() - start
    if len(stamps) < 2:
        raise RuntimeError(f"transformers' generate streamed {len(stamps)} value(s) for {tokens} tokens; expected "
                           "the prompt, then each new token")
    return stamps[1] - start, total
