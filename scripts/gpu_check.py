"""The whole GPU state of yirage in one command: ``make gpu-check`` (a person with one NVIDIA GPU runs it).

Without a GPU it runs its compile-only part (every conformance-kit plan and every PersistentKernel source of the
CUDA runtime through NVRTC and ptxas for sm_80 and sm_90) and says that the rest needs a GPU; CI runs that part.
With a GPU, after the compile-only part:

1. in parallel (nothing here is timed), in two waves: the conformance kit on ``cuda`` and on ``triton``
   (pytest-xdist), the LLM tests on the GPU backends and ``auto``'s choice; then the GPU-only test files and
   ``backend_manager.py test cuda`` (on the compile cache the first wave filled);
2. alone, timed: decode of a SmolLM2-shaped random model on each GPU backend beside Hugging Face eager on the same
   GPU, greedy tokens compared (benchmark/device_decode.py), and Mirage-style kernel graphs against torch eager
   (benchmark/device_graphs.py).

It prints one summary table and writes it as ``summary.json`` and ``summary.md`` with every part's full log
(``logs/``) into ``$YIRAGE_GPU_CHECK_DIR`` (default ``build/gpu-check``). It installs nothing from the network and
downloads no model. Exit status: 1 when any part gave a wrong result or failed, never because of speed; a part
that ran out of its time limit counts as failed (it says so).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
#: the parallel part's test files that need a GPU (each skips itself elsewhere)
GPU_TESTS = ["tests/test_cuda_launch.py", "tests/test_cuda_build.py", "tests/test_cuda_graphs.py",
             "tests/test_cuda_kernel_languages.py", "tests/test_cuda_pk_runtime.py", "tests/test_launched_runtime.py",
             "tests/test_triton_render.py", "tests/test_device_placement.py", "tests/test_triton_aot.py"]
LLM_TESTS = ["tests/test_persistent.py", "tests/test_llm_ablation.py", "tests/test_pk_render.py",
             "tests/test_smollm2.py"]


@dataclass
class Part:
    """One command of the check, its outcome and where its log is."""

    name: str
    command: list[str]
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    status: str = "not run"  # "ok", "FAILED", "TIMEOUT", "skipped: why"
    seconds: float = 0.0
    summary: str = ""
    log: str = ""

    def run(self, logs: Path) -> Part:
        path = logs / f"{self.name}.log"
        self.log = str(path.relative_to(logs.parent))
        start = time.perf_counter()
        with path.open("w") as out:
            out.write(f"$ {' '.join(self.command)}\n")
            out.flush()
            try:
                done = subprocess.run(self.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=self.timeout, env={**os.environ, **self.env})
                self.status = "ok" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
            except subprocess.TimeoutExpired:
                self.status = f"TIMEOUT after {self.timeout:.0f} s"
        self.seconds = time.perf_counter() - start
        self.summary = _last_line(path)
        return self


def _last_line(path: Path) -> str:
    """The last line that says how a run ended (pytest's counts, a script's result), for the table."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if any(word in line for word in (" passed", " failed", " error", "compiled", "median", "skipped")):
            return line.strip("= ")[:160]
    return lines[-1][:160] if lines else ""


