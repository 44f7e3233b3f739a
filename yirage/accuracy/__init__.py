"""Accuracy dump and compare: a fused run against an unfused one, tensor by tensor (docs/accuracy_compare.md).

``dump_model`` / ``dump_graph`` write a dump directory (yirage.accuracy.layout); ``compare`` matches two
dumps (a fused kernel to the original ops it replaces: yirage.accuracy.mapping) and writes a CSV.
Names are imported on first use, so the CLI that only registers the subcommands stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"DEFAULT_THRESHOLDS": "comparison", "CompareReport": "comparison", "compare": "comparison",
          "dump_graph": "dump", "dump_model": "dump",
          "AccuracyError": "layout", "DumpReader": "layout", "Selection": "layout"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'yirage.accuracy' has no attribute {name!r}; it has {', '.join(__all__)}")
    return getattr(importlib.import_module(f"yirage.accuracy.{_WHERE[name]}"), name)
