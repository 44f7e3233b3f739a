"""Compare two dumps tensor by tensor and write the result as one CSV, rows in execution order.

A fused dump is matched to an unfused one through its map (each fused
kernel's inputs and output are assembled from the ops it replaces,
yirage.accuracy.mapping); two dumps of the same kind are matched by op
name. Rows that cannot be compared (shape mismatch, NaN/inf present, a
tensor missing on one side) are kept and fail with their reason, so the
first failing row is the first place the two runs part ways.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from yirage.accuracy import metrics
from yirage.accuracy.layout import AccuracyError, DumpReader, writable_dir
from yirage.accuracy.mapping import FusedKernel, Source, combine

#: pass criteria per dtype (the less precise of the two sides): cosine_similarity is a minimum, the rest maxima.
#: Integer tensors (token ids) must be equal. Any metric of yirage.accuracy.metrics.METRICS may be set.
DEFAULT_THRESHOLDS: dict[str, dict[str, float]] = {
    "float64": {"cosine_similarity": 0.999999, "relative_euclidean_distance": 1e-6},
    "float32": {"cosine_similarity": 0.9999, "relative_euclidean_distance": 1e-3},
    "float16": {"cosine_similarity": 0.999, "relative_euclidean_distance": 1e-2},
    "bfloat16": {"cosine_similarity": 0.99, "relative_euclidean_distance": 5e-2},
}
PRECISION = ("bfloat16", "float16", "float32", "float64")  # least precise first
CSV_NAME = "accuracy_compare.csv"
SIDE = ("dtype", "shape", "max", "min", "mean")
COLUMNS = ("token_id", "op_name", "op_kind", "tensor", "golden_ops",
           *(f"my_{k}" for k in SIDE), *(f"golden_{k}" for k in SIDE), *metrics.METRICS, "pass_fail", "fail_reason")


def resolve_thresholds(thresholds: Mapping[str, Any] | None) -> dict[str, dict[str, float | None]]:
    """DEFAULT_THRESHOLDS updated by ``thresholds``: ``{metric: value}`` for every float dtype, or
    ``{dtype: {metric: value}}`` for one; a value of None turns that check off."""
    out: dict[str, dict[str, float | None]] = {k: dict(v) for k, v in DEFAULT_THRESHOLDS.items()}
    if thresholds is None:
        return out
    if not isinstance(thresholds, Mapping):
        raise AccuracyError(f"thresholds must be a dict like {{'cosine_similarity': 0.999}} or "
                            f"{{'float16': {{...}}}}, got {type(thresholds).__name__}")
    for key, value in thresholds.items():
        if key in PRECISION and isinstance(value, Mapping):
            for metric, v in value.items():
                out[key][_metric(metric)] = _bound(metric, v)
        elif key in metrics.METRICS:
            for dtype in out:
                out[dtype][key] = _bound(key, value)
        else:
            raise AccuracyError(f"threshold {key!r} is neither a metric ({', '.join(metrics.METRICS)}) nor a dtype "
                                f"({', '.join(PRECISION)}) with a dict of metrics")
    return out


def _metric(name: Any) -> str:
    if name not in metrics.METRICS:
        raise AccuracyError(f"threshold metric {name!r} is unknown; use one of {', '.join(metrics.METRICS)}")
    return str(name)


def _bound(metric: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise AccuracyError(f"threshold {metric}={value!r} must be a finite number >= 0 (or None: no check)")
    return float(value)


@dataclass
class Tensor:
    """One side of a row: its array (None if missing), dtype name and what it was assembled from."""

    array: np.ndarray | None
    dtype: str
    missing: str = ""


@dataclass
class CompareReport:
    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["pass_fail"] == "fail"]

    @property
    def first_failure(self) -> dict[str, Any] | None:
        failed = self.failed
        return failed[0] if failed else None

    def summary(self) -> str:
        first = self.first_failure
        head = f"{len(self.rows)} rows, {len(self.failed)} failed; CSV: {self.path}"
        if first is None:
            return head
        return (f"{head}\nfirst failure: token {first['token_id']} {first['op_name']} {first['tensor']}: "
                f"{first['fail_reason']}")


def _fetch(reader: DumpReader, token: int, source: Source) -> Tensor:
    arrays, dtypes = [], []
    for op, io, k in source.parts:
        record = reader.get(token, op, io, k)
        if record is None:
            return Tensor(None, "", f"{op}.{io}.{k} of token {token} is not in the {reader.what} dump (dump both "
                                    "sides with the same tokens, mode and ops selection)")
        arrays.append(reader.load(record))
        dtypes.append(record["dtype"])
    try:
        return Tensor(combine(source, arrays), dtypes[0])
    except (ValueError, IndexError, KeyError) as exc:
        return Tensor(None, dtypes[0], f"cannot assemble {source.label()} ({exc})")


def _pairs(mine: DumpReader, golden: DumpReader) -> list[tuple[dict[str, Any], Tensor, Tensor]]:
    """(row head, my tensor, golden tensor) in the execution order of the side that drives the rows."""
    mapped = mine.meta["kind"] != golden.meta["kind"]  # fused vs unfused: through the fused side's map
    fused = mine if mine.meta["kind"] == "fused" else golden
    kernels = {k.name: k for k in map(FusedKernel.from_json, fused.meta.get("map", []))}
    driver = fused if mapped else mine  # the side whose records make the rows
    other = golden if driver is mine else mine
    out = []
    for r in driver.records:
        token, op, io, k = r["token"], r["op"], r["io"], r["index"]
        kernel = kernels.get(op)
        here = Tensor(driver.load(r), r["dtype"])
        if mapped:
            if kernel is None or (io == "input" and k >= len(kernel.inputs)):
                raise AccuracyError(f"the {fused.what} dump's map has no entry for {op}.{io}.{k}; the dump is "
                                    "corrupted, dump again")
            source = kernel.inputs[k][1] if io == "input" else kernel.output
            there = _fetch(other, token, source)
            golden_ops = source.label()
        else:
            rec = other.get(token, op, io, k)
            there = (Tensor(None, "", f"{op}.{io}.{k} of token {token} is not in the {other.what} dump")
                     if rec is None else Tensor(other.load(rec), rec["dtype"]))
            golden_ops = f"{op}.{io}.{k}"
        role = f" ({r.get('role')})" if r.get("role") and r.get("role") != "output" else ""
        head = {"token_id": token, "op_name": op, "op_kind": kernel.kind if kernel else "",
                "tensor": f"{io}.{k}{role}", "golden_ops": golden_ops}
        my_t, golden_t = (here, there) if driver is mine else (there, here)
        out.append((head, my_t, golden_t))
    return out


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == math.inf else
                                                "-inf" if value == -math.inf else format(value, ".12g"))
    return value


def _side(prefix: str, t: Tensor) -> dict[str, Any]:
    if t.array is None:
        return {f"{prefix}_{k}": "" for k in SIDE}
    stats = metrics.summary(t.array)
    shape = "x".join(map(str, t.array.shape)) or "scalar"
    return {f"{prefix}_dtype": t.dtype, f"{prefix}_shape": shape, **{f"{prefix}_{k}": stats[k] for k in stats}}


def _judge(my: Tensor, golden: Tensor, limits: dict[str, dict[str, float | None]]) -> tuple[dict[str, Any], str]:
    """(metrics, fail reason or "")."""
    blank = {m: "" for m in metrics.METRICS}
    for t, side in ((my, "my"), (golden, "golden")):
        if t.array is None:
            return blank, f"missing on the {side} side: {t.missing}"
    a, b = my.array, golden.array
    assert a is not None and b is not None
    if a.shape != b.shape:
        return blank, f"shape mismatch: my {a.shape} vs golden {b.shape}"
    with np.errstate(all="ignore"):
        values = metrics.compute(a, b)
    bad = [f"{side} has {nan} NaN and {inf} inf" for side, (nan, inf) in
           (("my", metrics.non_finite(a)), ("golden", metrics.non_finite(b))) if nan or inf]
    if bad:
        return values, "NaN/inf present: " + "; ".join(bad)
    if not (np.issubdtype(a.dtype, np.floating) and np.issubdtype(b.dtype, np.floating)):
        differ = int(np.count_nonzero(a != b))
        return values, (f"integer values differ at {differ} of {a.size} elements" if differ else "")
    dtype = min((d for d in (my.dtype, golden.dtype) if d in PRECISION), key=PRECISION.index, default="float32")
    reasons = []
    for metric, bound in limits[dtype].items():
        if bound is None:
            continue
        v = values[metric]
        ok = v >= bound if metric == "cosine_similarity" else v <= bound
        if not ok:  # NaN fails too
            reasons.append(f"{metric} {v:.6g} {'<' if metric == 'cosine_similarity' else '>'} {bound:g} ({dtype})")
    return values, "; ".join(reasons)


def compare(my_path: str | os.PathLike[str], golden_path: str | os.PathLike[str],
            output_dir: str | os.PathLike[str], thresholds: Mapping[str, Any] | None = None) -> CompareReport:
    """Compare dump ``my_path`` against ``golden_path``; writes ``output_dir/accuracy_compare.csv``."""
    limits = resolve_thresholds(thresholds)
    mine, golden = DumpReader(my_path, "my"), DumpReader(golden_path, "golden")
    for key in ("source", "ids", "model" if mine.meta.get("source") == "graph" else "source"):
        if mine.meta.get(key) != golden.meta.get(key):
            raise AccuracyError(f"the dumps differ in {key!r} (my {mine.meta.get(key)!r}, golden "
                                f"{golden.meta.get(key)!r}): compare two runs of the same model or kernel graph "
                                "over the same token ids (same --ids or --seed/--steps/--batch)")
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise AccuracyError(f"output {str(out)!r} is a file; pass a directory for {CSV_NAME}")
    writable_dir(out, "output directory")  # before comparing: a bad --output fails at once, with its reason
    report = CompareReport(out / CSV_NAME)
    for head, my_t, golden_t in _pairs(mine, golden):
        values, reason = _judge(my_t, golden_t, limits)
        report.rows.append({**head, **_side("my", my_t), **_side("golden", golden_t), **values,
                            "pass_fail": "fail" if reason else "pass", "fail_reason": reason})
    _write_csv(report)
    return report


def _write_csv(report: CompareReport) -> None:
    try:
        with open(report.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            for row in report.rows:
                writer.writerow({k: _fmt(v) for k, v in row.items()})
    except OSError as exc:  # writable when checked; the disk filled or the path changed since
        raise AccuracyError(f"cannot write {report.path} ({type(exc).__name__}: {exc.strerror or exc}); pass a "
                            "writable --output directory") from None
