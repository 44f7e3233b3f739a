"""The CPU backend's process-level safety: a private compile cache, fork(), concurrent callers.

Everything that could kill the interpreter (a segfault, numba's SIGTERM after
fork, a malicious pickle) runs in a subprocess, so a regression fails a test
instead of ending the run.
"""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[1]

# A graph big enough to run its kernels in a prange (parallel thread pool), checked against torch.
GRAPH = """
import torch, yirage as yr
torch.manual_seed(0)
g = yr.new_kernel_graph(backend="cpu")
x, w = g.new_input((64, 2048)), g.new_input((2048,))
g.mark_output(g.silu(g.mul(g.rms_norm(x, (2048,)), w)))
exe = g.compile()
X, W = torch.randn(64, 2048), torch.randn(2048)
want = torch.nn.functional.silu(torch.nn.functional.rms_norm(X, (2048,), eps=1e-6) * W)
def ok():
    return torch.allclose(exe([X, W])[0], want, rtol=1e-4, atol=1e-5)
"""


def python(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "YIRAGE_CACHE_DIR": str(cache), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          cwd=ROOT, timeout=600, check=False)


# -- the compile cache -----------------------------------------------------------------------------------


def test_the_cache_root_is_created_private(tmp_path) -> None:
    cache = tmp_path / "fresh" / "cache"
    out = python(GRAPH + "print(ok())", cache)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "True"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (entry,) = (cache / "cpu").iterdir()
    assert not stat.S_IMODE(entry.stat().st_mode) & 0o077
    assert not stat.S_IMODE((entry / "kernels.py").stat().st_mode) & 0o077


@pytest.mark.parametrize("mode", [0o770, 0o707])
def test_a_cache_root_others_can_write_is_refused(tmp_path, mode) -> None:
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(mode)
    out = python(GRAPH + "print(ok())", cache)
    assert out.returncode != 0
    assert "CacheSecurityError" in out.stderr and str(cache) in out.stderr
    assert "writable by group or others" in out.stderr and "YIRAGE_CACHE_DIR" in out.stderr


def test_a_planted_pickle_in_a_writable_entry_never_runs(tmp_path) -> None:
    cache = tmp_path / "cache"
    first = python(GRAPH + "print(ok())", cache)
    assert first.returncode == 0, first.stderr
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    (entry,) = (cache / "cpu").iterdir()
    indexes = list((entry / "__pycache__").glob("*.nbi"))
    assert indexes
    for index in indexes:
        index.write_bytes(pickle.dumps(Payload()))
        index.chmod(0o666)  # as another user on the machine could have left it
    out = python(GRAPH + "print(ok())", cache)
    assert not marker.exists(), "the planted pickle ran"
    assert out.returncode != 0
    assert "CacheSecurityError" in out.stderr and "writable by group or others" in out.stderr
    assert str(indexes[0].parent) in out.stderr and "chmod -R go-w" in out.stderr


def test_a_cache_owned_by_someone_else_is_refused(tmp_path) -> None:
    from yirage.compiler import cache

    target = tmp_path / "entry"
    target.mkdir(mode=0o700)
    cache.check_private(target)  # ours: fine
    st = os.lstat(target)
    foreign = os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, 54321, *st[5:]))
    with pytest.raises(cache.CacheSecurityError, match=r"owned by uid 54321, not by you"):
        cache.check_private(target, foreign)


def test_a_symlinked_entry_is_refused(tmp_path) -> None:
    from yirage.compiler import cache

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(cache.CacheSecurityError, match="symbolic link"):
        cache.check_private(link)


def test_a_corrupted_cache_under_numba_cache_dir_is_rebuilt(tmp_path) -> None:
    cache, numba_cache = tmp_path / "cache", tmp_path / "numba"
    first = python(GRAPH + "print(ok())", cache, NUMBA_CACHE_DIR=str(numba_cache))
    assert first.returncode == 0, first.stderr
    files = [f for f in numba_cache.rglob("*") if f.suffix in (".nbi", ".nbc")]
    assert files, "numba wrote nothing under NUMBA_CACHE_DIR"
    assert not list(cache.rglob("__pycache__/*.nbi")), "numba's files went beside the source instead"
    for f in files:
        f.write_bytes(b"\x00garbage")
    again = python(GRAPH + "print(ok())", cache, NUMBA_CACHE_DIR=str(numba_cache))
    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[-1] == "True"


def test_a_compile_failure_is_not_blamed_on_the_cache(tmp_path, monkeypatch) -> None:
    from yirage_backend_cpu import compile as cpu_compile

    def broken(name, path):  # type: ignore[no-untyped-def]
        raise TypeError("numba says no")

    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_compile, "_import", broken)
    import yirage as yr

    g = yr.new_kernel_graph(backend="cpu")
    g.mark_output(g.exp(g.new_input((3, 5))))
    with pytest.raises(cpu_compile.CompileError, match="not a corrupted cache") as info:
        g.compile()
    assert "delete" not in str(info.value)


