"""llama.cpp as a decode peer: build ``llama-bench`` once, export GGUF files, time decode.

llama.cpp is built from the source the ``llama-cpp-python`` sdist vendors
(``vendor/llama.cpp``), fetched with pip from PyPI, the one registry this
project assumes reachable. The binary is cached outside the repository in
``$YIRAGE_LLAMA_CPP_DIR``, else ``<yirage cache>/llama.cpp/<version>/``
(``~/.cache/yirage/llama.cpp/...``); a lock file keeps two processes from
building at once, and the binary is copied in under a temporary name and
renamed, so a killed build never leaves a half-written ``llama-bench``.

    python benchmark/llama_cpp_peer.py [--tokens 64] [--depth 16] [--threads 2] [--repeats 3] [--dtypes F32 ...]
                                       [--json]

builds llama.cpp (5-10 minutes on 2 cores, once), re-types the SmolLM2-135M
GGUF model to each dtype (read dequantized to f32 by yirage's loader, written
by ``yirage.models.gguf_export``) and prints llama.cpp's decode ms/token.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"  # newest llama-cpp-python sdist on PyPI when this was written (2026-11)
ENV = "YIRAGE_LLAMA_CPP_DIR"  # a directory for the build (or an existing build) instead of the yirage cache
CMAKE_FLAGS = (
    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary: it can be moved out of the build tree
)
BENCH_DTYPES = ("F32", "BF16", "F16", "Q8_0", "Q4_0")


class LlamaCppError(RuntimeError):
    """llama.cpp could not be built or run; the message names the cause and the fix."""


def log(*args: Any) -> None:
    print("[llama.cpp]", *args, file=sys.stderr, flush=True)


AMX_ENV = "YIRAGE_LLAMA_CPP_AMX"  # 0: build llama.cpp without AMX (where its AMX matmul dies of SIGILL)
#: a GCC/Clang -march (e.g. skylake-avx512): llama.cpp built for that instruction set instead of this CPU's, cached
#: apart. With NUMBA_CPU_NAME set to the same CPU for yirage, both peers run an older CPU's instructions on this one's
#: memory system: how "an Intel machine without AVX-512 BF16" is measured where none is at hand.
MARCH_ENV = "YIRAGE_LLAMA_CPP_MARCH"


def amx_off() -> bool:
    """``$YIRAGE_LLAMA_CPP_AMX=0``: build (and cache apart) a llama.cpp whose kernels use no AMX instruction."""
    return os.environ.get(AMX_ENV, "1").strip() == "0"


def march() -> str | None:
    """``$YIRAGE_LLAMA_CPP_MARCH``: the -march llama.cpp is built for (None: this CPU's); a name of letters, digits,
    '-' and '_' only (it becomes a compiler flag and a directory name)."""
    value = os.environ.get(MARCH_ENV, "").strip()
    if not value:
        return None
    if not all(c.isalnum() or c in "-_" for c in value):
        raise LlamaCppError(f"${MARCH_ENV}={value!r} is not a -march name; use e.g. skylake-avx512, or unset it")
    return value


def cmake_flags() -> tuple[str, ...]:
    """``CMAKE_FLAGS``, or with ``amx_off()`` the host's own instruction set without AMX: ``-march=native
    -mno-amx-*`` as the compilers' flags (ggml's native mode appends ``-march=native`` after them, which would
    turn AMX back on, so it is off, and its default x86 options only repeat what ``-march=native`` holds). With
    ``march()``, that CPU's instruction set instead (AMX only where that CPU has it)."""
    target = march()
    if target is None and not amx_off():
        return CMAKE_FLAGS
    native = f"-march={target}" if target else "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return (*(f for f in CMAKE_FLAGS if f != "-DGGML_NATIVE=ON"), "-DGGML_NATIVE=OFF",
            f"-DCMAKE_C_FLAGS={native}", f"-DCMAKE_CXX_FLAGS={native}")


