"""Registers and spills of each function in a PTX module, as ``ptxas -v`` reports them (no GPU needed).

Why: a kernel that spills reads and writes local memory (DRAM behind L1) in its inner loop, and one that uses
many registers fits fewer warps per SM; either can cost a bandwidth-bound kernel (the PersistentKernel's
GEMVs) more than its loads. The compile-only check (``check.compile_check(..., no_spills=True)``) fails a
source whose functions spill, and reports the most registers any of them uses.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class Resources:
    """One function's resources: registers (entry functions only; 0 for device functions) and spills in bytes."""

    function: str
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


def demangle(symbol: str) -> str:
    """The last name of an Itanium-mangled nested name (``_ZN..8y_gemv_3E..`` -> ``y_gemv_3``), else ``symbol``."""
    if not symbol.startswith("_ZN"):
        return symbol
    i, last = 3, symbol
    while i < len(symbol) and symbol[i].isdigit():
        j = i
        while symbol[j].isdigit():
            j += 1
        last, i = symbol[j:j + int(symbol[i:j])], j + int(symbol[i:j])
    return last


def parse(log: str) -> tuple[Resources, ...]:
    """Every function of a ``ptxas -v`` log, in the order ptxas lists them."""
    found: dict[str, dict[str, int]] = {}
    current = ""
    for line in log.splitlines():
        m = _ENTRY.search(line) or _PROPS.search(line)
        if m:
            current = demangle(m.group(1))
            found.setdefault(current, {})
            continue
        if current and (m := _FRAME.search(line)):
            found[current].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current and (m := _USED.search(line)):
            found[current]["registers"] = int(m[1])
    return tuple(Resources(name, **values) for name, values in found.items())


def ptxas_resources(ptx: str, arch: str) -> tuple[Resources, ...]:
    """Assemble ``ptx`` for ``arch`` with ``ptxas -v`` and return what it says of each function.

    Raises FileNotFoundError when no ptxas is on PATH (put the CUDA toolkit's bin directory there) and
    RuntimeError with ptxas's log when it fails.
    """
    path = shutil.which("ptxas")
    if path is None:
        raise FileNotFoundError("no ptxas on PATH: register and spill counts need the CUDA toolkit's ptxas")
    with tempfile.TemporaryDirectory(prefix="yirage-ptxas-v-") as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        run = subprocess.run([path, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "out.cubin")],
                             capture_output=True, text=True, timeout=600, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas -v failed for {arch} (exit {run.returncode}):\n{run.stderr}{run.stdout}")
    return parse(run.stderr + run.stdout)
