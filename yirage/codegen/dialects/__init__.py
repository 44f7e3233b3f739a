"""C-family dialects: one small module of spellings per language (see ``yirage.codegen.dialect``).

A new dialect is one more module here defining ``DIALECT``; nothing else lists them.
"""

from __future__ import annotations

import importlib
import pkgutil

from yirage.codegen.dialect import Dialect


def names() -> list[str]:
    """The dialects this package holds (its modules)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def dialect(name: str) -> Dialect:
    """The dialect called ``name`` (e.g. opencl, cuda, hip, metal)."""
    known = names()
    if name not in known:
        raise ValueError(f"unknown C-family dialect {name!r}; choose one of {', '.join(known)}")
    return importlib.import_module(f"yirage.codegen.dialects.{name}").DIALECT
