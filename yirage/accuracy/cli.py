"""The ``compare`` and ``dump`` subcommands of ``python -m yirage`` / ``tools/yirage_backend_manager.py``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from yirage.accuracy.layout import MODES, AccuracyError


def _threshold(text: str) -> tuple[str, float | None]:
    """``metric=value`` or ``dtype.metric=value`` (value ``none``: no check)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE, e.g. cosine_similarity=0.999 or "
                                         "float16.relative_euclidean_distance=0.02")
    if value.strip().lower() == "none":
        return key.strip(), None
    try:
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None


def thresholds_from(pairs: list[tuple[str, float | None]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        dtype, dot, metric = key.partition(".")
        if dot:
            out.setdefault(dtype, {})[metric] = value
        else:
            out[key] = value
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    from yirage.accuracy.comparison import compare

    report = compare(args.my_path, args.golden_path, args.output, thresholds_from(args.threshold or []))
    print(report.summary())
    return 1 if report.failed else 0


def cmd_dump(args: argparse.Namespace) -> int:
    from yirage.accuracy.dump import dump_model

    ids = None
    if args.ids is not None:
        try:
            ids = json.loads(args.ids) if args.ids.strip().startswith("[") else \
                [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise AccuracyError(f"--ids {args.ids!r} must be token ids: 1,2,3 or [[1,2],[3,4]]") from None
    path = dump_model(args.model, args.output, backend=args.backend, unfused=args.unfused, tokens=args.tokens,
                      mode=args.mode, ops=args.ops, ids=ids, steps=args.steps, batch=args.batch, seed=args.seed,
                      dtype=args.dtype)
    side = "unfused (torch float64, op by op)" if args.unfused else f"fused (PersistentKernel on {args.backend})"
    print(f"dumped {side} to {path}")
    return 0


def add_parser(sub: Any) -> None:
    """Add ``compare`` and ``dump`` to the subparsers ``sub`` of yirage.cli."""
    cmp_ = sub.add_parser("compare", help="compare two accuracy dumps (fused vs unfused) and write a CSV")
    cmp_.add_argument("--my-path", required=True, help="the dump to check (e.g. the fused run)")
    cmp_.add_argument("--golden-path", required=True, help="the golden dump (e.g. the unfused run)")
    cmp_.add_argument("--output", default=".", help="directory for accuracy_compare.csv (default: .)")
    cmp_.add_argument("--threshold", action="append", type=_threshold, metavar="[DTYPE.]METRIC=VALUE",
                      help="override a pass criterion, e.g. cosine_similarity=0.999 or float16.kl_divergence=1e-3 "
                           "(repeatable; VALUE none turns the check off)")
    cmp_.set_defaults(func=cmd_compare)
    dump = sub.add_parser("dump", help="dump a model's decode steps, fused (PersistentKernel) or --unfused")
    dump.add_argument("--model", required=True, help="a Hugging Face model directory or a GGUF file")
    dump.add_argument("--output", required=True, help="a new (or empty) directory for the dump")
    dump.add_argument("--backend", default="cpu", help="backend of the fused run (default: cpu)")
    dump.add_argument("--unfused", action="store_true", help="the golden run: every op alone, torch float64")
    dump.add_argument("--tokens", default="all", help="token steps to dump: all (default) or e.g. 0,2")
    dump.add_argument("--mode", choices=MODES, default="all", help="dump op inputs, outputs or all (default)")
    dump.add_argument("--ops", help="regex over op names: only matching ops (or fused kernels) are dumped")
    dump.add_argument("--ids", help="token ids to run, 1,2,3 or [[1,2],[3,4]] (default: seeded random ids)")
    dump.add_argument("--steps", type=int, default=4, help="random ids: how many token steps (default 4)")
    dump.add_argument("--batch", type=int, default=1, help="random ids: how many rows (default 1)")
    dump.add_argument("--seed", type=int, default=0, help="random ids: the seed (default 0)")
    dump.add_argument("--dtype", help="weight dtype (float32, bfloat16, float16, q8_0, q4_0); default: the "
                                      "checkpoint's")
    dump.set_defaults(func=cmd_dump)
