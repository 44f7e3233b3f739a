"""What a replay engine did: the counters ``get_stats()`` reports, and where the time went.

Kept apart from the engine so every counter has one definition (below) and
the report is built in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class ReplayStats:
    """Counters since the engine was made or ``clear_cache()`` last ran.

    Every call is exactly one hit or one miss; a miss makes one cache entry.
    ``recordings``: entries that recorded a plan (a fused plan, or the
    graph_replay fallback); eager entries record nothing. ``fusion_attempts``:
    misses with fusion on for which a fused plan exists (every kernel graph,
    a model's decode steps); each ends as one success or one fallback (or raises, with fallback=False).
    ``capture_fallbacks``: fused plans whose device graph capture failed (they run uncaptured).
    ``planning_seconds``: recording, compiling, capturing and warming up (misses);
    ``compute_seconds``: running the plans for the calls themselves.
    """

    cache_hits: int = 0
    cache_misses: int = 0
    recordings: int = 0
    fusion_attempts: int = 0
    fusion_successes: int = 0
    fusion_fallbacks: int = 0
    capture_fallbacks: int = 0
    planning_seconds: float = 0.0
    compute_seconds: float = 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def report(self, enabled: bool, backend: str, modes: dict[str, str], reasons: dict[str, str],
               device_graphs: list[str]) -> dict[str, Any]:
        """The ``get_stats()`` dict: InfiniLM's keys, then yirage's additions (backend, reasons, device graphs,
        times). ``device_graphs``: the keys whose calls replay a captured device graph."""
        return {
            "enabled": enabled,
            "cache_size": len(modes),
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "recordings": self.recordings,
            "fusion_attempts": self.fusion_attempts,
            "fusion_successes": self.fusion_successes,
            "fusion_fallbacks": self.fusion_fallbacks,
            "cached_shapes": list(modes),
            "fusion_modes": dict(modes),
            "fallback_reasons": dict(reasons),
            "device_graphs": list(device_graphs),
            "capture_fallbacks": self.capture_fallbacks,
            "backend": backend,
            "planning_seconds": self.planning_seconds,
            "compute_seconds": self.compute_seconds,
        }
