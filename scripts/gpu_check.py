"""The whole GPU state of yirage in one command: ``make gpu-check`` (a person with one NVIDIA GPU runs it).

Without a GPU it runs its compile-only part (every conformance-kit plan and every PersistentKernel source of the
CUDA runtimes, the resident megakernel's included, through NVRTC and ptxas for sm_80 and sm_90; the PersistentKernel
sources must not spill a register, and ``ptxas -v``'s largest register count is printed) and says that the rest needs a
GPU; CI runs that part. With a GPU:

1. in parallel (nothing here is timed), in two waves: the compile-only part, the conformance kit on ``cuda`` and
   on ``triton`` (pytest-xdist), the LLM tests on the GPU backends and ``auto``'s choice; then the GPU-only test
   files, ``backend_manager.py test cuda`` (on the compile cache the first wave filled), the LLM tests on the
   cuda megakernel (``YIRAGE_CUDA_PK_RUNTIME=megakernel``) and a short megakernel decode under compute-sanitizer's
   memcheck and racecheck (scripts/sanitize_decode.py; a sanitizer part that runs out of time does not fail);
2. alone, timed: decode of a SmolLM2-shaped random model on each GPU backend beside Hugging Face eager on the
   same GPU, greedy tokens compared (benchmark/device_decode.py; the cuda megakernel last, rows written as each
   finishes, so a hang costs only the rows after it; one HF timing per dtype serves every row), Mirage-style
   kernel graphs against torch eager (benchmark/device_graphs.py), then the optional parts, where the budget is
   left: the same decode beside its variants in one process, in bfloat16 (cuda without the staged GEMVs' weight
   prefetch, ``YIRAGE_PK_PREFETCH=0``; the megakernel with its flat grid barrier, the two-level one and per-phase
   completion counters, ``YIRAGE_CUDA_GRID_SYNC=tree`` / ``events``; greedy tokens compared as in every decode
   row), the cost of one grid-wide barrier of the megakernel by grid size (benchmark/grid_barrier.py), a seeded
   sampled decode on cuda beside HF sampling, Llama-3.2-1B's shape in bfloat16 with its share of the read
   bandwidth measured in the same run, and ``g.superoptimize()`` on cuda over the same graphs
   (benchmark/superoptimize.py); an optional part skipped or cut by the budget does not fail the check. The decode
   and graph parts also profile one generate per row and 5 calls per graph (torch.profiler: each kernel's time and
   count) into ``profile/``.

It prints one summary table and writes it as ``summary.json`` and ``summary.md`` with every part's full log
(``logs/``) into ``$YIRAGE_GPU_CHECK_DIR`` (default ``build/gpu-check``). It installs nothing from the network and
downloads no model. The whole check keeps to ``$YIRAGE_GPU_CHECK_BUDGET`` seconds (default 480): a part still running
at its share's end is killed with its process group and reported as a TIMEOUT; ``$YIRAGE_GPU_CHECK_ONLY`` (part
names, comma-separated) reruns some parts only. Exit status: 1 when any part gave a wrong result or failed, never
because of speed; a part that ran out of its time limit counts as failed (it says so), an optional one excepted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
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
             "tests/test_triton_render.py", "tests/test_device_placement.py", "tests/test_triton_aot.py",
             "tests/test_cuda_megakernel.py"]
LLM_TESTS = ["tests/test_persistent.py", "tests/test_llm_ablation.py", "tests/test_pk_render.py",
             "tests/test_prompt_dtype.py", "tests/test_smollm2.py"]


@dataclass
class Part:
    """One command of the check, its outcome and where its log is."""

    name: str
    command: list[str]
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    #: a part that may be skipped or cut by the budget without failing the check (it still fails when it fails)
    optional: bool = False
    status: str = "not run"  # "ok", "FAILED", "TIMEOUT", "skipped: why"
    seconds: float = 0.0
    summary: str = ""
    failures: list[str] = field(default_factory=list)
    log: str = ""

    def run(self, logs: Path, deadline: float | None = None) -> Part:
        """Run the command with its output in its log; past ``min(timeout, deadline)`` its whole process group
        (pytest-xdist workers included) is killed, so a hung part cannot hold the GPU for the parts after it."""
        path = logs / f"{self.name}.log"
        self.log = str(path.relative_to(logs.parent))
        if self.status.startswith("skipped"):  # decided when the part was made (a tool that is not installed)
            path.write_text(self.status + "\n")
            return self
        left = float("inf") if deadline is None else deadline - time.monotonic()
        limit = min(self.timeout, left)
        if left < 5:
            self.status = "skipped: the check's time budget was spent (YIRAGE_GPU_CHECK_BUDGET)"
            path.write_text(self.status + "\n")
            return self
        start = time.perf_counter()
        with path.open("w") as out:
            out.write(f"$ {' '.join(self.command)}\n")
            out.flush()
            child = subprocess.Popen(self.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, start_new_session=True)
            try:
                code = child.wait(timeout=limit)
                self.status = "ok" if code == 0 else f"FAILED (exit {code})"
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                self.status = f"TIMEOUT after {limit:.0f} s"
        self.seconds = time.perf_counter() - start
        self.summary = _last_line(path)
        self.failures = _failed_tests(path)
        return self


def _failed_tests(path: Path, most: int = 20) -> list[str]:
    """pytest's ``FAILED``/``ERROR`` lines (``-rfE``) of a log, so the table says which tests failed and why."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()
             if line.startswith(("FAILED ", "ERROR "))]
    return [line[:300] for line in lines[:most]] + ([f"... and {len(lines) - most} more"] if len(lines) > most else [])


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
    return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--durations=12", *args]


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
        [Part("gpu-tests", pytest(*xdist(max(2, cores // 2)), "--dist", "loadfile", *GPU_TESTS), 420),
         Part("backend-manager-test-cuda", [PY, "tools/backend_manager.py", "test", "cuda"], 300),
         Part("llm-cuda-megakernel", pytest(*xdist(2), "--dist", "loadfile", "tests/test_persistent.py", "-k", "cuda"),
              240, env={MEGAKERNEL[0]: MEGAKERNEL[1]}),
         *sanitizer_parts()],
    ]


def sanitizer_parts() -> list[Part]:
    """A short decode on the cuda megakernel under compute-sanitizer's memcheck and racecheck (where it is
    installed: a part says so when it is not)."""
    tool = shutil.which("compute-sanitizer")
    parts = []
    for check in ("memcheck", "racecheck"):
        # --report-api-errors no: cuda-bindings resolves its driver entry points with cuGetProcAddress at first use,
        # and each one the installed driver lacks returns CUDA_ERROR_INVALID_VALUE, which memcheck would count as an
        # error (34 on an H100 with driver 580, none in a kernel); device-side access errors still fail the part
        command = [tool or "compute-sanitizer", "--tool", check, "--report-api-errors", "no", "--error-exitcode", "1",
                   PY, "scripts/sanitize_decode.py", "--backend", "cuda"]
        part = Part(f"sanitize-{check}-megakernel", command, 180, env={MEGAKERNEL[0]: MEGAKERNEL[1]}, optional=True)
        if tool is None:
            part.status = "skipped: compute-sanitizer is not on PATH"
        parts.append(part)
    return parts


AUTO_CHOICE = """
import sys, yirage as yr
from yirage.backend.selection import current_backend
graphs = current_backend(need="kernel_graphs").name
decode = current_backend(need="persistent").name
for decision in yr.last_auto_report():
    print("  ", decision)
print("auto for kernel graphs:", graphs, "| for PersistentKernel / InferEngine:", decode)
sys.exit(0 if decode != "cpu" and graphs != "cpu" else 1)
"""


#: seconds of the check's budget kept for the timed parts, which run last and alone
TIMED_RESERVE = 200


#: the environment setting that selects the cuda backend's resident megakernel (backends/cuda/.../megakernel.py)
MEGAKERNEL = ("YIRAGE_CUDA_PK_RUNTIME", "megakernel")


def timed_parts(out: Path) -> list[Part]:
    """The decodes beside HF eager (the megakernel last; the rows before it are kept if it hangs),
    the kernel graphs beside torch, then (optional, where the budget is left) the decode's variants (the weight
    prefetch off, the megakernel's two-level barrier and its event counters), the megakernel's grid-barrier cost, a
    seeded sampled decode (the sampler: one work-item per row on the C-family runtimes) and Llama-3.2-1B's shape
    in bfloat16 on both cuda runtimes with its share of the measured read bandwidth (issue 27's goal), and
    ``g.superoptimize()`` on cuda over the 14 graphs (fusion plans, then the knobs: each kernel's language, row
    work-group sizes, cuBLAS or the generated product; 8 s of search per graph; rows print as they finish)."""
    return [
        Part("decode-vs-hf", [PY, "benchmark/device_decode.py", "--backends", "cuda", "triton",
                              f"cuda:{MEGAKERNEL[0]}={MEGAKERNEL[1]}", "--json", str(out / "decode.json"),
                              "--profile", str(out / "profile")], 240),
        Part("graphs-vs-torch", [PY, "benchmark/device_graphs.py", "--backends", "cuda", "triton", "--json",
                                 str(out / "graphs.json"), "--profile", str(out / "profile")], 150),
        Part("decode-variants", [PY, "benchmark/device_decode.py", "--dtypes", "bfloat16", "--backends", "cuda",
                                 "cuda:YIRAGE_PK_PREFETCH=0",
                                 f"cuda:{MEGAKERNEL[0]}={MEGAKERNEL[1]}",
                                 f"cuda:{MEGAKERNEL[0]}={MEGAKERNEL[1]},YIRAGE_CUDA_GRID_SYNC=tree",
                                 f"cuda:{MEGAKERNEL[0]}={MEGAKERNEL[1]},YIRAGE_CUDA_GRID_SYNC=events", "--json",
                                 str(out / "decode-variants.json")], 200, optional=True),
        Part("grid-barrier", [PY, "benchmark/grid_barrier.py", "--json", str(out / "grid-barrier.json")], 60,
             optional=True),
        Part("decode-sampled", [PY, "benchmark/device_decode.py", "--sample", "--dtypes", "bfloat16", "--rounds", "1",
                                "--backends", "cuda", "--json", str(out / "decode-sampled.json"), "--profile",
                                str(out / "profile-sampled")], 90, optional=True),
        Part("decode-llama1b", [PY, "benchmark/device_decode.py", "--shape", "llama1b", "--dtypes", "bfloat16",
                                "--rounds", "2", "--backends", "cuda", f"cuda:{MEGAKERNEL[0]}={MEGAKERNEL[1]}",
                                "--json", str(out / "decode-llama1b.json")], 240, optional=True),
        Part("graphs-superoptimized", [PY, "benchmark/superoptimize.py", "--backend", "cuda", "--budget", "8",
                                       "--calls", "20", "--fresh", "--no-torch-compile", "--json",
                                       str(out / "superoptimize.json")], 240, optional=True),
    ]


def write_summary(out: Path, header: str, parts: list[Part], note: str) -> str:
    width = max(len(p.name) for p in parts)
    lines = [header, "", f"| {'part':{width}} | status | seconds | result |", f"|{'-' * (width + 2)}|---|---|---|"]
    lines += [f"| {p.name:{width}} | {p.status} | {p.seconds:.0f} | {p.summary.replace('|', '/')} |" for p in parts]
    for p in parts:
        if p.status != "ok" and p.failures:
            lines += ["", f"{p.name} (full log: {p.log}):", *(f"    {line}" for line in p.failures)]
    for extra in ("decode.json", "graphs.json", "decode-variants.json", "grid-barrier.json", "decode-sampled.json",
                  "decode-llama1b.json"):
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
    started = time.monotonic()
    budget = float(os.environ.get("YIRAGE_GPU_CHECK_BUDGET", "480"))
    only = {name for name in os.environ.get("YIRAGE_GPU_CHECK_ONLY", "").split(",") if name}
    chosen = lambda wave: [p for p in wave if not only or p.name in only]  # noqa: E731
    note = ""
    parts: list[Part] = []
    if gpu:
        # the compile-only part runs beside the first wave; the timed parts keep their share of the budget
        waves = parallel_parts(os.cpu_count() or 2)
        waves[0] = compile_only_parts() + waves[0]
        untimed_deadline = started + budget - TIMED_RESERVE
        for wave in map(chosen, waves):
            with ThreadPoolExecutor(max_workers=max(1, len(wave))) as pool:
                parts += list(pool.map(lambda p: p.run(logs, untimed_deadline), wave))
        parts += [p.run(logs, started + budget) for p in chosen(timed_parts(out))]
    else:
        parts = [p.run(logs) for p in chosen(compile_only_parts())]
        note = (f"NO GPU HERE ({what}): only the compile-only part ran. The conformance kit on cuda/triton, the GPU "
                "tests, the LLM tests on the GPU backends and the timed decode need an NVIDIA GPU: run make gpu-check "
                "on a machine with one.")
    header = f"yirage gpu-check: {what}; {time.monotonic() - started:.0f} s in all; logs in {out}"
    print(write_summary(out, header, parts, note))
    return 0 if all(map(passed, parts)) else 1


def passed(part: Part) -> bool:
    """ok; or an optional part (the sanitizers, the Llama-1B decode) that could not run (a tool not installed, the
    budget spent) or ran out of time: slow is never a failure."""
    return part.status == "ok" or part.optional and part.status.startswith(("skipped", "TIMEOUT"))


if __name__ == "__main__":
    raise SystemExit(main())
