"""Replay engine: record a compiled plan per input signature, replay it, count and explain what happened.

``FusedInferEngine`` (yirage/replay/engine.py) is the entry point; see
docs/replay.md. Importing this package imports neither numba nor any backend.
"""

from __future__ import annotations

from yirage.replay.engine import FusedInferEngine
from yirage.replay.signature import MODES, ReplayError

__all__ = ["MODES", "FusedInferEngine", "ReplayError"]
