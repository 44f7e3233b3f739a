"""Compile rendered Triton modules ahead of time for GPUs this machine does not have.

The test renders plans, then runs this file as a script in a subprocess (Triton's
JIT, not its interpreter: without TRITON_INTERPRET): ``python
tests/test_triton_aot.py TARGET DIR...`` imports every ``kernels.py`` under the
directories, compiles each launch's kernel with ``triton.compile(ASTSource(...),
target=GPUTarget(...))`` for ``cuda`` (sm_90) or ``hip`` (gfx942) with the
launch's own block sizes and pointer types, and prints one JSON line: counts
and failures.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

POINTER = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "float64": "*fp64", "int32": "*i32",
           "int64": "*i64"}
TARGETS = {"cuda": ("cuda", 90, 32), "hip": ("hip", "gfx942", 64)}
BACKEND_OF = {"cuda": "nvidia", "hip": "amd"}  # the triton.backends entry each target needs
#: set by ``make triton-interpret`` to the dedicated compile cache the interpreter's kit run just filled
KIT_CACHE = os.environ.get("YIRAGE_TRITON_AOT_CACHE", "")


def compile_module(path: Path, target: object) -> tuple[int, list[str]]:
    """(kernels compiled, failures) for one rendered module."""
    import triton
    from triton.compiler import ASTSource

    header = path.read_text(encoding="utf-8").partition("\n")[0]
    meta = json.loads(header.removeprefix("# yirage-launch: "))
    dtypes = {n: d for n, _, d in meta["inputs"]}
    dtypes.update({n: ("float32" if d in ("float16", "bfloat16") and role == "temp" else d)
                   for n, _, d, role in meta["buffers"]})
    dtypes.update({s["name"]: s["dtype"] for s in meta["scratch"]})
    name = f"aot_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    new_api = "constexprs" in inspect.signature(ASTSource.__init__).parameters  # Triton >= 3.3
    done, failures = 0, []
    for launch in meta["launches"]:
        fn = getattr(module, launch["kernel"])
        pointers = [POINTER[dtypes[a]] for a in launch["args"]]
        params = dict(launch["constexprs"])
        if new_api:
            signature = {f"p_{a}": t for a, t in zip(launch["args"], pointers, strict=True)}
            signature.update({c: "constexpr" for c in params})
            src = ASTSource(fn, signature, constexprs=params)
        else:
            n = len(pointers)
            src = ASTSource(fn, dict(enumerate(pointers)), constants={n + i: v for i, v in enumerate(params.values())})
        try:
            triton.compile(src, target=target, options={"num_warps": launch["num_warps"], "enable_fp_fusion": False})
            done += 1
        except Exception as exc:  # noqa: BLE001 - every failure is reported, with its kernel
            failures.append(f"{path} {launch['kernel']}: {type(exc).__name__}: {str(exc)[:400]}")
    return done, failures


def main() -> None:
    import triton
    import triton.backends
    from triton.backends.compiler import GPUTarget

    if BACKEND_OF[sys.argv[1]] not in triton.backends.backends:
        print(json.dumps({"skip": f"this Triton ({triton.__version__}) has no {BACKEND_OF[sys.argv[1]]} backend"}))
        return
    target = GPUTarget(*TARGETS[sys.argv[1]])
    paths = sorted(p for d in sys.argv[2:] for p in Path(d).glob("**/kernels.py"))
    compiled, failures = 0, []
    for path in paths:
        n, bad = compile_module(path, target)
        compiled, failures = compiled + n, failures + bad
    reasons = {f.split(": ", 1)[1] for f in failures}
    if failures and not compiled and len(reasons) == 1:  # one cause for everything: a missing toolchain
        why = f"Triton {triton.__version__} cannot compile for {sys.argv[1]} here: {reasons.pop()}"
        print(json.dumps({"skip": why}))
        return
    print(json.dumps({"target": sys.argv[1], "modules": len(paths), "kernels": compiled, "failures": failures}))


@pytest.mark.skipif(not KIT_CACHE, reason="compiles every conformance plan the interpreter ran: make triton-interpret")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_conformance_plan_compiles_ahead_of_time(target: str, tmp_path: Path) -> None:
    """Every kit plan (left in the kit run's cache) and the hand and seeded graphs of test_triton_render, compiled
    for an sm_90 GPU and a gfx942 GPU without either present: Triton must accept everything the renderer emits."""
    pytest.importorskip("triton", reason="triton is not installed: pip install 'yirage-backend-triton[triton]'")
    from test_triton_render import PLANS

    from yirage.backend.triton_stages import render_source

    for i, plan in enumerate(PLANS.values()):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "kernels.py").write_text(render_source(plan), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the JIT, not the interpreter
    done = subprocess.run([sys.executable, __file__, target, str(tmp_path), str(Path(KIT_CACHE) / "triton")],
                          capture_output=True, text=True, timeout=3600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    print(f"AOT {target}: {result['kernels']} kernels of {result['modules']} modules compiled")
    assert result["kernels"] > len(PLANS) and not result["failures"], "\n".join(result["failures"][:20])


if __name__ == "__main__":
    main()