# -- fork() and threads ----------------------------------------------------------------------------------

FORK = GRAPH + """
import os
print("parent", ok(), flush=True)
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)  # as DataLoader workers do: torch's own OpenMP pool hangs in a forked child
    try:
        print("child", ok(), flush=True)
    except Exception as exc:
        print("child raised", type(exc).__name__, exc, flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_fork_on_the_tbb_layer_keeps_the_child_working(tmp_path) -> None:
    try:
        metadata.distribution("tbb")
    except metadata.PackageNotFoundError:
        pytest.skip("the tbb wheel is not installed: pip install 'yirage-backend-cpu[tbb]'")
    out = python(FORK, tmp_path, NUMBA_THREADING_LAYER="tbb")
    assert out.returncode == 0, out.stderr
    assert "parent True" in out.stdout
    assert "child True" in out.stdout, out.stdout + out.stderr
    assert "child exit 0" in out.stdout


@pytest.mark.parametrize("layer", [None, "omp"])
def test_fork_under_openmp_gives_the_child_a_clear_error(tmp_path, layer) -> None:
    """OpenMP is the default layer (fast beside torch); numba would kill the child, yirage says why instead."""
    out = python(FORK, tmp_path, **({"NUMBA_THREADING_LAYER": layer} if layer else {}))
    assert out.returncode == 0, out.stderr
    assert "parent True" in out.stdout
    assert "child raised ForkError" in out.stdout, out.stdout + out.stderr
    assert "spawn" in out.stdout and "child exit 0" in out.stdout


THREADS = GRAPH + """
import threading
tiny = yr.new_kernel_graph(backend="cpu")
a, b = tiny.new_input((16,)), tiny.new_input((16,))
tiny.mark_output(tiny.add(a, b))
texe = tiny.compile()
A, B = torch.randn(16), torch.randn(16)
ref_big, ref_tiny = exe([X, W])[0], texe([A, B])[0]
bad = []
def worker():
    for _ in range(50):
        if not torch.equal(exe([X, W])[0], ref_big) or not torch.equal(texe([A, B])[0], ref_tiny):
            bad.append(1)
threads = [threading.Thread(target=worker) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print("ok" if ok() and not bad else f"mismatches {len(bad)}")
"""


@pytest.mark.parametrize("layer", ["default", "workqueue"])
def test_four_threads_on_one_compiled_graph_agree_with_one(tmp_path, layer) -> None:
    out = python(THREADS, tmp_path, NUMBA_THREADING_LAYER=layer)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "ok", out.stdout


# -- numba caches of the backend's own functions --------------------------------------------------------

STAMP = """
import sys
from yirage_backend_cpu import sources
if len(sys.argv) > 1:
    sources.backend_fingerprint = lambda: sys.argv[1]  # as if a backend source file had changed
import numpy as np
from yirage_backend_cpu.pk_tasks import argmax_row
print(argmax_row(np.array([1.0, 3.0, 2.0], np.float32), 0, 3), sum(argmax_row.stats.cache_misses.values()))
"""


def test_editing_any_backend_source_recompiles_the_cached_task_functions(tmp_path) -> None:
    """numba checks only the defining file; pk_tasks inlines kernel_lib, so the stamp carries all sources."""
    import uuid

    changed = uuid.uuid4().hex[:16]
    results = []
    for argv in ([], [changed], [changed]):
        out = subprocess.run([sys.executable, "-c", STAMP, *argv], capture_output=True, text=True, cwd=ROOT,
                             timeout=600, check=False)
        assert out.returncode == 0, out.stderr
        results.append(out.stdout.split())
    assert all(r[0] == "1" for r in results)
    assert results[1][1] == "1", "a changed fingerprint must recompile"
    assert results[2][1] == "0", "the same fingerprint must load from the cache"


PLANT = """
import numpy as np
from yirage_backend_cpu.pk_tasks import argmax_row
print(argmax_row(np.array([1.0, 3.0, 2.0], np.float32), 0, 3))
"""


def test_a_planted_pickle_in_a_shared_numba_cache_dir_never_runs(tmp_path) -> None:
    """The backend's own cached functions (the decode loop's tasks) load from NUMBA_CACHE_DIR when it is set."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(shared)}
    first = subprocess.run([sys.executable, "-c", PLANT], capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=600, check=False)
    assert first.returncode == 0 and first.stdout.strip() == "1", first.stderr
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    (index,) = shared.rglob("pk_tasks.argmax_row-*.nbi")
    index.write_bytes(pickle.dumps(Payload()))
    index.chmod(0o666)
    again = subprocess.run([sys.executable, "-c", PLANT], capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=600, check=False)
    assert not marker.exists(), "the planted pickle ran"
    assert again.returncode != 0
    assert "CacheSecurityError" in again.stderr and "writable by group or others" in again.stderr
