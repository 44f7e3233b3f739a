"""The core's code-generation helpers and its one staged compile cache (render -> build -> load).

A fake backend whose "compiler" is pure Python goes through ``compile_cached``: its build
writes a file, its load reads it back. The oracle for every launcher is computed here from the
plan text, independently of the cache; index arithmetic is checked against numpy's unravel_index.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import yirage
from yirage.codegen.emit import Emitter
from yirage.codegen.exprs import UnsupportedExprError, spell_expr
from yirage.codegen.fingerprint import source_fingerprint
from yirage.codegen.indexing import IndexSyntax, at, decompose, offset
from yirage.compiler.cache import CacheSecurityError
from yirage.compiler.kernel_ir import Call, Const, Var
from yirage.compiler.stages import MANIFEST, Artifact, compile_cached
from yirage.errors import NotSupportedError, PluginError

ROOT = Path(__file__).resolve().parents[1]


def oracle(plan: str) -> str:
    """What the fake toolchain's launcher must answer for ``plan``, computed without it."""
    return f"binary<{plan[::-1]}>"


class FakeBackend(yirage.Backend):
    """A compiling backend in miniature: render spells, build 'compiles' into a file, load reads it."""

    name = "fakecc"

    def __init__(self, fingerprint: str = "fp1", target: str = "sm_00") -> None:
        super().__init__()
        self._fingerprint, self._target = fingerprint, target
        self.builds: list[Path] = []
        self.loads: list[Artifact] = []

    def probe(self) -> yirage.Availability:
        return yirage.Availability(True, "always here")

    def render(self, plan: str) -> str:
        return f"source of {plan}"

    def build(self, source: str, workdir: Path) -> Path:
        from yirage.compiler.cache import write_private

        self.builds.append(workdir)
        path = workdir / "kernel.bin"
        write_private(path, f"binary<{source.removeprefix('source of ')[::-1]}>".encode())
        return path

    def load(self, artifact: Artifact) -> object:
        self.loads.append(artifact)
        text = artifact.path.read_text()
        return lambda inputs: text

    def fingerprint(self) -> str:
        return self._fingerprint

    def target(self) -> str:
        return self._target


def run(backend: FakeBackend, plan: str, root: Path) -> str:
    return compile_cached(backend, plan, root=root)([])


def test_a_second_compile_is_served_from_the_cache_without_building(tmp_path) -> None:
    root = tmp_path / "cache"
    first, second = FakeBackend(), FakeBackend()  # two backend objects: as two processes would be
    assert run(first, "plan-a", root) == oracle("plan-a")
    assert len(first.builds) == 1 and first.loads[0].rebuilt
    assert run(second, "plan-a", root) == oracle("plan-a")
    assert second.builds == [] and not second.loads[0].rebuilt
    assert run(second, "plan-b", root) == oracle("plan-b")  # another plan is another entry
    assert len(second.builds) == 1
    assert len(list((root / "fakecc").iterdir())) == 2


@pytest.mark.parametrize("damage", ["artifact", "manifest", "missing"])
def test_a_corrupted_entry_is_rebuilt_with_a_warning(tmp_path, caplog, damage) -> None:
    root = tmp_path / "cache"
    backend = FakeBackend()
    run(backend, "plan-a", root)
    (entry,) = backend.builds
    if damage == "artifact":
        (entry / "kernel.bin").write_bytes(b"binary<garbage>")  # same kind of content, different bytes
    elif damage == "manifest":
        (entry / MANIFEST).write_text("{not json")
    else:
        (entry / "kernel.bin").unlink()
    with caplog.at_level(logging.WARNING, logger="yirage.compiler"):
        assert run(backend, "plan-a", root) == oracle("plan-a")
    assert backend.builds == [entry, entry], "the damaged entry must be built again, in place"
    assert backend.loads[-1].rebuilt
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0] and "rebuilding" in warnings[0], warnings
    assert run(backend, "plan-a", root) == oracle("plan-a")  # and the repaired entry is a hit again
    assert len(backend.builds) == 2


