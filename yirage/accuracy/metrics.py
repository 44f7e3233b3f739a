"""Accuracy metrics between one tensor and its golden counterpart, in float64.

Definitions (``a`` = my tensor, ``b`` = golden, both flattened and widened to float64):

* cosine_similarity = a.b / (|a| |b|); 1 when both are all zero, 0 when only one is;
* absolute error |a - b| (max, mean); relative error |a - b| / max(|b|, 1e-12) (max, mean);
* kl_divergence = KL(softmax(b) || softmax(a)) over the last dimension, averaged over the rows
  (logits are compared as the distributions they stand for);
* relative_euclidean_distance = |a - b|_2 / |b|_2 (0 when both are zero, inf when only b is).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

REL_FLOOR = 1e-12  # the smallest |golden| a relative error divides by
METRICS = ("cosine_similarity", "max_relative_error", "mean_relative_error", "max_absolute_error",
           "mean_absolute_error", "kl_divergence", "relative_euclidean_distance")


def summary(x: np.ndarray) -> dict[str, float]:
    """max, min and mean of the finite and non-finite values alike (NaN shows up as NaN)."""
    if x.size == 0:
        return {"max": math.nan, "min": math.nan, "mean": math.nan}
    x = x.astype(np.float64, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        return {"max": float(np.max(x)), "min": float(np.min(x)), "mean": float(np.mean(x))}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def kl_divergence(mine: np.ndarray, golden: np.ndarray) -> float:
    """KL(softmax(golden) || softmax(mine)) along the last dim, mean over the other dims."""
    a = np.asarray(mine, dtype=np.float64)
    b = np.asarray(golden, dtype=np.float64)
    if a.ndim == 0:
        a, b = a.reshape(1), b.reshape(1)
    log_p, log_q = _log_softmax(b), _log_softmax(a)
    return float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)))


def compute(mine: np.ndarray, golden: np.ndarray) -> dict[str, float]:
    """Every metric of METRICS for two finite tensors of the same shape."""
    a = np.asarray(mine, dtype=np.float64).reshape(-1)
    b = np.asarray(golden, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"metrics need tensors of one size, got {a.size} and {b.size} values")
    diff = np.abs(a - b)
    na, nb, nd = float(np.linalg.norm(a)), float(np.linalg.norm(b)), float(np.linalg.norm(a - b))
    if na == 0 and nb == 0:
        cosine = 1.0
    elif na == 0 or nb == 0:
        cosine = 0.0
    else:
        cosine = float(np.dot(a, b) / (na * nb))
    rel = diff / np.maximum(np.abs(b), REL_FLOOR)
    red = (0.0 if nd == 0 else math.inf) if nb == 0 else nd / nb
    empty = a.size == 0
    return {
        "cosine_similarity": cosine,
        "max_relative_error": 0.0 if empty else float(rel.max()),
        "mean_relative_error": 0.0 if empty else float(rel.mean()),
        "max_absolute_error": 0.0 if empty else float(diff.max()),
        "mean_absolute_error": 0.0 if empty else float(diff.mean()),
        "kl_divergence": 0.0 if empty else kl_divergence(np.asarray(mine).reshape(np.shape(golden)), golden),
        "relative_euclidean_distance": red,
    }


def non_finite(x: Any) -> tuple[int, int]:
    """(NaN count, inf count) of a float array; (0, 0) for ints."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        return 0, 0
    return int(np.isnan(x).sum()), int(np.isinf(x).sum())
