"""A greedy LM head read in two passes: a bfloat16 copy screens the rows, the float32 matrix decides among the few left.

Why: a greedy decode step needs only the index of the largest logit, and the LM head is a large share of the bytes
a step streams: SmolLM2-135M's tied 49152 x 576 head is 113 MB of the 538 MB of a float32 step (21%). Its bf16 copy
is half that; the scores it gives are within a bound of the exact logits, so only the rows whose score can reach
the maximum (1-12 of 49152 on SmolLM2's answers) are computed again from the float32 matrix
(``PersistentKernel.screened_logits_layer``), and the token picked is the one the full float32 head picks, ties
and NaN included. Sampling and ``output_logits`` need every logit and keep the one-pass head.

The bound, for one row ``i`` of W (K columns) and the normalized hidden row x (float32, ``S = sum |x_j|``):

* rounding to bf16 (8 significant bits, to nearest) moves each weight by at most ``2^-8 * max(|W_ij|, 2^-126)``
  (below 2^-126 bf16's spacing is 2^-133);
* a K-term dot product in float32, in any order, fused or not, is within ``gamma_K * sum |a_j b_j|`` of the real
  one, ``gamma_K = K u / (1 - K u)``, ``u = 2^-24``; the screen's dot and the exact one each add that;

so ``|screen_i - exact_i| <= (2^-8 + gamma_K * (2 + 2^-8)) * max(M_i, 2^-126) * S`` with ``M_i = max_j |W_ij|``,
as long as nothing underflows or overflows. ``row_bound[i]`` is that factor times ``max(M_i, 2^-126)`` (0 for an
all-zero row), widened by 2^-10 for the float64 products and sums the runtime compares in, and rounded up to
float32. The runtimes add ``K * 2^-148`` for products and sums that underflow (each off by up to 2^-150), and
compute every row exactly where a bound reaches 2^118, where a dot product could overflow
(``yirage.persistent.specs.SCREEN_UNDERFLOW`` / ``SCREEN_OVERFLOW``). A matrix with a value that is not finite, or
one that overflows bf16, gets no screen (the one-pass head runs).
"""

from __future__ import annotations

import os
from typing import Any

#: ``YIRAGE_SCREEN_HEAD=0``: every greedy decode reads the LM head in one pass (for comparisons)
SCREEN_ENV = "YIRAGE_SCREEN_HEAD"
BF16_UNIT = 2.0**-8  # bf16's rounding error bound, relative: 8 significant bits, to nearest
F32_UNIT = 2.0**-24
SMALLEST_NORMAL = 2.0**-126
SAFETY = 1 + 2.0**-10  # for the float64 products and sums of the comparison, and the float32 rounding of the bound


def screen_enabled() -> bool:
    """Whether greedy decodes may screen the LM head (``YIRAGE_SCREEN_HEAD`` is not "0")."""
    return os.environ.get(SCREEN_ENV, "1").strip() != "0"


def bound_factor(k: int) -> float:
    """The bound per unit of ``max(M_i, 2^-126) * S`` for a K-column head (see the module docstring)."""
    if k * F32_UNIT >= 0.5:
        raise ValueError(f"a {k}-column head is too wide for the float32 error bound; read it in one pass")
    gamma = k * F32_UNIT / (1 - k * F32_UNIT)
    return (BF16_UNIT + gamma * (2 + BF16_UNIT)) * SAFETY


def bf16_screen(weight: Any) -> tuple[Any, Any] | None:
    """``(screen, row_bound)`` for a float32 LM head ``weight`` (vocab, K): its bf16 copy and per-row bound factors
    (float32, on the weight's device), or None where it gets no screen: not float32, too wide for the bound, a
    value that is not finite, or one that overflows bf16."""
    import torch

    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    k = weight.shape[1]
    if k * F32_UNIT >= 0.5:
        return None
    largest = torch.linalg.vector_norm(weight, ord=torch.inf, dim=1)  # max |W_ij| per row, NaN where a NaN is
    if not bool(torch.isfinite(largest).all()) or float(largest.max()) > torch.finfo(torch.bfloat16).max:
        return None  # a value that is not finite, or one that rounds to inf in bf16
    screen = weight.to(torch.bfloat16)
    largest = largest.to(torch.float64)
    bound = torch.where(largest > 0, largest.clamp_min(SMALLEST_NORMAL) * bound_factor(k), torch.zeros_like(largest))
    rounded = bound.to(torch.float32)
    up = torch.nextafter(rounded, torch.full_like(rounded, torch.inf))
    rounded = torch.where(rounded.to(torch.float64) < bound, up, rounded)
    return screen.contiguous(), rounded.contiguous()