def cache_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    """Where the ``llama-bench`` of this llama-cpp-python version lives (created 0700 if missing); a build
    without AMX (``amx_off``) lives in its own ``-no-amx`` directory, one for another CPU (``march``) in
    ``-march-<name>``."""
    given = os.environ.get(ENV)
    if given:
        path = Path(given).expanduser().absolute()
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise LlamaCppError(f"${ENV}={given!r} cannot be created ({exc}); point it at a writable directory "
                                "or unset it to use the yirage cache") from exc
        return path
    from yirage.compiler.cache import private_dir, private_root

    target = march()
    variant = f"-march-{target}" if target else "-no-amx" if amx_off() else ""
    return private_dir(private_root() / "llama.cpp" / f"{version}{variant}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another process is building llama.cpp (lock {path}); waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str, cwd: Path | None = None, quiet: bool = False) -> None:
    log(f"{what}: {' '.join(cmd)}")
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, text=True, check=False,
                          stdout=subprocess.PIPE if quiet else sys.stderr,
                          stderr=subprocess.STDOUT if quiet else sys.stderr)
    if done.returncode:
        tail = (done.stdout or "").strip()[-1500:]
        raise LlamaCppError(f"{what} failed (exit {done.returncode}): `{' '.join(cmd)}`{': ' + tail if tail else ''}; "
                            "see the output above, check that cmake and a C++ compiler are installed and PyPI "
                            f"is reachable, or set ${ENV} to a directory holding a built llama-bench")
    log(f"{what}: done in {time.perf_counter() - start:.0f} s")


