"""Which Triton is installed, and is it the vendor's: found without importing triton.

Every Triton 3.x keeps one compiler backend per device family under
``triton.backends.<name>`` (a ``compiler.py`` and a ``driver.py``); releases
up to 3.3 find them as directories of the installed package, later ones
through the ``triton.backends`` entry-point group. The vendors' ports add
their own: ``ascend`` (triton-ascend, FlagTree's triton_v3.2.x branch),
``mlu`` (Cambricon), ``mthreads`` (Moore Threads), ``metax``, ``iluvatar``
(``corex`` from Triton 3.6), ``hcu`` (Hygon DTK); ROCm's ``amd`` targets
``hip``. Upstream's wheel carries only ``nvidia`` and ``amd``, so a plain
upstream Triton is never mistaken for a vendor's port (FlagTree's
``triton/backends/__init__.py`` and third_party/*/backend/driver.py,
FlagGems' runtime/backend/_<vendor> descriptors).

``installed_triton()`` reads directory names, entry points and distribution
metadata only: cheap enough for a probe and for ``import yirage`` to stay
light. ``active_target()`` imports triton and asks its active driver for
the device target: called only where the vendor's device is present.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: distributions that install the ``triton`` package, most specific first (for naming the version)
TRITON_DISTRIBUTIONS = ("triton-ascend", "flagtree", "pytorch-triton-rocm", "triton")
#: the Triton language range yirage's renderer emits (yirage.codegen.triton)
OLDEST = (3, 0)
#: modules of ``triton.backends`` that are not compiler backends (the base classes)
NOT_BACKENDS = frozenset({"compiler", "driver"})


@dataclass(frozen=True)
class TritonInstall:
    """An installed ``triton`` package: its compiler backends and version, as found without importing it."""

    backends: tuple[str, ...]  # names under triton.backends, sorted
    version: str  # "" when no metadata says
    distribution: str  # the distribution that installed it ("triton" when unknown)

    @property
    def label(self) -> str:
        """E.g. ``triton-ascend 3.2.0``."""
        return f"{self.distribution} {self.version}".strip()

    def too_old(self) -> bool:
        """True for a Triton older than the 3.0 language the renderer emits (DTK's 2.x forks)."""
        found = re.match(r"(\d+)\.(\d+)", self.version)
        return bool(found) and (int(found[1]), int(found[2])) < OLDEST


def _package_dirs() -> list[Path]:
    """Where the ``triton`` package lives: the imported module's path, else where an import would find it."""
    module = sys.modules.get("triton")
    if module is not None:
        return [Path(p) for p in getattr(module, "__path__", [])]
    try:
        spec = importlib.util.find_spec("triton")  # a top-level find_spec does not run the package
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])]


def _entry_point_backends() -> set[str]:
    return {ep.name for ep in metadata.entry_points(group="triton.backends")}


def _version(dists: tuple[str, ...]) -> tuple[str, str]:
    """(version, distribution) of the Triton in use: the imported module's own version wins."""
    imported = getattr(sys.modules.get("triton"), "__version__", None)
    for name in dists:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if imported is None or version == imported:
            return version, name
    return (str(imported), "triton") if imported is not None else ("", "triton")


def installed_triton(preferred: tuple[str, ...] = ()) -> TritonInstall | None:
    """The installed Triton's backends (imported modules, entry points, package directories), or None.

    ``preferred``: the vendor's own distribution names, tried first when naming the version.
    """
    names = {key.split(".")[2] for key in sys.modules if key.startswith("triton.backends.")} - NOT_BACKENDS
    names |= _entry_point_backends()
    dirs = _package_dirs()
    for root in dirs:
        backends = root / "backends"
        if backends.is_dir():
            names |= {p.name for p in backends.iterdir() if (p / "driver.py").is_file()}
    if not names and not dirs:
        return None
    version, dist = _version(tuple(dict.fromkeys((*preferred, *TRITON_DISTRIBUTIONS))))
    return TritonInstall(tuple(sorted(names)), version, dist)


def active_target() -> str:
    """``backend:arch:warp_size`` of the device target Triton's active driver reports (imports triton).

    Raises what triton raises: ImportError when it does not load, RuntimeError when no driver
    or more than one is active (e.g. upstream's nvidia driver next to a vendor's on torch.cuda).
    """
    importlib.import_module("triton")
    driver = importlib.import_module("triton.runtime.driver").driver
    target = driver.active.get_current_target()
    return f"{target.backend}:{target.arch}:{target.warp_size}"