def test_an_entry_without_a_manifest_is_built_quietly(tmp_path, caplog) -> None:
    """A crash between build and the manifest write leaves files but no manifest: rebuilt, not trusted."""
    root = tmp_path / "cache"
    backend = FakeBackend()
    run(backend, "plan-a", root)
    (backend.builds[0] / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="yirage.compiler"):
        assert run(backend, "plan-a", root) == oracle("plan-a")
    assert len(backend.builds) == 2 and not caplog.records


@pytest.mark.parametrize(("fingerprint", "target"), [("fp2", "sm_00"), ("fp1", "sm_90")])
def test_a_different_fingerprint_or_target_gets_its_own_entry(tmp_path, fingerprint, target) -> None:
    root = tmp_path / "cache"
    base, other = FakeBackend(), FakeBackend(fingerprint, target)
    run(base, "plan-a", root)
    assert run(other, "plan-a", root) == oracle("plan-a")
    assert len(other.builds) == 1 and other.builds[0] != base.builds[0]
    manifest = json.loads((other.builds[0] / MANIFEST).read_text())
    assert (manifest["fingerprint"], manifest["target"]) == (fingerprint, target)


def test_cache_directories_are_0700_and_files_0600(tmp_path) -> None:
    root = tmp_path / "fresh" / "cache"
    backend = FakeBackend()
    run(backend, "plan-a", root)
    (entry,) = backend.builds
    for directory in (root, root / "fakecc", entry):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for f in (entry / "kernel.bin", entry / MANIFEST):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


@pytest.mark.parametrize("where", ["root", "entry", "artifact"])
def test_a_cache_path_others_could_write_is_refused_before_loading(tmp_path, where) -> None:
    root = tmp_path / "cache"
    backend = FakeBackend()
    if where == "root":
        root.mkdir()
        root.chmod(0o770)
        victim = root
    else:
        run(backend, "plan-a", root)
        victim = backend.builds[0] if where == "entry" else backend.builds[0] / "kernel.bin"
        victim.chmod(0o777 if where == "entry" else 0o666)
        backend.builds.clear()
        backend.loads.clear()
    with pytest.raises(CacheSecurityError, match="writable by group or others") as info:
        run(backend, "plan-a", root)
    assert str(victim) in str(info.value) and "YIRAGE_CACHE_DIR" in str(info.value)
    assert backend.loads == [] and backend.builds == []


@pytest.mark.parametrize(("returned", "message"), [
    ("elsewhere", "inside the work directory"), ("manifest", "inside the work directory"),
    (None, "inside the work directory"), ([], "returned no files")])
def test_build_output_outside_the_work_directory_is_refused(tmp_path, returned, message) -> None:
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"x")

    class Stray(FakeBackend):
        def build(self, source: str, workdir: Path) -> object:
            if returned == "manifest":
                (workdir / MANIFEST).write_text("{}")
                return workdir / MANIFEST
            return elsewhere if returned == "elsewhere" else returned

    with pytest.raises(PluginError, match=message):
        run(Stray(), "plan-a", tmp_path / "cache")


def test_backend_compile_uses_the_stages_and_a_backend_without_them_is_not_supported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    backend = FakeBackend()
    assert backend.compile("plan-c", graph=None)([]) == oracle("plan-c")
    assert len(backend.builds) == 1 and backend.builds[0].is_relative_to(tmp_path / "cache" / "fakecc")

    class NoCompiler(yirage.Backend):
        name = "nocc"

    with pytest.raises(NotSupportedError, match="cannot compile kernel graphs yet"):
        NoCompiler().compile("plan", graph=None)


class LoadsOnce(FakeBackend):
    """A backend whose ``load`` goes through the one process cache of loaded programs (as every built-in does)."""

    name = "fakeonce"

    def __init__(self, fingerprint: str = "fp-once", scope: object = ()) -> None:
        super().__init__(fingerprint)
        self.scope = scope

    def load(self, artifact: Artifact) -> object:
        return artifact.load_once(lambda: super(LoadsOnce, self).load(artifact), scope=self.scope)


