"""Hostile files in the compile cache and the settings directory (issue 28).

- A FIFO where yirage reads a file (a cache entry's ``kernels.py``, ``manifest.json`` or numba index; the
  settings or autoconfig file) used to block ``open`` forever: every such scenario runs in a subprocess with a
  timeout, and a hang fails the test.
- A directory where a cache entry keeps a file used to end in "rebuilding" and then a wrong fix hint.
- Settings writes used to follow a link planted in a directory another user can write (``config.tmp``
  -> victim overwrote the victim's file).
- A read-only install with an unwritable HOME used to blame "a bug in yirage's CPU renderer" for every graph
  and numba's "no locator available" for every generate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from yirage import autoconfig
from yirage import config as settings
from yirage.compiler import cache

ROOT = Path(__file__).resolve().parents[1]
HANG = 90  # seconds: a compile of the tiny graph takes ~4 s; longer means it blocked on a FIFO

GRAPH = """
import torch, yirage as yr
g = yr.new_kernel_graph(backend="cpu")
x = g.new_input((4, 8))
g.mark_output(g.relu(x))
out = g.compile()([torch.arange(-16.0, 16.0).reshape(4, 8)])[0]
assert torch.equal(out, torch.arange(-16.0, 16.0).reshape(4, 8).clamp(min=0)), out
print("graph ok")
"""


def run(args: list[str], env: dict[str, str], timeout: float = HANG) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a fresh process; a run past ``timeout`` (blocked on a FIFO) fails the test."""
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {timeout} s (blocked opening a FIFO?): python {' '.join(args)[:200]}\n"
                    f"stderr: {exc.stderr!r}")


def copy_backend(site: Path) -> Path:
    """A copy of the cpu backend in ``site``, first on PYTHONPATH in ``with_site``'s environments."""
    shutil.copytree(ROOT / "backends" / "cpu" / "yirage_backend_cpu", site / "yirage_backend_cpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def with_site(site: Path, **env: str) -> dict[str, str]:
    """os.environ with ``site`` first on PYTHONPATH (editable installs resolve after it) and ``env`` on top."""
    out = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "PYTHONDONTWRITEBYTECODE": "1", **env}
    out.pop("NUMBA_CACHE_DIR", None)
    return out


# -- the compile cache: FIFOs and directories where an entry keeps files (items 1 and 3) ----------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The backend these tests compile with: a copy, so that edits to the checkout during the run (its sources
    are in the cache key) cannot move the tests to another entry than the one they damaged."""
    pytest.importorskip("numba")
    return copy_backend(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory, site: Path) -> Path:
    """A cache root holding the tiny graph's cpu entry, built by a real compile."""
    root = tmp_path_factory.mktemp("built") / "cache"
    out = run(["-c", WHERE + GRAPH], with_site(site, YIRAGE_CACHE_DIR=str(root)))
    assert out.returncode == 0 and "graph ok" in out.stdout, out.stderr
    assert f"backend at {site}" in out.stdout, out.stdout
    return root


def damaged_copy(built: Path, tmp_path: Path, target: str, kind: str, keep_manifest: bool = True) -> Path:
    """A copy of ``built`` whose entry has ``kind`` ("fifo" or "dir") in place of ``target``; returns the entry."""
    root = tmp_path / "cache"
    shutil.copytree(built, root)
    (entry,) = (root / "cpu").iterdir()
    path = next((entry / "__pycache__").glob("*.nbi")) if target == "numba index" else entry / target
    path.unlink()
    if not keep_manifest:
        (entry / "manifest.json").unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
        (path / "inside").write_text("x")
    return entry


def assert_rebuilt(site: Path, entry: Path, target: str) -> None:
    """Compile again from the damaged cache: it must finish, compute right and leave a regular file there."""
    out = run(["-c", GRAPH], with_site(site, YIRAGE_CACHE_DIR=str(entry.parent.parent), YIRAGE_LOG_LEVEL="WARNING"))
    assert out.returncode == 0 and "graph ok" in out.stdout, out.stderr
    assert "removing it so the entry is rebuilt" in out.stderr, out.stderr
    assert (entry / "kernels.py").is_file() and (entry / "manifest.json").is_file()
    if target != "numba index":
        assert (entry / target).is_file(), sorted(p.name for p in entry.iterdir())
    assert len(list((entry.parent).iterdir())) == 1, "the damaged entry itself must be rebuilt, not another one"


@pytest.mark.parametrize(("target", "keep_manifest"), [("kernels.py", True), ("manifest.json", True),
                                                       ("kernels.py", False), ("numba index", True)])
