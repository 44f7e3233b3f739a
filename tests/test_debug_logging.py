"""YIRAGE_LOG_LEVEL=DEBUG shows probing, plugin loading, cache misses and hits, stage times and decisions.

Issue 12, item 8. A fresh interpreter (the level is read at import) compiles the same small graph twice,
as two graph objects, in a fresh compile cache: the first is a miss that builds, the second a hit. At the
default level none of the DEBUG lines appear. The result is checked against torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import numba_installed

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 240  # seconds before the child counts as hung; generous for a loaded 2-core machine

SCRIPT = """
import torch
import yirage as yr
from yirage import autoconfig
from yirage.backend import selection

print("auto:", yr.get_backend().value)  # auto probes every backend
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
for _ in range(2):
    g = yr.new_kernel_graph(backend="cpu")
    g.mark_output(g.relu(g.new_input((4, 8))))
    assert torch.equal(g(inputs=[x])[0], torch.relu(x))
autoconfig.resolve_pk_config(selection.registry().get("cpu"))  # a configuration decision
print("ok")
"""


def run(cache: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("YIRAGE_") or k == "YIRAGE_CONFIG_DIR"}
    full.update(YIRAGE_CACHE_DIR=str(cache), **env)
    try:
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=full, cwd=ROOT,
                             timeout=LIMIT, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child did not finish in {LIMIT} s: {exc.stderr!r}")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
    return out


@pytest.mark.skipif(not numba_installed(), reason="the cpu backend (numba) is the one compiled through the cache")
def test_debug_level_shows_probes_plugins_cache_and_times_and_the_default_shows_none(tmp_path) -> None:
    cache = tmp_path / "cache"  # fresh: the first compile must miss
    err = run(cache, YIRAGE_LOG_LEVEL="DEBUG").stderr
    for name in ("cpu", "reference", "torch"):
        assert re.search(rf"DEBUG yirage\.backend: probed backend '{name}' in \d+\.\d+ s: ok=(True|False)", err), err
    assert re.search(r"DEBUG yirage\.plugins: plugin 'cpu' \(yirage-backend-cpu .*\): loaded; backends: cpu", err)
    assert re.search(r"DEBUG yirage\.backend: registered backend 'cpu' \(priority \d+\)", err)
    assert "INFO yirage.backend: auto selected backend" in err
    miss = re.search(r"compile-cache miss for plan (\w+) on backend 'cpu': key (\w+)", err)
    hit = re.search(r"compile-cache hit for plan (\w+) on backend 'cpu': key (\w+)", err)
    assert miss and hit and miss.start() < hit.start(), err
    assert miss.groups() == hit.groups()  # the same plan and entry
    assert (cache / "cpu" / miss.group(2)).is_dir()
    for stage in ("render", "build", "load"):
        assert re.search(rf"DEBUG yirage\.compiler: {stage} of plan {miss.group(1)} for backend 'cpu' took "
                         r"\d+\.\d+ s", err), stage
    assert len(re.findall(r"build of plan", err)) == 1  # the hit does not build
    assert re.search(r"DEBUG yirage\.autoconfig: PersistentKernel on 'cpu' runs with", err)

    quiet = run(cache).stderr  # default level, same cache
    assert "DEBUG" not in quiet and "probed backend" not in quiet and "compile-cache" not in quiet, quiet
