"""HIP source -> AMD GPU code object with hipcc, where a HIP toolchain is installed (Hygon DCU, AMD).

The HIP dialect of the core's C-family renderer is compiled here for one gfx
target with ``-Wall -Werror``: generated code that makes clang warn is a
renderer bug. ``hipcc`` runs with ``HIP_PLATFORM=amd`` (a machine with nvcc
would otherwise pick the NVIDIA path) and ``--genco``, which writes a clang
offload bundle holding the gfx code object. Nothing needs a GPU.

``check_conformance`` compiles every plan the conformance kit builds (recorded
by running the kit on the reference backend in a child pytest, with this module
loaded as a pytest plugin) plus the kit's seeded random graphs. One hipcc run
costs ~0.8 s, so sources with the same ``#include`` lines are compiled together,
up to ``BATCH`` of them as one translation unit, each in a namespace of its own
with its kernels renamed (batches run in parallel); when a batch fails, each of its sources is compiled on its own, as
rendered, so a failure names its plan and the compiler's message.

Where the toolchain lacks ``hip/hip_bf16.h`` (ROCm 5.x; ROCm 6 ships it),
bfloat16 plans are reported as not compiled, with that reason, instead of failing.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yirage.errors import NotSupportedError, YirageError

ARCH = re.compile(r"^gfx[0-9]{2,4}[0-9a-f]?$")
DEFAULT_ARCH = "gfx906"  # Hygon DCU Z100's ISA family (MI50/MI60); clang 15 and newer know it
OPTIONS = ("-O3", "-ffp-contract=off", "-Wall", "-Werror")  # no FMA contraction: IEEE like the cpu backend
RECORD_ENV = "YIRAGE_HIP_RECORD_DIR"  # where the child pytest pickles the plans the kit compiles
INSTALL = ("install ROCm's hipcc (e.g. `apt-get install hipcc libamdhip64-dev` on Debian/Ubuntu, or the ROCm/DTK "
           "packages of your distribution) and put it on PATH, or set HIPCC to its path")
BF16_HEADER = "hip/hip_bf16.h"
BATCH = 48  # sources per hipcc run: its start-up is amortized, and batches run one per CPU
KERNEL = re.compile(r'^(extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?)(\w+)\(', re.M)


class HipToolchainError(NotSupportedError):
    """No usable hipcc here; the message says what to install."""


class HipCompileError(YirageError, RuntimeError):
    """hipcc rejected (or warned about) a source; the message holds its diagnostics."""


@dataclass(frozen=True)
class HipToolchain:
    """The hipcc found here, its HIP and clang versions, and whether it has ``hip/hip_bf16.h``."""

    hipcc: str
    hip_version: str
    clang: str
    has_bf16: bool

    def describe(self) -> str:
        return f"hipcc (HIP {self.hip_version}, {self.clang})"


def _env() -> dict[str, str]:
    return {**os.environ, "HIP_PLATFORM": "amd"}


@functools.cache
def toolchain() -> HipToolchain:
    """The hipcc on PATH (or ``$HIPCC``), probed once per process; HipToolchainError says why there is none."""
    hipcc = os.environ.get("HIPCC") or shutil.which("hipcc")
    if not hipcc:
        raise HipToolchainError(f"no hipcc on PATH and $HIPCC is unset; {INSTALL}")
    try:
        run = subprocess.run([hipcc, "--version"], capture_output=True, text=True, timeout=120, env=_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HipToolchainError(f"{hipcc} --version did not run ({exc}); {INSTALL}") from exc
    version = re.search(r"HIP version: (\S+)", run.stdout)
    clang = re.search(r"^(.*clang version \S+)", run.stdout, re.M)
    if version is None or clang is None:
        raise HipToolchainError(f"{hipcc} --version printed no HIP and clang version (is it ROCm's hipcc?): "
                                f"{(run.stdout + run.stderr)[-500:]}; {INSTALL}")
    partial = HipToolchain(hipcc, version.group(1), clang.group(1), has_bf16=False)
    probe = f"#include <{BF16_HEADER}>\n__global__ void k(__hip_bfloat16* p) {{ p[0] = __float2bfloat16(1.0f); }}\n"
    try:
        _run_hipcc(partial, probe, DEFAULT_ARCH, "bf16_probe.hip", OPTIONS)
        has_bf16 = True
    except HipCompileError as exc:
        if f"'{BF16_HEADER}' file not found" not in str(exc):
            raise HipToolchainError(f"{hipcc} cannot compile a two-line kernel for {DEFAULT_ARCH}: {exc}") from exc
        has_bf16 = False  # an older ROCm: bfloat16 plans are reported as not compiled, with this reason
    return HipToolchain(hipcc, version.group(1), clang.group(1), has_bf16)


def check_arch(arch: str) -> str:
    if not isinstance(arch, str) or not ARCH.match(arch):
        raise ValueError(f"arch {arch!r} is not an AMD GPU target; use one such as 'gfx906' (Hygon Z100, MI50), "
                         "'gfx90a' (MI210/MI250) or 'gfx942' (MI300)")
    return arch


def _run_hipcc(tools: HipToolchain, source: str, arch: str, name: str, options: tuple[str, ...]) -> bytes:
    with tempfile.TemporaryDirectory(prefix="yirage-hip-") as tmp:
        src, out = Path(tmp) / name, Path(tmp) / "out.co"
        src.write_text(source, encoding="utf-8")
        cmd = [tools.hipcc, f"--offload-arch={arch}", "--genco", *options, "-o", str(out), str(src)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise HipCompileError(f"hipcc did not finish compiling {name} for {arch} in {exc.timeout:.0f} s") from exc
        log = (run.stdout + run.stderr).replace(tmp + "/", "")
        if run.returncode != 0 or re.search(r"\bwarning:", log):
            first = next((line for line in log.splitlines() if re.search(r"\b(error|warning):", line)),
                         log.strip().splitlines()[-1] if log.strip() else f"exit status {run.returncode}")
            raise HipCompileError(f"hipcc rejected {name} for {arch}: {first}\n{log}")
        code = out.read_bytes() if out.is_file() else b""
    if f"amdgcn-amd-amdhsa--{arch}".encode() not in code:
        raise HipCompileError(f"hipcc compiled {name} but its output holds no code object for {arch} "
                              f"({len(code)} bytes)")
    return code


def compile_hip(source: str, arch: str = DEFAULT_ARCH, *, name: str = "kernels.hip",
                options: tuple[str, ...] = OPTIONS) -> bytes:
    """The offload bundle hipcc makes of ``source`` for ``arch``; any error or warning raises HipCompileError."""
    return _run_hipcc(toolchain(), source, check_arch(arch), name, tuple(options))


@dataclass(frozen=True)
class HipCheckReport:
    """Sources compiled cleanly, failed (name, message), or not compiled for want of a header (name, reason)."""

    toolchain: str
    arch: str
    compiled: int
    failures: tuple[tuple[str, str], ...] = ()
    not_compiled: tuple[tuple[str, str], ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        total = self.compiled + len(self.failures) + len(self.not_compiled)
        lines = [f"hip compile-only ({self.toolchain}, {self.arch}): {self.compiled}/{total} compiled, "
                 f"{len(self.failures)} failed, {len(self.not_compiled)} not compiled"]
        lines += [f"  not compiled: {r} ({sum(1 for _, x in self.not_compiled if x == r)} source(s))"
                  for r in dict.fromkeys(r for _, r in self.not_compiled)]
        lines += [f"  FAIL {name}: {message.splitlines()[0]}" for name, message in self.failures]
        return "\n".join(lines)


def batch_source(sources: Mapping[str, str]) -> str:
    """One translation unit of sources sharing their #include lines: each in ``namespace b<i>``, kernels renamed."""
    includes: list[str] = []
    body: list[str] = []
    for i, source in enumerate(sources.values()):
        lines = source.splitlines()
        includes += [line for line in lines if line.startswith("#include")]
        rest = "\n".join(line for line in lines if not line.startswith("#include"))
        body += [f"namespace b{i} {{", KERNEL.sub(rf"\g<1>b{i}_\g<2>(", rest), f"}}  // namespace b{i}"]
    return "\n".join([*dict.fromkeys(includes), *body]) + "\n"