def test_a_fifo_in_a_cache_entry_is_removed_and_the_entry_rebuilt(site, built_cache, tmp_path, target,
                                                                  keep_manifest) -> None:
    entry = damaged_copy(built_cache, tmp_path, target, "fifo", keep_manifest)
    assert_rebuilt(site, entry, target)


@pytest.mark.parametrize(("target", "keep_manifest"), [("kernels.py", True), ("manifest.json", True),
                                                       ("kernels.py", False)])
def test_a_directory_in_a_cache_entry_is_removed_and_the_entry_rebuilt(site, built_cache, tmp_path, target,
                                                                       keep_manifest) -> None:
    entry = damaged_copy(built_cache, tmp_path, target, "dir", keep_manifest)
    assert_rebuilt(site, entry, target)


def test_writing_over_a_directory_names_it_and_says_delete_it(tmp_path) -> None:
    """write_private is what every backend's build uses: the old hint was "set YIRAGE_CACHE_DIR to a writable
    directory", which does not help when the directory is writable and only the file is a directory."""
    tmp_path.chmod(0o700)
    (tmp_path / "kernels.cu").mkdir()
    with pytest.raises(cache.CacheError) as info:
        cache.write_private(tmp_path / "kernels.cu", "source")
    message = str(info.value)
    assert "is a directory" in message and f"rm -r {tmp_path / 'kernels.cu'}" in message, message
    assert "writable directory" not in message, message


# -- the settings directory: FIFOs (item 1) ---------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "code", "error"), [
    ("config.json", "import yirage as yr; yr.get_backend()", "ConfigError"),
    ("autoconfig.json", "from yirage import autoconfig; autoconfig.load_applied()", "SavedConfigError"),
])
def test_a_fifo_in_place_of_a_settings_file_is_refused_not_opened(tmp_path, name, code, error) -> None:
    tmp_path.chmod(0o700)
    os.mkfifo(tmp_path / name)
    out = run(["-c", code], {**os.environ, "YIRAGE_CONFIG_DIR": str(tmp_path)}, timeout=60)
    assert out.returncode != 0
    assert error in out.stderr and str(tmp_path / name) in out.stderr and "FIFO" in out.stderr, out.stderr
    assert "delete it" in out.stderr, out.stderr


# -- the settings directory: planted links (item 2) -------------------------------------------------------------------
VICTIM_TEXT = "the victim's own file\n"


def plant(directory: Path, tmp_path: Path) -> Path:
    """Links at every name a settings write used (final and temporary) to one victim file; returns it."""
    victim = tmp_path / "victim" / "notes.txt"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    for name in ("config.json", "config.tmp", "autoconfig.json", "autoconfig.json.tmp"):
        (directory / name).symlink_to(victim)
    return victim


def shared_dir(tmp_path: Path, how: str) -> Path:
    """A settings directory another user controls, as ``how`` says."""
    if how == "owned by another user":
        directory = tmp_path / "shared"
        directory.mkdir(mode=0o1777)
        directory.chmod(0o1777)  # like /tmp; the attacker owns it
        os.chown(directory, 54321, 54321)
    elif how == "group-writable":
        directory = tmp_path / "shared"
        directory.mkdir()
        directory.chmod(0o770)
    else:  # a private directory inside one every user can write, without the sticky bit
        parent = tmp_path / "open"
        parent.mkdir()
        parent.chmod(0o777)
        directory = parent / "settings"
        directory.mkdir(mode=0o700)
    return directory


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("how", ["owned by another user", "group-writable", "in a world-writable parent"])
def test_set_and_apply_refuse_a_settings_directory_others_can_write(tmp_path, how) -> None:
    """The attack of the issue: ``tools/backend_manager.py set`` (and ``optimize --apply``) with
    YIRAGE_CONFIG_DIR in a directory another user can write, where they planted links to the victim's file."""
    directory = shared_dir(tmp_path, how)
    victim = plant(directory, tmp_path)
    env = {**os.environ, "YIRAGE_CONFIG_DIR": str(directory)}
    for args in (["tools/backend_manager.py", "set", "reference"],
                 ["tools/backend_manager.py", "optimize", "--backend", "reference", "--apply", "--no-sweep"]):
        out = run(args, env)
        assert victim.read_text() == VICTIM_TEXT, f"{args[1]} wrote through a planted link: {victim.read_text()!r}"
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert str(directory) in out.stderr and "YIRAGE_CONFIG_DIR" in out.stderr, out.stderr
        cause = {"owned by another user": "owned by uid 54321", "group-writable": "writable by group or others",
                 "in a world-writable parent": "which every user can write"}[how]
        assert cause in out.stderr, out.stderr


