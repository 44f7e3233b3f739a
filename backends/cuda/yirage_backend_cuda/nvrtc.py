"""CUDA C -> cubin with NVRTC (``cuda-bindings`` + ``nvidia-cuda-nvrtc`` from PyPI): no GPU, no nvcc.

Why NVRTC: the wheels install anywhere, so CI compiles every generated kernel
for sm_80 and sm_90 on a machine without a GPU. A warning fails the build like
an error does: generated code that makes the compiler warn (an unused value, a
narrowing conversion) is a renderer bug that would otherwise go unseen. When a
``ptxas`` at least as new as NVRTC is on PATH it assembles the PTX a second
time with ``--warning-as-error`` (an independent check of NVRTC's own assembler run).
Everything here is imported lazily: ``import yirage`` never loads NVRTC.
"""

from __future__ import annotations

import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from yirage.errors import NotSupportedError, YirageError

ARCH = re.compile(r"^sm_(\d{2,3})[af]?$")
DEFAULT_OPTIONS = ("--std=c++17",)
#: what the backend adds for rendered plans: no FMA contraction, so results round like the cpu backend's (IEEE)
BUILD_OPTIONS = ("--fmad=false",)
INSTALL = "pip install 'yirage-backend-cuda[nvrtc]' (cuda-bindings, nvidia-cuda-nvrtc, nvidia-cuda-runtime)"
DIAGNOSTIC = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<kind>catastrophic error|error|warning)\b(?P<rest>.*)$")
PtxasMode = Literal["auto", "never", "require"]


class CompileError(YirageError, RuntimeError):
    """CUDA source NVRTC or ptxas rejected or warned about; the message holds the line and the full log.

    ``kinds`` lists each diagnostic's kind as NVRTC spelled it ("error", "warning #177-D"...), so a
    caller can tell a build that failed from one that only warned.
    """

    def __init__(self, message: str, kinds: tuple[str, ...] = ("error",)) -> None:
        super().__init__(message)
        self.kinds = kinds

    @property
    def warnings_only(self) -> bool:
        return bool(self.kinds) and all(k.startswith("warning") for k in self.kinds)


class ToolchainError(NotSupportedError):
    """NVRTC (or a header it needs) is not installed; the message says what to install."""


@dataclass(frozen=True)
class Toolchain:
    """The NVRTC found here: its version, the include directory with cuda_fp16.h, the archs it targets."""

    version: tuple[int, int]
    include_dir: str
    archs: tuple[str, ...]

    def describe(self) -> str:
        return f"NVRTC {self.version[0]}.{self.version[1]}"

    def fingerprint(self) -> str:
        """The version plus a hash of the fp16/bf16 headers: what besides the source decides a cubin."""
        digest = hashlib.sha256()
        for header in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"):
            path = Path(self.include_dir) / header
            digest.update(path.read_bytes() if path.is_file() else b"-")
        return f"{self.describe()}+headers:{digest.hexdigest()[:12]}"


@dataclass(frozen=True)
class Compiled:
    """One compile: the cubin for ``arch``, the PTX it came from, NVRTC's log and what ptxas said."""

    arch: str
    cubin: bytes
    ptx: str
    log: str
    ptxas: str  # "verified by ptxas X.Y" or why ptxas did not run


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise ToolchainError(f"the CUDA backend compiles with NVRTC, which is not installed ({exc}); {INSTALL}") \
            from exc
    return nvrtc


def _check(nvrtc: Any, result: Any, what: str) -> Any:
    """Unpack a cuda-bindings ``(status, *values)`` tuple, raising ToolchainError on a status other than success."""
    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(status)
        raise ToolchainError(f"NVRTC {what} failed: {text.decode(errors='replace')}; reinstall NVRTC: {INSTALL}")
    return values[0] if len(values) == 1 else values


