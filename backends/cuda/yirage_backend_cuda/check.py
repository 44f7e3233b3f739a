"""Compile-only checking of CUDA sources for CI and ``tools/yirage_backend_manager.py test cuda``.

There is no GPU in CI, so what can be checked is that every source compiles
with NVRTC for every target arch without an error or warning, gives a cubin
for that arch holding kernels, and (where ptxas can) assembles again with
ptxas. ``compile_check`` compiles everything and reports every failure instead
of stopping at the first, so one run shows the whole picture.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yirage.errors import YirageError
from yirage_backend_cuda.cubin import CubinError, inspect_cubin
from yirage_backend_cuda.nvrtc import BUILD_OPTIONS, CompileError, PtxasMode, check_arch, compile_cuda, toolchain
from yirage_backend_cuda.resources import Resources, ptxas_resources

DEFAULT_ARCHS = ("sm_80", "sm_90")
RECORD_ENV = "YIRAGE_CUDA_RECORD_DIR"  # where record_plans writes the sources it renders


@dataclass(frozen=True)
class CheckFailure:
    """One source that did not compile cleanly for one arch, and the compiler's message."""

    name: str
    arch: str
    message: str
    kinds: tuple[str, ...] = ("error",)  # CompileError.kinds: ("warning #177-D",) when it only warned

    @property
    def warnings_only(self) -> bool:
        return bool(self.kinds) and all(k.startswith("warning") for k in self.kinds)