def test_save_refuses_a_link_at_the_settings_file_in_a_private_directory(tmp_path, monkeypatch) -> None:
    directory = tmp_path / "settings"
    directory.mkdir(mode=0o700)
    victim = plant(directory, tmp_path)
    monkeypatch.setenv("YIRAGE_CONFIG_DIR", str(directory))
    with pytest.raises(settings.ConfigError) as info:  # UnsafeConfigError, also a PermissionError
        settings.save(backend="reference")
    assert isinstance(info.value, PermissionError), repr(info.value)
    assert "symbolic link" in str(info.value) and "Delete the link" in str(info.value), info.value
    cfg = autoconfig.BackendConfig("reference", {"name": "x"}, "reference:x", {})
    with pytest.raises(settings.ConfigError, match="symbolic link"):
        autoconfig.apply(cfg)
    assert victim.read_text() == VICTIM_TEXT
    assert (directory / "config.json").is_symlink() and (directory / "autoconfig.json").is_symlink()


def test_save_writes_a_private_file_past_a_link_at_the_old_temporary_name(tmp_path, monkeypatch) -> None:
    """``config.tmp`` was the fixed temporary name (opened without O_EXCL, so through a link)."""
    directory = tmp_path / "settings"
    directory.mkdir(mode=0o700)
    victim = plant(directory, tmp_path)
    (directory / "config.json").unlink()
    monkeypatch.setenv("YIRAGE_CONFIG_DIR", str(directory))
    path = settings.save(backend="reference")
    assert victim.read_text() == VICTIM_TEXT
    assert json.loads(path.read_text()) == {"backend": "reference"} and not path.is_symlink()
    assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)


# -- a read-only install with an unwritable HOME (item 4) -------------------------------------------------------------
def read_only_env(tmp_path: Path, yirage_cache: Path | None) -> dict[str, str]:
    """A copy of the cpu backend whose ``__pycache__`` cannot be created, and a HOME that cannot be written.

    Why this way: the tests run as root, for whom chmod does not make anything unwritable. A path below a
    regular FILE cannot be created by anyone (mkdir fails with NotADirectoryError), so HOME and
    XDG_CACHE_HOME point below one, and the copy's ``__pycache__`` is itself a regular file: numba can
    cache the backend's functions neither beside them nor in ``~/.cache/numba``, as for a non-root user
    of a read-only site-packages with HOME=/nonexistent. The copy comes first on PYTHONPATH (editable
    installs resolve after it); the programs print its path, so the tests see that it was used.
    """
    pytest.importorskip("numba")
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("")
    install = copy_backend(tmp_path / "site")
    (install / "yirage_backend_cpu" / "__pycache__").write_text("")
    env = with_site(install, HOME=str(blocker / "home"), XDG_CACHE_HOME=str(blocker / "cache"))
    env.pop("YIRAGE_CACHE_DIR", None)
    if yirage_cache is not None:
        env["YIRAGE_CACHE_DIR"] = str(yirage_cache)
    return env


WHERE = "import yirage_backend_cpu; print('backend at', yirage_backend_cpu.__file__)\n"
#: what generate does first: the backend's PersistentKernel runtime (numba, cache=True functions)
GENERATE = WHERE + "from yirage.backend import selection; selection.resolve('cpu').persistent_runtime(None, None)\n"


def test_a_read_only_install_runs_once_yirage_cache_dir_is_set(tmp_path) -> None:
    """YIRAGE_CACHE_DIR, the fix the errors name, is enough: numba caches the backend's own code there."""
    env = read_only_env(tmp_path, tmp_path / "yirage-cache")
    out = run(["-c", WHERE + GRAPH + "import yirage_backend_cpu.pk_runtime; print('runtime imported')"], env,
              timeout=300)
    assert f"backend at {tmp_path / 'site'}" in out.stdout, (out.stdout, out.stderr)
    assert out.returncode == 0 and "graph ok" in out.stdout and "runtime imported" in out.stdout, out.stderr
    assert any((tmp_path / "yirage-cache" / "numba").iterdir())


@pytest.mark.parametrize("what", ["graph", "generate"])
def test_a_read_only_install_without_a_cache_dir_names_what_is_unwritable(tmp_path, what) -> None:
    env = read_only_env(tmp_path, None)
    out = run(["-c", WHERE + GRAPH if what == "graph" else GENERATE], env, timeout=300)
    assert f"backend at {tmp_path / 'site'}" in out.stdout, (out.stdout, out.stderr)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "CacheError" in last and "YIRAGE_CACHE_DIR" in last, out.stderr
    assert str(tmp_path / "a-regular-file" / "cache" / "yirage") in last, last  # what could not be created
    assert "renderer" not in out.stderr and "no locator available" not in last, out.stderr
