"""The CPU backend's compile cache: files keyed by content, reused across processes.

Every answer a cached (or rebuilt) kernel gives is checked element by element against torch in
float64, computed here from the same seeded random inputs, never against another yirage run. Two
graphs with identical signatures (A and B) make a cache that serves one graph's kernels for the
other visible, and an ablation proves the check catches exactly that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
SHAPES = ((4, 256), (256,), (4, 256))
RTOL, ATOL = 1e-5, 1e-5  # float32 kernels against a float64 oracle: |out - ref| <= ATOL + RTOL * |ref|

# Graph A and graph B take the same inputs and return the same shapes, so kernels of one can run for the other.
PROGRAM = """
import inspect, json, sys, torch, yirage as yr
variant, out_path, forced_key = sys.argv[1], sys.argv[2], sys.argv[3]
if forced_key:  # ablation: a cache keyed without the graph that trusts whatever entry it finds
    from yirage.compiler import stages
    stages.cache_key = lambda *args, **kwargs: forced_key
g = yr.new_kernel_graph(backend="cpu")
x, gw, r = g.new_input((4, 256)), g.new_input((256,)), g.new_input((4, 256))
act = g.silu if variant == "A" else g.relu
g.mark_output(g.add(act(g.mul(g.rms_norm(x, (256,)), gw)), r))
g.mark_output(g.softmax(x, 1 if variant == "A" else 0))
exe = g.compile()
gen = torch.Generator().manual_seed(@SEED@)
inputs = [torch.randn(*s, generator=gen) for s in @SHAPES@]
torch.save(exe(inputs), out_path)
stats = {}
for name, fn in inspect.unwrap(exe._run).__globals__.items():
    if hasattr(fn, "stats") and name.startswith("k"):
        stats[name] = {"hits": sum(fn.stats.cache_hits.values()), "misses": sum(fn.stats.cache_misses.values())}
print(json.dumps({"seconds": exe.compile_seconds, "stats": stats}))
""".replace("@SEED@", str(SEED)).replace("@SHAPES@", repr(SHAPES))


def reference(variant: str) -> list[torch.Tensor]:
    """Graph ``variant`` computed by torch in float64 on the inputs the program draws."""
    gen = torch.Generator().manual_seed(SEED)
    x, gw, r = (torch.randn(*s, generator=gen).double() for s in SHAPES)
    act = torch.nn.functional.silu if variant == "A" else torch.relu
    out = act(torch.nn.functional.rms_norm(x, (256,), eps=1e-6) * gw) + r
    return [out, torch.softmax(x, 1 if variant == "A" else 0)]


def check(result: dict, variant: str) -> None:
    """Every output element within ATOL + RTOL*|ref| of the float64 oracle (AssertionError naming the worst)."""
    outputs, want = result["outputs"], reference(variant)
    assert len(outputs) == len(want), f"graph {variant}: {len(outputs)} outputs, expected {len(want)}"
    for i, (got, ref) in enumerate(zip(outputs, want, strict=True)):
        assert got.shape == ref.shape and got.dtype == torch.float32, (variant, i, got.shape, got.dtype)
        err = (got.double() - ref).abs()
        bad = err > ATOL + RTOL * ref.abs()
        worst = int(err.argmax())
        assert not bad.any(), (
            f"graph {variant} output {i} (inputs torch.randn seed {SEED}): {int(bad.sum())} of {bad.numel()} "
            f"elements beyond {ATOL} + {RTOL}*|ref|; worst at flat index {worst}: got "
            f"{got.flatten()[worst].item():.6g}, float64 reference {ref.flatten()[worst].item():.6g}")


def run(cache: Path, variant: str = "A", forced_key: str = "") -> dict:
    """Compile and run graph ``variant`` in a fresh process with ``cache`` as the cache root."""
    env = {**os.environ, "YIRAGE_CACHE_DIR": str(cache)}
    out_path = cache.parent / f"{cache.name}-outputs.pt"
    out = subprocess.run([sys.executable, "-c", PROGRAM, variant, str(out_path), forced_key], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["outputs"], result["stderr"] = torch.load(out_path), out.stderr
    return result


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "cpu").iterdir())


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> tuple[Path, dict, Path]:
    """A cache root holding graph A's compiled kernels, the result of that first (cold) run, and A's entry."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    first = run(cache, "A")
    (entry,) = entries(cache)
    return cache, first, entry


