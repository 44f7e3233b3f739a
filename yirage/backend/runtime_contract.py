"""The PersistentKernel runtime contract: what ``Backend.persistent_runtime`` returns, and how it runs a step.

Why a declared contract: ``Backend.persistent_runtime(program, config)``
returns the object ``PersistentKernel`` drives (``run``, ``value``,
``stop``); several runtimes implement it (cpu, OpenCL, launched Triton, the
serial oracle, CUDA launched and resident), and each once guessed the others' behaviour
from their code. Here it is written down, in the backend layer because the
Backend interface names it:

- ``PersistentRuntime``: the protocol, with what Ctrl-C guarantees.
- ``RuntimeKind``: how a runtime runs a step, and so which configuration
  fields it honours (``PERSISTENT`` honours ``num_workers`` and
  ``num_local_schedulers``, ``RESIDENT`` ``num_workers`` only; ``LAUNCHED``
  and ``SERIAL`` ignore both). A
  backend declares its kind as ``Backend.persistent_kind`` without building
  a runtime, so ``info`` and ``PersistentKernel.config`` say which fields
  are ignored, and why, on a machine without the device.

Which task bodies each runtime has (per LayerSpec kind, checked at import)
is the persistent layer's part: ``yirage.persistent.runtime``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

#: the configuration fields a PersistentKernel passes to its runtime (yirage.autoconfig resolves them)
CONFIG_FIELDS = ("num_workers", "num_local_schedulers")


@dataclass(frozen=True)
class RuntimeKind:
    """How a runtime runs a decode step; ``honours``: the CONFIG_FIELDS it reads, ``why``: how it schedules."""

    name: str
    honours: frozenset[str]
    why: str

    def __str__(self) -> str:
        return self.name

    def ignores(self, field_name: str) -> str:
        """'' if this kind honours ``field_name``, else the sentence ``pk.config`` and ``info`` show."""
        if field_name in self.honours:
            return ""
        return f"ignored by the {self.name} runtime ({self.why})"


#: worker and scheduler threads claim a step's tasks as their events fire, in one long-running call (MPK)
PERSISTENT = RuntimeKind("persistent", frozenset(CONFIG_FIELDS),
                         "workers run the tasks, local schedulers release them as events fire")
#: a step's task kernels are launched (enqueued) in layer order; the device schedules their blocks
LAUNCHED = RuntimeKind("launched", frozenset(),
                       "a step's task kernels run in layer order on one stream or queue; the device schedules them")
#: one resident kernel runs every step: its ``num_workers`` thread blocks run each layer's tasks, then meet at a
#: grid-wide barrier (no schedulers: the barrier orders the layers), until EOS or the step limit
RESIDENT = RuntimeKind("resident", frozenset({"num_workers"}),
                       "one resident kernel's thread blocks run each layer's tasks between grid-wide barriers")
#: the task graph walked one task at a time on the host (the reference oracle)
SERIAL = RuntimeKind("serial", frozenset(), "one task at a time on the host, in task-graph order")
RUNTIME_KINDS: dict[str, RuntimeKind] = {k.name: k for k in (PERSISTENT, RESIDENT, LAUNCHED, SERIAL)}


@runtime_checkable
class PersistentRuntime(Protocol):
    """What ``Backend.persistent_runtime(program, config)`` returns and ``PersistentKernel`` drives.

    It is built once per compile from the frozen ``PersistentProgram`` and the resolved configuration
    (``config``: CONFIG_FIELDS -> int); it reads the fields ``kind.honours`` names and may ignore the
    rest (``pk.config`` and ``info`` say so). The kernel's lock serializes every call below except
    ``stop``.

    ``run(max_new_tokens)`` decodes up to ``max_new_tokens`` steps (None: until every row reaches an EOS
    token or ``max_seq_length``), appending each row's picked token to ``tokens`` and advancing ``step``
    in place, and returns the steps run. A token id outside the vocabulary raises
    ``yirage.persistent.guard.token_out_of_range`` (the control buffer's ERROR slots carry it from the
    device: ``yirage.persistent.control``). When the exit hook stopped the run it raises
    ``InterpreterExitingError`` (``shutdown.check_not_stopped``).

    ``value(name)`` is the runtime's tensor for the program tensor ``name`` as of the last run
    (``PersistentKernel.read`` copies it under the lock).

    ``pick(logits)`` runs only the program's token-picking layer (argmax or sampling) on ``logits`` (batch,
    vocab float32 on the program's device), as a decode step would at each row's current position
    ``step[b]``, and returns the picked ids (batch,) int64 on that device; it writes neither ``tokens`` nor
    ``step``. The engine picks a prompt's first token with it, so a seeded generation draws every token
    from one sampler: the runtime's own.

    ``stop()`` may be called from any thread while ``run`` is in flight (``yirage.persistent.shutdown``'s
    exit hook does, after Ctrl-C in the main thread): ``run`` returns soon after, between tasks
    (``PERSISTENT``, ``SERIAL``) or between steps (``LAUNCHED``). ``run`` registers with
    ``shutdown.decoding(self)`` while in flight.

    Ctrl-C: ``KeyboardInterrupt`` propagates out of ``run`` (the cpu runtime: within milliseconds, its
    threads stopped between tasks); by then nothing the runtime started still runs (it waits for its
    device), and ``tokens``/``step`` hold whole steps only, since a step is committed by one serial
    section or one kernel: a persistent runtime abandons the step in flight, a launched runtime commits
    it if its commit kernel was launched. The serial oracle, plain Python, may be interrupted anywhere.

    Optional, for a runtime that compiles its code on first use (``PersistentKernel`` looks them up with
    ``getattr``): ``compiling()`` returns at once whether that code is still being compiled, starting the compile
    in the background on its first call (False once ``run`` would not wait for a compile, and where the runtime
    cannot compile in the background); ``prepare()`` compiles (or loads) it now and returns when ``run`` would not
    wait. While ``compiling()`` is True, ``PersistentKernel(..)(eager_start=True)`` runs greedy steps with
    ``yirage.reference.eager.EagerRuntime`` on the same tensors, and hands over between steps.
    """

    kind: ClassVar[RuntimeKind]

    def run(self, max_new_tokens: int | None = None) -> int: ...

    def value(self, name: str) -> Any: ...

    def pick(self, logits: Any) -> Any: ...

    def stop(self) -> None: ...


__all__ = ["CONFIG_FIELDS", "LAUNCHED", "PERSISTENT", "RUNTIME_KINDS", "SERIAL", "PersistentRuntime", "RuntimeKind"]