def _unpack_sdist(tmp: Path, version: str) -> Path:
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
          "--disable-pip-version-check", f"llama-cpp-python=={version}", "-d", str(tmp)],
         "downloading the llama-cpp-python sdist")
    archives = list(tmp.glob("llama_cpp_python-*.tar.gz")) + list(tmp.glob("llama-cpp-python-*.tar.gz"))
    if not archives:
        raise LlamaCppError(f"pip downloaded no llama-cpp-python {version} sdist into {tmp}; check that PyPI "
                            "serves it, or pin another version in benchmark/llama_cpp_peer.py")
    log(f"unpacking {archives[0].name}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(tmp / "src", filter="data")
    roots = [p for p in (tmp / "src").iterdir() if (p / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file()]
    if not roots:
        raise LlamaCppError(f"{archives[0].name} has no vendor/llama.cpp/CMakeLists.txt; the sdist layout "
                            "changed: pin another llama-cpp-python version in benchmark/llama_cpp_peer.py")
    return roots[0] / "vendor" / "llama.cpp"


BINARIES = ("llama-bench", "llama-batched-bench")  # one sequence's pp/tg; concurrent sequences (-npl)


def llama_bench_path(version: str = LLAMA_CPP_PYTHON) -> Path:
    """The cached ``llama-bench`` binary, built from llama-cpp-python's vendored llama.cpp on first use."""
    return llama_binary("llama-bench", version)


def llama_binary(name: str, version: str = LLAMA_CPP_PYTHON) -> Path:
    """The cached llama.cpp tool ``name`` (one of ``BINARIES``); every one of them is built on first use, in
    one build (an older cache holding only some of them is completed)."""
    if name not in BINARIES:
        raise ValueError(f"unknown llama.cpp tool {name!r}; one of {', '.join(BINARIES)}")
    root = cache_dir(version)
    binary = root / name
    if all((root / b).is_file() and os.access(root / b, os.X_OK) for b in BINARIES):
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaCppError(f"building llama.cpp needs {tool!r} on PATH; install it (e.g. apt-get install "
                                f"cmake g++), or set ${ENV} to a directory holding a built {name}")
    with _locked(root / "build.lock"):
        if all((root / b).is_file() for b in BINARIES):  # another process built them while we waited
            return binary
        for stale in root.glob("build-*"):  # left by a killed build (we hold the lock: nobody else is building)
            log(f"removing {stale}, left by an interrupted build")
            shutil.rmtree(stale)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="build-", dir=root) as tmp_name:
            tmp = Path(tmp_name)
            src = _unpack_sdist(tmp, version)
            build = tmp / "build"
            _run(["cmake", "-S", str(src), "-B", str(build), *cmake_flags()], "configuring llama.cpp", quiet=True)
            jobs = str(max(1, min(2, os.cpu_count() or 1)))
            targets = [arg for b in BINARIES for arg in ("--target", b)]
            _run(["cmake", "--build", str(build), "-j", jobs, *targets],
                 f"building {' and '.join(BINARIES)} with {jobs} jobs (5-10 minutes on 2 cores)")
            for b in BINARIES:
                built = next(iter(build.glob(f"bin/{b}")), None)
                if built is None:
                    raise LlamaCppError(f"the build finished but {build}/bin/{b} is missing; the llama.cpp "
                                        "layout changed: pin another llama-cpp-python version in "
                                        "benchmark/llama_cpp_peer.py")
                part = root / f"{b}.part"
                shutil.copy2(built, part)
                os.chmod(part, 0o700)
                os.replace(part, root / b)
        log(f"{', '.join(BINARIES)} {version} built in {time.perf_counter() - start:.0f} s: {root}")
    return binary


def bench_decode(gguf_path: str | Path, tokens: int = 64, threads: int = 2, repeats: int = 1, *,
                 depth: int = 0, binary: Path | None = None) -> dict[str, Any]:
    """llama.cpp's decode speed on one GGUF file: ``ms_per_token``, ``tok_per_s`` and the raw llama-bench row.

    Runs ``llama-bench -p 0 -n tokens`` (text generation only, flash attention off) and
    reads its JSON; ms/token is avg_ns / tokens, and min/max come from its samples.
    ``depth``: tokens already in the KV cache before the timed ones (``-d``; e.g. 16 to
    time decode after a 16-token prompt, as yirage's benchmark does).
    """
    row = _llama_bench(gguf_path, 0, tokens, threads, repeats, depth, binary)
    samples_ns = [float(s) for s in row["samples_ns"]]
    per_token = [s / tokens / 1e6 for s in samples_ns]
    ms = float(row["avg_ns"]) / tokens / 1e6
    return {"ms_per_token": ms, "tok_per_s": 1e3 / ms, "min_ms": min(per_token), "max_ms": max(per_token),
            "samples_ms": per_token, "threads": threads, "tokens": tokens, "depth": depth,
            "build_commit": row.get("build_commit"), "model_type": row.get("model_type"),
            "model_size": row.get("model_size"), "raw": row}


def bench_prompt(gguf_path: str | Path, tokens: int, threads: int = 2, repeats: int = 1, *,
                 binary: Path | None = None) -> dict[str, Any]:
    """llama.cpp's prompt processing of ``tokens`` tokens into an empty cache (``-p tokens -n 0``): ``seconds``
    (the mean over ``repeats``, the time to the first token's logits), ``tok_per_s`` and the raw row."""
    row = _llama_bench(gguf_path, tokens, 0, threads, repeats, 0, binary)
    seconds = float(row["avg_ns"]) / 1e9
    return {"seconds": seconds, "tok_per_s": tokens / seconds, "threads": threads, "tokens": tokens, "raw": row}


def bench_batched(gguf_path: str | Path, batch: int, prompt: int, gen: int, threads: int = 2, *,
                  binary: Path | None = None) -> dict[str, Any]:
    """llama.cpp's decode of ``batch`` concurrent sequences (``llama-batched-bench -npl batch``): each sequence's
    ``prompt`` tokens prefilled (not shared: ``batch`` x ``prompt`` tokens, ``pp_seconds``), then ``gen``
    steps of ``batch`` tokens each (``tg_seconds``; ``ms_per_step``), flash attention off, as yirage's
    benchmark runs a batch. Its JSONL row is under ``raw``."""
    path = Path(gguf_path)
    if not path.is_file():
        raise LlamaCppError(f"GGUF file {str(path)!r} does not exist; export one with "
                            "yirage.models.gguf_export.export_gguf first")
    for name, value in (("batch", batch), ("prompt", prompt), ("gen", gen), ("threads", threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LlamaCppError(f"llama-batched-bench {name}={value!r} must be an int >= 1")
    binary = binary or llama_binary("llama-batched-bench")
    ctx = batch * (prompt + gen)
    cmd = [str(binary), "-m", str(path), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt),
           "-ntg", str(gen), "-npl", str(batch), "-t", str(threads), "-tb", str(threads), "-fa", "off",
           "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise _failed(cmd, done)
    try:
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        row = next(r for r in rows if r["pl"] == batch and r["pp"] == prompt and r["tg"] == gen)
        pp, tg = float(row["t_pp"]), float(row["t_tg"])
    except (json.JSONDecodeError, StopIteration, KeyError, TypeError, ValueError) as exc:
        raise LlamaCppError(f"cannot read llama-batched-bench's JSONL ({type(exc).__name__}: {exc}); output began "
                            f"{done.stdout[:300]!r}: its output format changed, update benchmark/llama_cpp_peer.py"
                            ) from exc
    return {"pp_seconds": pp, "tg_seconds": tg, "ms_per_step": tg / gen * 1e3, "batch": batch, "prompt": prompt,
            "gen": gen, "threads": threads, "raw": row}


def _llama_bench(gguf_path: str | Path, prompt: int, gen: int, threads: int, repeats: int, depth: int,
                 binary: Path | None) -> dict[str, Any]:
    """The JSON row of one llama-bench test: a ``prompt``-token prompt or ``gen`` generated tokens, after
    ``depth`` cached tokens (flash attention off, as yirage's attention)."""
    path = Path(gguf_path)
    if not path.is_file():
        raise LlamaCppError(f"GGUF file {str(path)!r} does not exist; export one with "
                            "yirage.models.gguf_export.export_gguf first")
    for name, value, least in (("tokens", prompt or gen, 1), ("threads", threads, 1), ("repeats", repeats, 1),
                               ("depth", depth, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise LlamaCppError(f"llama-bench {name}={value!r} must be an int >= {least}")
    binary = binary or llama_bench_path()
    cmd = [str(binary), "-m", str(path), "-p", str(prompt), "-n", str(gen), "-t", str(threads), "-r", str(repeats),
           "-d", str(depth), "-fa", "0", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise _failed(cmd, done)
    try:
        row = next(r for r in json.loads(done.stdout) if r.get("n_gen", 0) == gen and
                   r.get("n_prompt", 0) == prompt and r.get("n_depth", 0) == depth)
        float(row["avg_ns"])
        return row
    except (json.JSONDecodeError, StopIteration, KeyError, TypeError, ValueError) as exc:
        raise LlamaCppError(f"cannot read llama-bench's JSON ({type(exc).__name__}: {exc}); output began "
                            f"{done.stdout[:300]!r}: the llama-bench output format changed, update "
                            "benchmark/llama_cpp_peer.py") from exc


def _failed(cmd: list[str], done: subprocess.CompletedProcess[str]) -> LlamaCppError:
    """Why a llama.cpp tool failed, with the fix: SIGILL is an instruction the machine refuses (seen: ggml's
    AMX matmul on an Emerald Rapids VM whose kernel granted AMX; its ``tilezero`` faulted in a worker thread
    while a standalone probe of the same steps ran), else the file."""
    head = f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}; "
    if done.returncode in (-4, 132) and not amx_off():  # SIGILL, killed directly or through a shell
        return LlamaCppError(head + "it died of an illegal instruction: the build targets this CPU "
                             "(-march=native), so most likely its AMX matmul (a quantized prompt) met a machine "
                             f"or sandbox that does not run AMX fully; rerun with {AMX_ENV}=0 (a build without "
                             "AMX, cached apart)")
    return LlamaCppError(head + "llama.cpp could not load or run the file: check it with "
                         "yirage.models.gguf.read_gguf")


def export_smollm2(dtypes: tuple[str, ...] = BENCH_DTYPES, out_dir: Path | None = None) -> dict[str, Path]:
    """The SmolLM2-135M GGUF model re-typed to each dtype, from its Q4_1 file read as f32.

    The files are cached in ``out_dir`` (default ``<llama.cpp cache>/models``) by name:
    delete them after changing the exporter.
    """
    from yirage.models.downloads import smollm2_gguf
    from yirage.models.gguf import read_gguf
    from yirage.models.gguf_export import export_gguf

    source = smollm2_gguf()
    out_dir = out_dir or cache_dir() / "models"
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {d: out_dir / f"SmolLM2-135M-Instruct.{d}.gguf" for d in dtypes}
    todo = [d for d, p in paths.items() if not p.is_file()]
    if todo:
        config, weights, _ = read_gguf(source)
        for d in todo:
            log(f"exporting {paths[d].name}")
            export_gguf(paths[d], config, weights, d, tokenizer_from=source)  # written atomically
    return paths


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=16, help="prompt tokens in the KV cache before timing")
    parser.add_argument("--dtypes", nargs="+", default=list(BENCH_DTYPES), choices=BENCH_DTYPES)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    binary = llama_bench_path()
    paths = export_smollm2(tuple(args.dtypes))
    results = {}
    for d, path in paths.items():
        results[d] = bench_decode(path, args.tokens, args.threads, args.repeats, depth=args.depth,
                                   binary=binary)
    if args.json:
        print(json.dumps({d: {k: v for k, v in r.items() if k != "raw"} for d, r in results.items()}, indent=1))
    else:
        print(f"llama.cpp ({results[args.dtypes[0]]['build_commit']}), SmolLM2-135M, {args.threads} threads, "
              f"{args.tokens} tokens after {args.depth}, {args.repeats} repeats")
        for d, r in results.items():
            print(f"{d:5s} {r['ms_per_token']:7.2f} ms/token  {r['tok_per_s']:7.1f} tok/s  "
                  f"(min {r['min_ms']:.2f}, max {r['max_ms']:.2f})")
    return results


if __name__ == "__main__":
    main()
