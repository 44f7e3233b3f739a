"""pytest plugin (``-p yirage_backend_cuda.record_plans``): write the CUDA source of every plan a test compiles.

Loaded only by ``check.conformance_sources`` in a child pytest that runs the
conformance kit on the reference backend: each plan the kit compiles is
rendered by the CUDA backend and written to ``$YIRAGE_CUDA_RECORD_DIR`` under
the hash of its source (so repeats collapse), then the reference run goes on.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from yirage.reference.backend import ReferenceBackend
from yirage_backend_cuda.check import RECORD_ENV

_compile = ReferenceBackend.compile


def _recording_compile(self: ReferenceBackend, plan: Any, graph: Any) -> Any:
    from yirage.backend.selection import registry

    source = registry().get("cuda").render(plan)
    name = hashlib.sha256(source.encode()).hexdigest()[:16]
    (Path(os.environ[RECORD_ENV]) / f"{name}.cu").write_text(source, encoding="utf-8")
    return _compile(self, plan, graph)


if RECORD_ENV not in os.environ:
    raise RuntimeError(f"yirage_backend_cuda.record_plans needs ${RECORD_ENV} (a directory to write sources to); "
                       "it is meant to be loaded by yirage_backend_cuda.check.conformance_sources()")
ReferenceBackend.compile = _recording_compile  # type: ignore[method-assign]
