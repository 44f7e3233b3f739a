"""Which task body each PersistentKernel runtime has per LayerSpec kind, checked when the runtime is imported.

Every runtime registers its task bodies (``register_task_bodies``) when its
module is imported, checked against ``LAYER_SPECS``: a kind added to the
table and not given a body (or declined, with the reason) on some runtime
fails that import, naming the runtime and the kinds. ``TASK_BODIES`` holds
every registered runtime (the kind x runtime matrix
``tests/test_runtime_contract.py`` prints). ``check_runtime`` refuses a
runtime object that breaks the protocol of
``yirage.backend.runtime_contract`` (run / value / stop, its kind).

A new runtime that reuses an existing set of bodies (the CUDA runtime and
the C-family renderer's) registers in one line::

    TASKS = register_task_bodies("cuda", cstyle.TASKS.bodies, declined=cstyle.TASKS.declined,
                                 where=cstyle.TASKS.where)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from yirage.backend.runtime_contract import PersistentRuntime, RuntimeKind
from yirage.errors import NotSupportedError, PluginError, YirageError
from yirage.persistent.specs import LAYER_SPECS


class RuntimeContractError(YirageError, TypeError):
    """A runtime that breaks the contract: a LayerSpec kind without a task body, or a malformed runtime."""


@dataclass(frozen=True)
class TaskBodies:
    """One runtime's task bodies by LayerSpec kind, the kinds it declines (kind -> why), and where a body goes.

    A body is whatever the runtime dispatches to: a method (launched, reference, C-family renderer) or
    the kind code its compiled ``execute`` branches on (cpu).
    """

    runtime: str
    bodies: Mapping[str, Any]
    declined: Mapping[str, str] = field(default_factory=dict)
    where: str = ""

    def missing(self) -> list[str]:
        """LAYER_SPECS kinds with neither a body nor a declared reason, in table order."""
        return [kind for kind in LAYER_SPECS if kind not in self.bodies and kind not in self.declined]

    def body(self, kind: str) -> Any:
        """The body of ``kind``; NotSupportedError naming this runtime when it declines or lacks one."""
        if kind in self.bodies:
            return self.bodies[kind]
        if kind in self.declined:
            raise NotSupportedError(f"the {self.runtime} PersistentKernel runtime runs no {kind!r} layers: "
                                    f"{self.declined[kind]}")
        raise NotSupportedError(f"the {self.runtime} PersistentKernel runtime has no task body for layer kind "
                                f"{kind!r}; add one to {self.where or 'its task table'}")

    def require(self, kinds: Iterable[str]) -> None:
        """Refuse a program using a kind this runtime cannot run (before any buffer is made)."""
        for kind in dict.fromkeys(kinds):
            self.body(kind)

    def cell(self, kind: str) -> str:
        """``body`` or ``declined`` (or ``MISSING``): one cell of the kind x runtime matrix."""
        return "body" if kind in self.bodies else "declined" if kind in self.declined else "MISSING"


#: every registered runtime's task bodies, by runtime name (filled as runtime modules are imported)
TASK_BODIES: dict[str, TaskBodies] = {}

#: what a single-device runtime declines: the collective layers of tensor-parallel runs (LayerSpec.collective)
SINGLE_DEVICE: dict[str, str] = {
    kind: (f"{spec.method} is a {spec.collective} across ranks and this runtime has no communication thread; "
           "run tensor-parallel decoders on backend='cpu'")
    for kind, spec in LAYER_SPECS.items() if spec.collective is not None}

#: what a runtime without a screened LM head declines: models then build the head as rmsnorm_linear + argmax
#: (PersistentKernel.runs), so this reason only reaches a program that adds the layer by hand
NO_SCREEN: dict[str, str] = {
    "screened_logits": "this runtime reads the LM head in one pass; build it with rmsnorm_linear_layer and "
                       "argmax_layer (PersistentKernel.runs('screened_logits') says where the two-pass head runs)"}


def check_task_bodies(table: TaskBodies) -> None:
    """Raise naming the runtime and the kinds when ``table`` does not cover LAYER_SPECS exactly."""
    missing = table.missing()
    if missing:
        raise RuntimeContractError(
            f"the {table.runtime} PersistentKernel runtime has no task body for layer kinds {missing} of "
            f"yirage.persistent.specs.LAYER_SPECS; add them to {table.where or 'its task table'}, or pass "
            "declined={kind: why} to its register_task_bodies call")
    unknown = sorted((set(table.bodies) | set(table.declined)) - set(LAYER_SPECS))
    both = sorted(set(table.bodies) & set(table.declined))
    if unknown or both:
        raise RuntimeContractError(
            f"the {table.runtime} PersistentKernel runtime registers "
            + (f"bodies for kinds LAYER_SPECS does not have: {unknown}" if unknown else
               f"kinds both with a body and declined: {both}") + "; fix its register_task_bodies call")


def register_task_bodies(runtime: str, bodies: Mapping[str, Any], *, declined: Mapping[str, str] | None = None,
                         where: str = "") -> TaskBodies:
    """Register ``runtime``'s task bodies (called at its module's import) after checking them against LAYER_SPECS.

    ``declined`` names the kinds the runtime deliberately cannot run, each with the reason a user sees
    (e.g. collectives on a single-device runtime); ``where`` is where a missing body belongs, for the error.
    """
    table = TaskBodies(runtime, dict(bodies), dict(declined or {}), where)
    check_task_bodies(table)
    TASK_BODIES[runtime] = table
    return table


def check_runtime(backend: Any, runtime: Any) -> PersistentRuntime:
    """``runtime`` as returned by ``backend.persistent_runtime``, refused unless it keeps the protocol.

    Its ``kind`` must be a RuntimeKind and, where the backend declares ``persistent_kind``, the same one
    (``info`` and ``pk.config`` report the declared kind without building a runtime).
    """
    lacking = [name for name in ("run", "value", "pick", "stop") if not callable(getattr(runtime, name, None))]
    kind = getattr(runtime, "kind", None)
    if not isinstance(kind, RuntimeKind):
        lacking.append(f"kind (a yirage.backend.runtime_contract.RuntimeKind, got {kind!r})")
    if lacking:
        raise PluginError(f"backend {backend.name!r}: persistent_runtime() returned {type(runtime).__name__}, which "
                          f"lacks {', '.join(lacking)} of yirage.backend.runtime_contract.PersistentRuntime")
    declared = getattr(backend, "persistent_kind", None)
    if declared is not None and declared != kind:
        raise PluginError(f"backend {backend.name!r} declares persistent_kind {declared} but its runtime "
                          f"{type(runtime).__name__} is {kind}; make Backend.persistent_kind match the runtime")
    return runtime  # type: ignore[no-any-return]


__all__ = ["SINGLE_DEVICE", "TASK_BODIES", "RuntimeContractError", "TaskBodies", "check_runtime",
           "check_task_bodies", "register_task_bodies"]
