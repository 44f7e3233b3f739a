"""Hash every kernel the renderers produce for the conformance kit's plans and for PersistentKernel programs.

Why: a refactor of the renderers, the launch headers or the op tables must not change a single generated
kernel by accident. Run it before and after a change and compare:

    python scripts/render_hashes.py --out before.json
    ... change ...
    python scripts/render_hashes.py --out after.json --compare before.json

Each entry hashes the kernel text (the source without its one-line launch header) and, separately, the
header, so a moved header format shows up as a header difference while the kernels stay identical.
Renderings: the C-family renderer in every dialect (OpenCL C, CUDA C, HIP, Metal), each backend's
``render`` stage (cuda, opencl, mps, triton, cpu numba), and the PersistentKernel task sources (C-family
in every dialect, and the Triton task module) of small decoders (greedy and sampling, float32 and bfloat16,
with and without q/k/v biases).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

DIALECTS = ("opencl", "cuda", "hip", "metal")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _split_header(source: str) -> tuple[str, str]:
    """(header line, kernels) where the first line is a launch header comment, else ('', source)."""
    first, _, rest = source.partition("\n")
    if first.startswith(("//", "#")) and "{" in first:
        return first, rest
    return "", source


def plan_hashes() -> dict[str, dict[str, str]]:
    """Every kit plan rendered by every renderer: {plan name: {renderer: hash}}."""
    from yirage_backend_domestic.hip_build import conformance_plans

    from yirage.codegen.cstyle import render_plan
    from yirage.codegen.dialects import dialect

    renderers: dict[str, Any] = {f"cstyle-{d}": (lambda p, d=d: render_plan(p, dialect(d))) for d in DIALECTS}
    from yirage_backend_cpu.compile import render as cpu_render
    from yirage_backend_cuda.launch import render_source as cuda_source
    from yirage_backend_mps.compile import render_source as mps_source

    from yirage.backend.triton_stages import render_source as triton_source

    renderers["backend-cuda"] = lambda p: cuda_source(p, {})
    renderers["backend-mps"] = mps_source
    renderers["backend-triton"] = triton_source
    renderers["backend-cpu"] = lambda p: cpu_render(p, "fingerprint")
    try:
        from yirage_backend_opencl.compile import render_source as opencl_source

        renderers["backend-opencl"] = opencl_source
    except ImportError as exc:  # pyopencl missing: say so in the output rather than hide it
        print(f"note: the opencl backend's render stage is not hashed ({exc})", file=sys.stderr)
    out: dict[str, dict[str, str]] = {}
    for name, plan in sorted(conformance_plans().items()):
        row: dict[str, str] = {}
        for label, render in renderers.items():
            try:
                header, kernels = _split_header(render(plan))
                row[label] = _sha(kernels)
                if header:
                    row[label + ":header"] = _sha(header)
            except Exception as exc:  # noqa: BLE001 - a renderer refusing a plan is part of its behaviour
                row[label] = f"raises {type(exc).__name__}: {str(exc)[:80]}"
        out[name] = row
    return out


def persistent_hashes(workdir: Path) -> dict[str, dict[str, str]]:
    """The PersistentKernel task sources of small decoders in every dialect, and the Triton task module."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from llm_oracle import zoo_model

    from yirage.codegen.dialects import dialect
    from yirage.engine import InferEngine
    from yirage.persistent.cstyle import render_persistent

    sampling = {"temperature": 1.5, "top_k": 50, "top_p": 0.9, "seed": 7}
    out: dict[str, dict[str, str]] = {}
    for kind in ("llama-gqa", "qwen2-bias-tied"):
        for dtype in (torch.float32, torch.bfloat16):
            for sample in (None, sampling):
                engine = InferEngine(zoo_model(kind, dtype, workdir).path, backend="reference")
                engine.reset_cache(2, 16)
                program = engine.model.build_decoder(engine._step, engine._tokens, backend="reference",
                                                     sampling=sample).program
                name = f"pk-{kind}-{str(dtype).removeprefix('torch.')}-{'sample' if sample else 'greedy'}"
                out[name] = {f"{d}-lanes{lanes}": _sha(render_persistent(program, dialect(d), lanes=lanes).source)
                             for d in DIALECTS for lanes in (0, 8)}
    import yirage.persistent.triton_tasks as tasks_module  # noqa: F401 - its file is the Triton task source

    out["pk-triton-tasks"] = {"source": _sha(Path(tasks_module.__file__).read_text(encoding="utf-8"))}
    return out


def compare(now: dict[str, Any], before: dict[str, Any]) -> int:
    """Print every difference of the plans both sides render; 1 if a kernel differs, 0 if only headers (or nothing)
    differ. Plans on one side only (the kit gained or changed a case) are listed, not counted as differences."""
    kernels = headers = 0
    for side, names in (("only now", set(now) - set(before)), ("only before", set(before) - set(now))):
        if names:
            print(f"{len(names)} plans {side} (kit cases added or changed): {', '.join(sorted(names)[:12])}"
                  + (" ..." if len(names) > 12 else ""))
    for name in sorted(set(now) & set(before)):
        a, b = now.get(name, {}), before.get(name, {})
        for label in sorted(set(a) | set(b)):
            if a.get(label) != b.get(label):
                header = label.endswith(":header")
                headers += header
                kernels += not header
                print(f"{'header' if header else 'KERNEL'} differs: {name} {label}: {b.get(label)} -> {a.get(label)}")
    total = sum(len(now[n]) for n in set(now) & set(before))
    print(f"{total} renderings compared: {kernels} kernel differences, {headers} header differences")
    return 1 if kernels else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="write the hashes here (JSON)")
    parser.add_argument("--compare", type=Path, help="a earlier output to compare with")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="yirage-render-hashes-") as tmp:
        hashes = {**plan_hashes(), **persistent_hashes(Path(tmp))}
    args.out.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    print(f"wrote {sum(len(v) for v in hashes.values())} hashes of {len(hashes)} plans/programs to {args.out}")
    if args.compare:
        return compare(hashes, json.loads(args.compare.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