def gpu_present() -> tuple[bool, str]:
    """Whether an NVIDIA GPU with a CUDA build of torch is here, and what it is."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch does not import: {exc}"
    if not (torch.version.cuda and torch.cuda.is_available()):
        return False, f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda={torch.version.cuda})"
    return True, f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def xdist(workers: int) -> list[str]:
    import importlib.util

    return ["-n", str(workers)] if importlib.util.find_spec("xdist") else []


def pytest(*args: str) -> list[str]:
    return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *args]


def compile_only_parts() -> list[Part]:
    code = ("import sys\n"
            "from yirage_backend_cuda.check import check_conformance, check_persistent\n"
            "kit, pk = check_conformance(), check_persistent()\n"
            "print(kit.summary()); print(pk.summary())\n"
            "count = lambda r: f'{r.compiled}/{r.compiled + len(r.failures)}'\n"
            "print(f'compiled for {\", \".join(kit.archs)}: kit plans {count(kit)}, PersistentKernel sources '\n"
            "      f'{count(pk)} (NVRTC + ptxas)')\n"
            "sys.exit(0 if kit.ok and pk.ok else 1)\n")
    return [Part("compile-only", [PY, "-c", code], timeout=900)]


def parallel_parts(cores: int) -> list[list[Part]]:
    """Two waves of untimed parts, each wave in parallel: the kits and the LLM tests first (they fill the compile
    cache), then the GPU-only tests and the backend manager's kit run, which reuse it."""
    kit = max(2, cores * 3 // 8)
    return [
        [Part("kit-cuda", pytest(*xdist(kit), "tests/test_conformance.py", "--yirage-backend", "cuda"), 420),
         Part("kit-triton", pytest(*xdist(kit), "tests/test_conformance.py", "--yirage-backend", "triton"), 420),
         Part("llm-cuda-triton", pytest(*xdist(2), "--dist", "loadfile", *LLM_TESTS, "-k", "cuda or triton"), 420),
         Part("auto-choice", [PY, "-c", AUTO_CHOICE], 120)],
        [Part("gpu-tests", pytest(*xdist(max(2, cores // 4)), "--dist", "loadfile", *GPU_TESTS), 420),
         Part("backend-manager-test-cuda", [PY, "tools/backend_manager.py", "test", "cuda"], 300)],
    ]


AUTO_CHOICE = """
import sys, yirage as yr
from yirage.backend.selection import current_backend
graphs = current_backend(need="kernel_graphs").name
decode = current_backend(need="persistent").name
print("auto for kernel graphs:", graphs, "| for PersistentKernel / InferEngine:", decode)
for decision in yr.last_auto_report():
    print("  ", decision)
sys.exit(0 if decode != "cpu" and graphs != "cpu" else 1)
"""


def timed_parts(out: Path) -> list[Part]:
    return [
        Part("decode-vs-hf", [PY, "benchmark/device_decode.py", "--backends", "cuda", "triton", "--json",
                              str(out / "decode.json")], 300),
        Part("graphs-vs-torch", [PY, "benchmark/device_graphs.py", "--backends", "cuda", "triton", "--json",
                                 str(out / "graphs.json")], 240),
    ]


def write_summary(out: Path, header: str, parts: list[Part], note: str) -> str:
    width = max(len(p.name) for p in parts)
    lines = [header, "", f"| {'part':{width}} | status | seconds | result |", f"|{'-' * (width + 2)}|---|---|---|"]
    lines += [f"| {p.name:{width}} | {p.status} | {p.seconds:.0f} | {p.summary.replace('|', '/')} |" for p in parts]
    for extra in ("decode.json", "graphs.json"):
        if (out / extra).exists():
            lines += ["", f"{extra}:", "```", (out / extra).read_text().strip()[:6000], "```"]
    if note:
        lines += ["", note]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"header": header, "note": note,
                                                  "parts": [asdict(p) for p in parts]}, indent=1) + "\n")
    return text


def main() -> int:
    out = Path(os.environ.get("YIRAGE_GPU_CHECK_DIR", ROOT / "build" / "gpu-check")).resolve()
    if out.exists():
        shutil.rmtree(out)
    logs = out / "logs"
    logs.mkdir(parents=True)
    gpu, what = gpu_present()
    started = time.perf_counter()
    parts = [p.run(logs) for p in compile_only_parts()]
    note = ""
    if gpu:
        for wave in parallel_parts(os.cpu_count() or 2):
            with ThreadPoolExecutor(max_workers=len(wave)) as pool:
                parts += list(pool.map(lambda p: p.run(logs), wave))
        parts += [p.run(logs) for p in timed_parts(out)]
    else:
        note = (f"NO GPU HERE ({what}): only the compile-only part ran. The conformance kit on cuda/triton, the GPU "
                "tests, the LLM tests on the GPU backends and the timed decode need an NVIDIA GPU: run make gpu-check "
                "on a machine with one.")
    header = f"yirage gpu-check: {what}; {time.perf_counter() - started:.0f} s in all; logs in {out}"
    print(write_summary(out, header, parts, note))
    return 0 if all(p.status == "ok" for p in parts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