def check_sources(sources: Mapping[str, str], arch: str = DEFAULT_ARCH) -> HipCheckReport:
    """Compile every source in ``sources`` ({name: HIP C++}) for ``arch`` and report every failure."""
    tools = toolchain()
    arch = check_arch(arch)
    not_compiled = []
    groups: dict[tuple[str, ...], dict[str, str]] = {}
    for name, source in sources.items():
        if BF16_HEADER in source and not tools.has_bf16:
            not_compiled.append((name, f"HIP {tools.hip_version} has no {BF16_HEADER} (__hip_bfloat16); ROCm 6 "
                                       "ships it"))
            continue
        key = tuple(line for line in source.splitlines() if line.startswith("#include"))
        groups.setdefault(key, {})[name] = source
    batches = [dict(items[i:i + BATCH]) for group in groups.values()
               for items in [list(group.items())] for i in range(0, len(items), BATCH)]

    def one(batch: dict[str, str]) -> list[tuple[str, str | None]]:
        """(name, None) for each source that compiled, (name, message) for each that did not."""
        try:
            _run_hipcc(tools, batch_source(batch), arch, "batch.hip", OPTIONS)
            return [(name, None) for name in batch]
        except HipCompileError as exc:
            batch_error = str(exc)  # find out which sources failed, one by one, as rendered
        outcomes: list[tuple[str, str | None]] = []
        for name, source in batch.items():
            try:
                _run_hipcc(tools, source, arch, f"{name}.hip", OPTIONS)
                outcomes.append((name, None))
            except HipCompileError as exc:
                outcomes.append((name, str(exc)))
        if all(message is None for _, message in outcomes):  # only the batch failed: a bug here, not hidden
            outcomes.append((f"batch of {', '.join(batch)}", f"batching broke sources that compile alone: "
                                                             f"{batch_error}"))
        return outcomes

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # each hipcc is a process of its own
        outcomes = [o for batch in pool.map(one, batches) for o in batch]
    failures = tuple((name, message) for name, message in outcomes if message is not None)
    compiled = sum(1 for name, message in outcomes if message is None)
    return HipCheckReport(tools.describe(), arch, compiled, failures, tuple(not_compiled))


