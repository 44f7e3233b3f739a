"""Did a change make yirage slower? W1-W4 for two revisions, run alternately in one session.

    .venv/bin/python benchmark/compare_revisions.py BASE_REV [--rounds 2] [--quick] [--tokens 64]

BASE_REV is checked out into a temporary git worktree; its ``yirage`` and
``yirage_backend_cpu`` packages are put first on ``PYTHONPATH`` (the venv's
editable installs come after it), each revision gets its own compile cache,
and the two revisions' runs of ``kernel_graphs.py`` and ``llm_decode.py``
alternate round by round so the machine's drift hits both alike. It prints
the median of the rounds for every yirage figure and the ratio base / head
(> 1: head is faster; within 1.15x either way: a tie).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TIE = 1.15


def run_json(checkout: Path, cache: Path, script: str, args: list[str], on_path: bool) -> dict[str, Any]:
    env = {**os.environ, "YIRAGE_CACHE_DIR": str(cache)}
    if on_path:
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(checkout / "backends" / "cpu")])
    out = subprocess.run([sys.executable, str(checkout / "benchmark" / script), "--json", *args], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode not in (0, 1):  # llm_decode exits 1 when tokens differ from HF: still a figure
        raise RuntimeError(f"{script} at {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def figures(kernel: dict[str, Any], decode: dict[str, Any]) -> dict[str, float]:
    """yirage's own figures (µs for W1-W3, ms/token for W4) from one round of both scripts."""
    found = {f"{r['workload']} {r['case']} [{r['impl']}] us": r["median_us"]
             for r in kernel["results"] if r["impl"].startswith("yirage") and r.get("median_us")}
    if "peers" in decode:  # llm_decode.py before it measured llama.cpp: W4 only
        for name, peer in decode["peers"].items():
            if name.startswith("yirage"):
                found[f"W4 {name} ms/token"] = peer["ms_per_token"]
        return found
    for model, entry in decode["models"].items():
        for dtype, row in entry["dtypes"].items():
            for name, stats in row["quiet"].items():
                if name.startswith("yirage"):
                    found[f"{model.upper()} {name.replace('cpu', dtype)} ms/token"] = stats["median"]
    return found


def decode_args(checkout: Path, tokens: int) -> list[str]:
    """The revision's llm_decode.py flags for yirage's W4 figures alone (its options changed over time)."""
    source = (checkout / "benchmark" / "llm_decode.py").read_text(encoding="utf-8")
    if "--no-llama-cpp" in source:
        return ["--models", "w4", "--dtypes", "f32", "bf16", "--rounds", "1", "--no-llama-cpp", "--no-hf",
                "--tokens", str(tokens)]
    return ["--skip-compile", "--tokens", str(tokens)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the git revision to compare HEAD's working tree with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run, not a measurement")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    kernel_args = ["--quick"] if args.quick else []
    with tempfile.TemporaryDirectory(prefix="yirage-compare-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
        try:
            runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
            for round_ in range(args.rounds):
                for label, checkout in (("base", base), ("head", ROOT)):
                    print(f"round {round_ + 1}: {label}", file=sys.stderr, flush=True)
                    cache = Path(tmp) / f"cache-{label}"
                    kernel = run_json(checkout, cache, "kernel_graphs.py", kernel_args, label == "base")
                    decode = run_json(checkout, cache, "llm_decode.py", decode_args(checkout, args.tokens),
                                      label == "base")
                    runs[label].append(figures(kernel, decode))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False,
                           capture_output=True)
    print(f"base {args.base} vs head (working tree), median of {args.rounds} alternating rounds")
    print(f"{'figure':<58}{'base':>10}{'head':>10}{'base/head':>11}")
    for key in runs["head"][0]:
        if not all(key in r for r in runs["base"] + runs["head"]):
            continue
        b = statistics.median(r[key] for r in runs["base"])
        h = statistics.median(r[key] for r in runs["head"])
        ratio = b / h
        verdict = "tie" if 1 / TIE < ratio < TIE else f"{ratio:.2f}x"
        print(f"{key:<58}{b:>10.4g}{h:>10.4g}{verdict:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