def test_a_loaded_program_is_kept_per_entry_and_scope_and_reloaded_when_rebuilt(tmp_path) -> None:
    root = tmp_path / "cache"
    first, second = LoadsOnce(), LoadsOnce()
    program = compile_cached(first, "plan-a", root=root)
    assert compile_cached(second, "plan-a", root=root) is program and second.loads == []  # one load per process
    other_device = LoadsOnce(scope=1)
    assert compile_cached(other_device, "plan-a", root=root) is not program and len(other_device.loads) == 1
    (first.builds[0] / "kernel.bin").write_bytes(b"binary<garbage>")  # damaged: rebuilt, and loaded again
    rebuilt = compile_cached(second, "plan-a", root=root)
    assert rebuilt is not program and second.loads[-1].rebuilt and rebuilt([]) == oracle("plan-a")
    assert compile_cached(first, "plan-a", root=root) is rebuilt


def test_concurrent_compiles_of_one_plan_load_it_once(tmp_path) -> None:
    import threading

    backends = [LoadsOnce(fingerprint="fp-threads") for _ in range(8)]
    start = threading.Barrier(len(backends))
    got: list[object] = []

    def compile_one(b: LoadsOnce) -> None:
        start.wait()
        got.append(compile_cached(b, "plan-t", root=tmp_path / "cache"))

    threads = [threading.Thread(target=compile_one, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(backends) and all(p is got[0] for p in got)
    assert sum(len(b.loads) for b in backends) == 1


# -- backend-neutral helpers --------------------------------------------------------------------------------

PY = IndexSyntax(const=str, declare=lambda n, v: f"{n} = {v}", assign=lambda n, v: f"{n} = {v}", floordiv="//")


@pytest.mark.parametrize("dims", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_decompose_and_offset_agree_with_numpy(dims) -> None:
    emit = Emitter()
    names = [f"i{k}" for k in range(len(dims))]
    decompose(emit, "flat", dims, names, PY)
    strides = [int(s) for s in np.random.default_rng(0).integers(0, 5, len(dims))]
    emit(f"off = {offset(names, strides, PY)}")
    emit(f"ptr = {at('base', 'flat', 3, PY)}")
    code = compile(emit.source(), "<decompose>", "exec")
    for flat in range(int(np.prod(dims))):
        env = {"flat": flat, "base": 100}
        exec(code, env)  # noqa: S102 - our own emitted text
        want = np.unravel_index(flat, dims)
        assert [env[n] for n in names] == [int(w) for w in want]
        assert env["off"] == sum(int(w) * s for w, s in zip(want, strides, strict=True))
        assert env["ptr"] == 100 + 3 * flat


def test_an_ir_function_missing_from_a_spelling_table_is_a_clear_error() -> None:
    expr = Call("gelu", (Call("add", (Var("x"), Const(1.0))),))
    table = {"add": lambda a: f"({a[0]} + {a[1]})"}
    with pytest.raises(UnsupportedExprError, match=r"toy renderer has no spelling for the IR function 'gelu'"):
        spell_expr(expr, load=str, var=lambda v: v.name, const=lambda c: repr(c.value), table=table, renderer="toy")
    table["gelu"] = lambda a: f"gelu({a[0]})"
    assert spell_expr(expr, load=str, var=lambda v: v.name, const=lambda c: repr(c.value), table=table,
                      renderer="toy") == "gelu((x + 1.0))"


def test_source_fingerprint_follows_the_files(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, text in ((a, "x = 1\n"), (b, "x = 2\n")):
        d.mkdir()
        (d / "m.py").write_text(text)
        (d / "notes.txt").write_text("ignored")
    assert source_fingerprint(a) != source_fingerprint(b)
    (b / "m.py").write_text("x = 1\n")
    source_fingerprint.cache_clear()
    assert source_fingerprint(a) == source_fingerprint(b)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        source_fingerprint(tmp_path / "missing")


def test_importing_the_codegen_package_and_stages_imports_no_numba() -> None:
    code = ("import sys, yirage.codegen, yirage.codegen.emit, yirage.codegen.exprs, yirage.codegen.indexing, "
            "yirage.codegen.fingerprint, yirage.compiler.stages\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite', 'pyopencl'))\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=False, env={**os.environ})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