def copy_of(warm: tuple[Path, dict, Path], tmp_path: Path) -> Path:
    """A private copy of graph A's entry (mtimes kept, so numba's index still matches), for tests that damage it."""
    entry = tmp_path / "cache" / "cpu" / warm[2].name
    shutil.copytree(warm[2], entry, copy_function=shutil.copy2)
    for directory in (entry.parent.parent, entry.parent):
        directory.chmod(0o700)  # a private cache, as yirage creates it
    return entry.parent.parent


def test_a_second_process_loads_the_compiled_kernels_from_disk(warm) -> None:
    cache, first, entry = warm
    assert first["stats"] and all(s["misses"] == 1 and s["hits"] == 0 for s in first["stats"].values()), first
    check(first, "A")
    second = run(cache, "A")
    assert second["stats"] and all(s["hits"] == 1 and s["misses"] == 0 for s in second["stats"].values()), second
    check(second, "A")
    print(f"compile: cold {first['seconds']:.3f} s, from the disk cache {second['seconds']:.3f} s")
    assert entry in entries(cache)
    assert (entry / "kernels.py").read_text().startswith("# Generated by yirage-backend-cpu")


def test_a_graph_with_the_same_signature_gets_its_own_kernels(warm) -> None:
    cache = warm[0]
    before = entries(cache)
    other = run(cache, "B")
    assert other["stats"] and all(s["misses"] == 1 and s["hits"] == 0 for s in other["stats"].values()), other
    check(other, "B")
    assert len(entries(cache)) == len(before) + 1


def test_the_answer_check_catches_a_cache_that_serves_another_graphs_kernels(warm) -> None:
    """Ablation: graph B keyed onto graph A's entry loads A's kernels from disk; the shared check must fail."""
    cache, first, entry_a = warm
    stale = run(cache, "B", forced_key=entry_a.name)
    assert stale["stats"] and all(s["hits"] == 1 for s in stale["stats"].values()), stale
    torch.testing.assert_close(stale["outputs"], first["outputs"], rtol=0, atol=0)  # really A's kernels
    with pytest.raises(AssertionError, match=r"graph B output 0 \(inputs torch.randn seed 0\)"):
        check(stale, "B")


def test_a_corrupted_source_file_is_rewritten(warm, tmp_path) -> None:
    cache = copy_of(warm, tmp_path)
    (entry,) = entries(cache)
    (entry / "kernels.py").write_text("this is not python(")
    again = run(cache, "A")
    assert "differed from its rendering" in again["stderr"], again["stderr"]
    assert again["stats"] and (entry / "kernels.py").read_text().startswith("# Generated")
    check(again, "A")


def test_corrupted_numba_cache_files_are_rebuilt(warm, tmp_path) -> None:
    cache = copy_of(warm, tmp_path)
    (entry,) = entries(cache)
    damaged = 0
    for f in (entry / "__pycache__").iterdir():
        f.write_bytes(b"\x00garbage")
        damaged += 1
    assert damaged
    again = run(cache, "A")
    assert again["stats"] and all(s["hits"] == 0 for s in again["stats"].values()), again
    check(again, "A")


def test_an_unwritable_cache_dir_is_a_clear_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {**os.environ, "YIRAGE_CACHE_DIR": str(blocker / "cache")}
    out = subprocess.run([sys.executable, "-c", PROGRAM, "A", str(tmp_path / "out.pt"), ""], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300, check=False)
    assert out.returncode != 0
    assert "CacheError" in out.stderr and "YIRAGE_CACHE_DIR" in out.stderr


def test_a_file_renamed_away_while_the_entry_is_checked_is_not_an_error(tmp_path, monkeypatch) -> None:
    """Two xdist workers building one entry: one lists the other's temporary file, which is renamed into place
    before its mode is read. That vanished name must not fail the check; a file of another mode still does."""
    from yirage.compiler import cache

    entry = tmp_path / "entry"
    entry.mkdir(mode=0o700)
    (entry / ".kernels.cu.123.tmp").write_text("x")
    (entry / ".kernels.cu.123.tmp").chmod(0o600)
    real_lstat = os.lstat

    def renamed_meanwhile(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(cache.os, "lstat", renamed_meanwhile)
    cache.check_tree(entry)
    (entry / "kernels.cu").write_text("y")
    (entry / "kernels.cu").chmod(0o666)
    with pytest.raises(cache.CacheSecurityError, match="writable by group or others"):
        cache.check_tree(entry)