@functools.cache
def toolchain() -> Toolchain:
    """Probe NVRTC once per process; raise ToolchainError saying what to install when it or its headers are missing."""
    nvrtc = _nvrtc()
    try:
        major, minor = _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
    except RuntimeError as exc:  # cuda-bindings raises this when libnvrtc.so cannot be loaded
        raise ToolchainError(f"cuda-bindings is installed but libnvrtc could not be loaded ({exc}); {INSTALL}") \
            from exc
    count = _check(nvrtc, nvrtc.nvrtcGetNumSupportedArchs(), "nvrtcGetNumSupportedArchs")
    archs = tuple(f"sm_{a}" for a in _check(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")[:count])
    try:
        from cuda.pathfinder import locate_nvidia_header_directory

        located = locate_nvidia_header_directory("cudart")
    except ImportError as exc:
        raise ToolchainError(f"cuda-pathfinder (a dependency of cuda-bindings) is missing ({exc}); {INSTALL}") from exc
    if located is None or not (Path(located.abs_path) / "cuda_fp16.h").is_file():
        raise ToolchainError("NVRTC is installed but the CUDA headers (cuda_fp16.h, cuda_bf16.h) are not: "
                             f"pip install nvidia-cuda-runtime, or set CUDA_HOME to a CUDA toolkit; {INSTALL}")
    return Toolchain((int(major), int(minor)), located.abs_path, archs)


def check_arch(arch: str, tools: Toolchain | None = None) -> str:
    """``arch`` when it is an sm_XX NVRTC can build for, else a ToolchainError/ValueError saying what to pass."""
    if not isinstance(arch, str) or not ARCH.match(arch):
        raise ValueError(f"CUDA arch {arch!r} is not of the form 'sm_80' (a real arch; compute_XX gives only PTX)")
    tools = tools or toolchain()
    if arch.rstrip("af") not in tools.archs:
        raise ToolchainError(f"{tools.describe()} cannot build for {arch}; it supports {', '.join(tools.archs)}. "
                             "Install a newer nvidia-cuda-nvrtc, or pick one of those archs")
    return arch


def _diagnostics(log: str) -> list[re.Match[str]]:
    return [m for m in map(DIAGNOSTIC.match, log.splitlines()) if m]


def _compile_error(source: str, name: str, arch: str, tools: Toolchain, log: str, failed: bool) -> CompileError:
    found = _diagnostics(log)
    errors = sum("error" in m["kind"] for m in found)
    warnings = len(found) - errors
    head = f"{tools.describe()} {'could not compile' if failed else 'warned about'} {name} for {arch}"
    first = ""
    if found:
        m = found[0]
        line_no = int(m["line"])
        lines = source.splitlines()
        text = lines[line_no - 1].strip() if m["file"] == name and 0 < line_no <= len(lines) else "?"
        first = f"; first: {name} line {line_no}: {m['kind']}{m['rest']}\n    {line_no} | {text}"
    fix = ("Warnings fail the build too (they flag generated code that is wrong or wasteful). Source rendered by "
           "yirage: a renderer bug, report it with this message; hand-written source: fix that line")
    kinds = tuple(m["kind"] + m["rest"].split(":")[0] for m in found)
    if failed and not errors:  # a failed compile is an error even when its log says otherwise
        kinds += ("error",)
    return CompileError(f"{head}: {errors} error(s), {warnings} warning(s){first}\n{fix}.\nFull NVRTC log:\n{log}",
                        kinds)


def compile_cuda(source: str, arch: str, *, name: str = "kernel.cu", options: tuple[str, ...] = (),
                 ptxas: PtxasMode = "auto") -> Compiled:
    """Compile CUDA C ``source`` to a cubin for ``arch`` (``"sm_80"``); any error or warning raises CompileError.

    ``options`` go to NVRTC after the defaults (C++17, the CUDA headers' include directory).
    ``ptxas``: "auto" re-assembles the PTX with ptxas when one as new as NVRTC is on PATH,
    "require" fails when it cannot, "never" skips it.
    """
    if not isinstance(source, str):
        raise TypeError(f"CUDA source must be a str, not {type(source).__name__}")
    tools = toolchain()
    check_arch(arch, tools)
    nvrtc = _nvrtc()
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in (*DEFAULT_OPTIONS, f"--gpu-architecture={arch}", f"-I{tools.include_dir}",
                                     *options)]
        status, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # NVRTC writes into the buffers it is given: bytearrays, never bytes. A bytes object is immutable, and
        # b" " * 1 is the interpreter's shared one-byte object: an empty log (size 1) written into it turned every
        # later b" " into b"\0" (every space printed through a text stream came out as NUL).
        size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = bytearray(size)
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = bytes(buf).rstrip(b"\0").decode(errors="replace")
        failed = status != nvrtc.nvrtcResult.NVRTC_SUCCESS
        if failed or _diagnostics(log):
            raise _compile_error(source, name, arch, tools, log, failed)
        size = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin_buf = bytearray(size)
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin_buf), "nvrtcGetCUBIN")
        cubin = bytes(cubin_buf)
        size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx_buf = bytearray(size)
        _check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx_buf), "nvrtcGetPTX")
        ptx = bytes(ptx_buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    ptx_text = ptx.rstrip(b"\0").decode()
    return Compiled(arch, cubin, ptx_text, log, verify_ptx(ptx_text, arch, name, tools, ptxas))


@functools.cache
def ptxas_version(path: str) -> tuple[int, int] | None:
    """``ptxas --version``'s release (13, 0), or None when it does not say."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2])) if m else None


def verify_ptx(ptx: str, arch: str, name: str, tools: Toolchain, mode: PtxasMode = "auto") -> str:
    """Assemble ``ptx`` with ptxas, warnings as errors; return what was done or why not (CompileError on failure)."""
    if mode == "never":
        return "ptxas not run (ptxas='never')"
    path = shutil.which("ptxas")
    version = ptxas_version(path) if path else None
    why_not = ("no ptxas on PATH" if path is None else f"{path} does not report its version" if version is None
               else f"ptxas {version[0]}.{version[1]} is older than {tools.describe()}, whose PTX ISA it cannot read "
               f"(pin nvidia-cuda-nvrtc=={version[0]}.{version[1]}.* or put a newer ptxas on PATH)"
               if version < tools.version else "")
    if why_not:
        if mode == "require":
            raise ToolchainError(f"ptxas verification was required but cannot run: {why_not}")
        return f"ptxas not run: {why_not}"
    assert path is not None and version is not None
    with tempfile.TemporaryDirectory(prefix="yirage-ptxas-") as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [path, "--warning-as-error", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "out.cubin")]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if run.returncode != 0 or run.stderr.strip():
        raise CompileError(f"ptxas {version[0]}.{version[1]} rejected the PTX NVRTC made from {name} for {arch} "
                           f"(exit {run.returncode}); a renderer or NVRTC bug: report it with this log:\n"
                           f"{run.stderr}{run.stdout}")
    return f"verified by ptxas {version[0]}.{version[1]}"
