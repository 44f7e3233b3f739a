"""A fingerprint of a package's own source files, for compile-cache keys.

Generated code and cached compiled functions depend on every source file of the
backend that produced them, not just the one they were defined in; hashing all
of them means any edit makes old cache entries unreachable.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


@functools.cache
def source_fingerprint(directory: Path, pattern: str = "*.py") -> str:
    """16 hex digits of sha256 over the files matching ``pattern`` in ``directory`` (sorted, not recursive).

    Computed once per process and directory: sources do not change under a running process.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"cannot fingerprint {directory}: not a directory; pass the package's directory "
                                "(e.g. Path(__file__).parent)")
    digest = hashlib.sha256()
    for f in sorted(directory.glob(pattern)):
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]
