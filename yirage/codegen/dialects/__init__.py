"""C-family dialects: one small module of spellings per language (see ``yirage.codegen.dialect``)."""

from __future__ import annotations

from yirage.codegen.dialect import Dialect


def dialect(name: str) -> Dialect:
    """The dialect called ``name`` (opencl, cuda, hip, metal)."""
    import importlib

    if name not in ("opencl", "cuda", "hip", "metal"):
        raise ValueError(f"unknown C-family dialect {name!r}; choose one of opencl, cuda, hip, metal")
    return importlib.import_module(f"yirage.codegen.dialects.{name}").DIALECT