def conformance_plans(*, timeout: float = 900) -> dict[str, Any]:
    """Every distinct KernelPlan the conformance kit compiles (by digest), and the kit's seeded random graphs.

    The kit runs on the reference backend in a child pytest with this module as a
    plugin, which pickles each plan into a private temporary directory it alone writes.
    Recorded once per process (plans are immutable); each call returns a new dict.
    """
    return dict(_recorded_plans(timeout))


@functools.cache
def _recorded_plans(timeout: float) -> dict[str, Any]:
    from yirage.compiler.lower import build_plan
    from yirage.testing.plugin import RANDOM_GRAPHS
    from yirage.testing.random_graphs import seeded_graph

    with tempfile.TemporaryDirectory(prefix="yirage-kit-plans-") as tmp:
        cmd = [sys.executable, "-m", "pytest", "--pyargs", "yirage.testing.conformance", "-q", "-x",
               "--yirage-backend", "reference", "-p", __name__, "-p", "no:cacheprovider"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                             env={**os.environ, RECORD_ENV: tmp})
        if run.returncode != 0:
            raise YirageError(f"the conformance kit failed on the reference backend while its plans were recorded "
                              f"(exit {run.returncode}); fix that first. Its output:\n"
                              f"{run.stdout[-4000:]}{run.stderr[-4000:]}")
        plans = {p.stem: pickle.loads(p.read_bytes()) for p in sorted(Path(tmp).glob("*.plan"))}
    plans.update({f"seed{s}": build_plan(seeded_graph(s)) for s in range(RANDOM_GRAPHS)})
    return plans


def check_conformance(arch: str = DEFAULT_ARCH) -> HipCheckReport:
    """``check_sources`` of the HIP rendering of every conformance plan: the compile-only HIP check."""
    from yirage.codegen.cstyle import render_plan
    from yirage.codegen.dialects import dialect

    hip = dialect("hip")
    return check_sources({name: render_plan(plan, hip) for name, plan in conformance_plans().items()}, arch)


def pytest_configure(config: Any) -> None:
    """As a pytest plugin (``-p yirage_backend_domestic.hip_build``) with $YIRAGE_HIP_RECORD_DIR set:
    pickle every plan the reference backend compiles into that directory, then compile it as usual."""
    directory = os.environ.get(RECORD_ENV)
    if not directory:
        raise RuntimeError(f"yirage_backend_domestic.hip_build as a pytest plugin needs ${RECORD_ENV} (a directory "
                           "to write plans to); it is meant to be loaded by hip_build.conformance_plans()")
    from yirage.reference.backend import ReferenceBackend

    original = ReferenceBackend.compile

    def recording_compile(self: ReferenceBackend, plan: Any, graph: Any) -> Any:
        (Path(directory) / f"{plan.digest[:16]}.plan").write_bytes(pickle.dumps(plan))
        return original(self, plan, graph)

    ReferenceBackend.compile = recording_compile  # type: ignore[method-assign]