@dataclass(frozen=True)
class CheckReport:
    """Counts of (source, arch) compiles: passed, ptxas-verified, failed, with the failures and the toolchain."""

    toolchain: str
    archs: tuple[str, ...]
    compiled: int
    ptxas_verified: int
    failures: tuple[CheckFailure, ...] = ()
    notes: tuple[str, ...] = field(default=())  # distinct reasons ptxas did not run
    #: (source, arch, function resources) of every compile, where ``no_spills`` asked ptxas -v for them
    resources: tuple[tuple[str, str, Resources], ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.failures

    def registers(self) -> str:
        """The most registers an entry function uses, per arch, and where (empty without ``resources``)."""
        lines = []
        for arch in self.archs:
            used = [(r.registers, name, r.function) for name, a, r in self.resources if a == arch and r.registers]
            if used:
                most = max(used)
                lines.append(f"{arch}: at most {most[0]} registers ({most[2]} in {most[1]}), "
                             f"{sum(r.spills for _, a, r in self.resources if a == arch)} functions spill")
        return "; ".join(lines)

    def summary(self) -> str:
        """One line for CI logs, then one line per failure."""
        total = self.compiled + len(self.failures)
        lines = [f"cuda compile-only ({self.toolchain}, {', '.join(self.archs)}): {self.compiled}/{total} compiled, "
                 f"{self.ptxas_verified} verified by ptxas, {len(self.failures)} failed"]
        lines += [f"  note: {n}" for n in self.notes]
        if self.resources:
            lines.append(f"  ptxas -v: {self.registers()}")
        lines += [f"  FAIL {f.name} [{f.arch}]: {f.message.splitlines()[0]}" for f in self.failures]
        return "\n".join(lines)


def compile_check(sources: Mapping[str, str], archs: Sequence[str] = DEFAULT_ARCHS, *,
                  options: tuple[str, ...] = (), ptxas: PtxasMode = "auto", workers: int | None = None,
                  no_spills: bool = False, spills_allowed: frozenset[str] = frozenset()) -> CheckReport:
    """Compile every source in ``sources`` ({name: CUDA C}) for every arch in ``archs`` and report the outcome.

    A source fails when NVRTC errors or warns, when ptxas rejects its PTX, or when
    the cubin is not for the arch asked or holds no kernel. ``options`` go to NVRTC
    (rendered plans: ``yirage_backend_cuda.BUILD_OPTIONS``, what the backend builds with).
    ``workers`` threads compile at once (default: one per CPU; NVRTC is thread-safe and
    releases the GIL); failures are listed in the order of ``sources`` and ``archs``.
    ``no_spills`` also assembles each PTX with ``ptxas -v`` (``resources``): a function that spills fails its
    source, and the report keeps every function's registers. A function named in ``spills_allowed`` may spill (the
    report still counts it): the megakernel's dispatcher, whose few stack slots (values kept across its calls of
    the task functions, the call ABI's return address) are read once per task call, not in a task's loop.
    Missing NVRTC raises ToolchainError (nothing can be checked); an unknown arch raises
    before anything compiles.
    """
    if isinstance(archs, str):
        raise TypeError(f"archs must be a sequence such as ('sm_80', 'sm_90'), not the string {archs!r}")
    tools = toolchain()
    archs = tuple(check_arch(a, tools) for a in archs)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers={workers!r} must be a positive int, or None for one per CPU")
    jobs = [(name, source, arch) for name, source in sources.items() for arch in archs]

    used: list[tuple[str, str, Resources]] = []

    def one(job: tuple[str, str, str]) -> CheckFailure | str:
        name, source, arch = job
        try:
            result = compile_cuda(source, arch, name=f"{name}.cu", options=options, ptxas=ptxas)
            info = inspect_cubin(result.cubin)
            if info.arch != arch.rstrip("af") or not info.kernels:
                raise CubinError(f"the cubin is for {info.arch} with kernels {info.kernels}, "
                                 f"expected {arch} with at least one __global__ function")
        except CompileError as exc:
            return CheckFailure(name, arch, str(exc), exc.kinds)
        except CubinError as exc:
            return CheckFailure(name, arch, str(exc))
        if no_spills and result.ptxas.startswith("verified"):  # else the note says why ptxas did not run
            try:
                functions = ptxas_resources(result.ptx, arch)
            except (FileNotFoundError, RuntimeError) as exc:
                return CheckFailure(name, arch, f"the register/spill check (ptxas -v) failed: {exc}")
            used.extend((name, arch, r) for r in functions)
            spilled = [r for r in functions if r.spills and r.function not in spills_allowed]
            if spilled:
                return CheckFailure(name, arch, "ptxas -v: " + "; ".join(
                    f"{r.function} spills {r.spill_stores} bytes stored, {r.spill_loads} loaded" for r in spilled)
                    + ". A spill puts local memory in the loop; render fewer values live at once", ("spill",))
        return result.ptxas

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        outcomes = list(pool.map(one, jobs))
    failures = tuple(o for o in outcomes if isinstance(o, CheckFailure))
    passed = [o for o in outcomes if isinstance(o, str)]
    verified = sum(o.startswith("verified") for o in passed)
    notes = tuple(dict.fromkeys(o for o in passed if not o.startswith("verified")))
    order = {(name, arch): i for i, (name, _, arch) in enumerate(jobs)}
    used.sort(key=lambda u: order[u[0], u[1]])
    return CheckReport(tools.describe(), archs, len(passed), verified, failures, notes, tuple(used))


def conformance_sources(*, timeout: float = 900) -> dict[str, str]:
    """The CUDA source of every distinct plan the conformance kit compiles, and of its seeded random graphs.

    The kit (``yirage.testing.conformance``) runs in a child pytest on the reference
    backend with ``record_plans`` rendering each plan it compiles; the random-graph
    cases (skipped on reference) are rendered here from the same seeds the kit uses.
    """
    from yirage.backend.selection import registry
    from yirage.compiler.lower import build_plan
    from yirage.testing.plugin import RANDOM_GRAPHS
    from yirage.testing.random_graphs import seeded_graph
    with tempfile.TemporaryDirectory(prefix="yirage-cuda-plans-") as tmp:
        cmd = [sys.executable, "-m", "pytest", "--pyargs", "yirage.testing.conformance", "-q", "-x",
               "--yirage-backend", "reference", "-p", "yirage_backend_cuda.record_plans", "-p", "no:cacheprovider"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                             env={**os.environ, RECORD_ENV: tmp})
        if run.returncode != 0:
            raise YirageError(f"the conformance kit failed on the reference backend while its plans were recorded "
                              f"(exit {run.returncode}); fix that first (needs pytest installed). Its output:\n"
                              f"{run.stdout[-4000:]}{run.stderr[-4000:]}")
        sources = {p.stem: p.read_text(encoding="utf-8") for p in sorted(Path(tmp).glob("*.cu"))}
    cuda = registry().get("cuda")
    sources.update({f"seed{s}": cuda.render(build_plan(seeded_graph(s))) for s in range(RANDOM_GRAPHS)})
    sources.update({name: cuda.render(build_plan(g)) for name, g in gemm_graphs().items()})
    # with kernels set to Triton (YIRAGE_CUDA_KERNELS) a source also holds the Triton module: NVRTC gets the CUDA C,
    # which always has every kernel of the plan
    from yirage_backend_cuda.mixed import split_source

    return {name: split_source(source, name)[0] for name, source in sources.items()}


def gemm_graphs() -> dict[str, Any]:
    """Graphs whose matmuls the renderer splits around a GEMM step (the kit's are too small for that), so the
    compile check covers prologue, epilogue and fallback kernels: a W1-like RMSNorm * gain @ W + residual, a
    float64 batch-broadcast product with exp/silu, a batched product with relu, a bare product (no epilogue)."""
    import yirage as yr

    graphs = {}
    g = yr.new_kernel_graph()
    x, gain, r = g.new_input((64, 4096)), g.new_input((4096,)), g.new_input((64, 4096))
    w = g.new_input((4096, 4096), strides=(1, 4096))
    g.mark_output(g.add(g.matmul(g.mul(g.rms_norm(x, (4096,)), gain), w), r))
    graphs["gemm_w1"] = g
    g = yr.new_kernel_graph()
    a, b = g.new_input((4, 64, 64), dtype=yr.float64), g.new_input((64, 64), dtype=yr.float64)
    g.mark_output(g.silu(g.matmul(g.exp(a), b)))
    graphs["gemm_f64_broadcast"] = g
    g = yr.new_kernel_graph()
    g.mark_output(g.relu(g.matmul(g.new_input((2, 64, 64)), g.new_input((2, 64, 64)))))
    graphs["gemm_batched_relu"] = g
    g = yr.new_kernel_graph()
    g.mark_output(g.matmul(g.new_input((64, 128)), g.new_input((128, 64))))
    graphs["gemm_bare"] = g
    return graphs


def check_conformance(archs: Sequence[str] = DEFAULT_ARCHS, *, workers: int | None = None) -> CheckReport:
    """``compile_check`` of every conformance plan with the backend's build options: CI's compile-only CUDA test."""
    return compile_check(conformance_sources(), archs, options=BUILD_OPTIONS, workers=workers)


#: the PersistentKernel programs the compile-only check renders: (name, config.json overrides, dtype, batch,
#: sampling); two layers each (layers of one shape share their kernels, so more layers add no kernel text)
PK_MODELS = (
    ("llama-gqa-f32", {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 8,
                       "num_key_value_heads": 2, "vocab_size": 320}, "float32", 2, False),
    ("qwen2-bias-tied-bf16-sampling", {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
                                       "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 288,
                                       "tie_word_embeddings": True}, "bfloat16", 2, True),
    ("llama-f16", {"hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6,
                   "num_key_value_heads": 2, "vocab_size": 256}, "float16", 1, False),
    ("smollm2-shape-bf16", {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                            "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True},
     "bfloat16", 1, False),
)


def persistent_sources() -> dict[str, str]:
    """The CUDA sources the cuda PersistentKernel runtimes build for each of ``PK_MODELS`` (random weights): the
    launched runtime's task kernels and the resident megakernel."""
    import torch

    from yirage.models.config import LlamaConfig
    from yirage.models.llama import LlamaModel
    from yirage_backend_cuda.megakernel import render_megakernel
    from yirage_backend_cuda.pk_runtime import render_cuda

    sources = {}
    for name, overrides, dtype, batch, sampling in PK_MODELS:
        config = LlamaConfig.from_dict({"model_type": "llama", "num_hidden_layers": 2, **overrides})
        gen = torch.Generator().manual_seed(0)
        weights = {n: torch.randn(shape, generator=gen) * 0.1 for n, shape in config.weight_shapes().items()
                   if not (config.tie_embeddings and n == "lm_head.weight")}
        model = LlamaModel(config, weights, dtype)
        model.reset_cache(batch, 32)
        tokens, step = torch.zeros(batch, 32, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64)
        picking = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1} if sampling else None
        program = model.build_decoder(step, tokens, backend="reference", sampling=picking).program
        sources[f"pk-{name}"] = render_cuda(program).source
        sources[f"megakernel-{name}"] = render_megakernel(program).source
        if name == PK_MODELS[0][0]:  # the other synchronizations (YIRAGE_CUDA_GRID_SYNC=tree / events) once
            for sync in ("tree", "events"):
                sources[f"megakernel-{sync}-{name}"] = render_megakernel(program, grid_sync=sync).source
    return sources


def check_persistent(archs: Sequence[str] = DEFAULT_ARCHS, *, workers: int | None = None) -> CheckReport:
    """``compile_check`` of the cuda PersistentKernel runtime's sources (``persistent_sources``), with the build
    options it uses and no spills allowed: the PersistentKernel half of the compile-only CUDA check."""
    from yirage_backend_cuda.megakernel import KERNEL

    return compile_check(persistent_sources(), archs, options=BUILD_OPTIONS, workers=workers, no_spills=True,
                         spills_allowed=frozenset({KERNEL}))
