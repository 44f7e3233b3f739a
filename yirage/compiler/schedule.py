"""Schedule knobs: the per-kernel choices a backend offers the superoptimizer, and a plan's chosen values.

A renderer makes decisions the IR leaves open: which matmul strategy (a generated loop or a BLAS call), how many
threads or how wide a work-group. Each backend picks them with its own cost model; where that model can be wrong
for a shape or a machine, it declares the decision as a ``Knob`` (``Backend.schedule_knobs(plan)``): the kernel
it belongs to, a name, and the legal values, the first being what the backend picks by itself. The core searches
over them (``yirage.superopt``) without knowing what any knob means; a plan carries the values chosen
(``KernelPlan.schedule``, part of its digest, so every choice is its own cache entry), and the renderer reads them
back with ``choice``. A plan without a schedule renders exactly as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from yirage.errors import YirageError

#: the types a knob value may have: they go into JSON (the superoptimizer's cache) and into plan digests
VALUE_TYPES = (str, int, bool)


class ScheduleError(YirageError, ValueError):
    """A knob or a schedule that a backend, a cache entry or a caller got wrong."""


@dataclass(frozen=True)
class Knob:
    """One schedule decision of one kernel: ``values[0]`` is the backend's own pick, the rest are alternatives."""

    kernel: str
    name: str
    values: tuple[Any, ...]
    doc: str = ""

    @property
    def default(self) -> Any:
        return self.values[0]


def check_knobs(knobs: Any, plan: Any, owner: str) -> tuple[Knob, ...]:
    """``knobs`` as a backend returned them, checked: Knob records of the plan's kernels, two or more distinct
    JSON-able values each, no knob twice. ``owner`` names the backend in the error."""
    try:
        items = tuple(knobs)
    except TypeError as exc:
        raise ScheduleError(f"{owner}.schedule_knobs() returned {type(knobs).__name__}, not a sequence of Knob "
                            "records (yirage.compiler.schedule.Knob)") from exc
    kernels = {k.name for k in plan.kernels}
    seen: set[tuple[str, str]] = set()
    for knob in items:
        if not isinstance(knob, Knob):
            raise ScheduleError(f"{owner}.schedule_knobs() returned a {type(knob).__name__}; return Knob records")
        where = f"{owner} knob {knob.kernel}.{knob.name}"
        if knob.kernel not in kernels:
            raise ScheduleError(f"{where}: the plan has no kernel {knob.kernel!r} (it has {sorted(kernels)})")
        if (knob.kernel, knob.name) in seen:
            raise ScheduleError(f"{where} is declared twice")
        seen.add((knob.kernel, knob.name))
        if not isinstance(knob.values, tuple) or len(knob.values) < 2:
            raise ScheduleError(f"{where}: values must be a tuple of two or more choices, got {knob.values!r}")
        if any(type(v) not in VALUE_TYPES for v in knob.values) or len(set(knob.values)) != len(knob.values):
            raise ScheduleError(f"{where}: values must be distinct str, int or bool, got {knob.values!r}")
    return items


def legal(knobs: Sequence[Knob], schedule: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether every value of ``schedule`` is one its knob allows (a cached schedule from another version may not)."""
    allowed = {(k.kernel, k.name): k.values for k in knobs}
    return all((kernel, name) in allowed and any(type(v) is type(value) and v == value for v in allowed[(kernel, name)])
               for kernel, values in schedule.items() for name, value in values.items())  # JSON's true is not 1


def with_schedule(plan: Any, schedule: Mapping[str, Mapping[str, Any]]) -> Any:
    """A copy of ``plan`` carrying ``schedule`` (kernel -> knob -> value); its digest changes with the schedule, so
    every rendered source and cache entry names its choices. Values equal to a knob's default may be left out."""
    clean = {kernel: dict(sorted(values.items())) for kernel, values in sorted(schedule.items()) if values}
    if not clean:
        return plan
    digest = hashlib.sha256(f"{plan.digest} schedule {json.dumps(clean, sort_keys=True)}".encode()).hexdigest()
    return replace(plan, digest=digest, schedule=clean)


def choice(plan: Any, kernel: str, knob: str, default: Any) -> Any:
    """The value ``plan``'s schedule gives ``kernel``'s ``knob``, else ``default`` (the backend's own pick)."""
    return plan.schedule.get(kernel, {}).get(knob, default)


def describe(schedule: Mapping[str, Mapping[str, Any]]) -> str:
    """``k1.strategy=split_k k2.parallel=false``: stable, short, and what the superoptimizer's report shows."""
    return " ".join(f"{kernel}.{name}={json.dumps(value) if not isinstance(value, str) else value}"
                    for kernel, values in sorted(schedule.items()) for name, value in sorted(values.items()))
