"""Launch records of a rendered plan, and the one header line that carries them on top of its source.

Why one module: the renderers (``cstyle``, ``cstyle_matmul``, ``triton``) produce these records, and every
backend's render stage writes them on the first line of the source it puts in the compile cache, so that the
cache entry alone is enough to load; its load stage reads them back. The records, the line's format and its
parser live here once, so a renderer and the backends reading its output cannot drift apart.

The header is one comment line in the language of the source (``//`` for C-family, ``#`` for a Triton
module), then compact JSON; the language also says which record ``launches`` holds (``Launch`` for
C-family, ``TritonLaunch`` for Triton)::

    // yirage-launch: {"inputs":[...],"buffers":[...],"outputs":[...],"launches":[...],"scratch":[...],...}

``steps`` (what a call runs, in order) is written only when it differs from ``launches``: a ``Gemm`` step
(``{"gemm": {...}}``), a kernel (``{"kernel": name}``, one of ``launches``) or a Triton launch of a mixed
plan (``{"triton": name}``, one of ``triton``). A backend's own fields (e.g. OpenCL's ``work``) travel in
``extra``. A damaged or missing header raises ``LaunchHeaderError`` naming the file and the fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from yirage.compiler.kernel_ir import KernelPlan
from yirage.errors import YirageError

TAG = "yirage-launch: "
C_COMMENT = "//"  # C-family sources (OpenCL C, CUDA C, HIP, Metal)
PYTHON_COMMENT = "#"  # Triton modules


@dataclass(frozen=True)
class Scratch:
    """A buffer the launcher allocates for one call: ``count`` elements of ``dtype`` (zero-filled)."""

    name: str
    count: int
    dtype: str


@dataclass(frozen=True)
class Check:
    """After the call, a nonzero ``status[0]`` means bad input: raise ``error`` with ``message``.

    ``message`` may use ``{pos}`` (status - 1) and ``{value}`` (buffer ``value_of`` at flat ``pos``).
    """

    status: str
    error: str  # "IndexError" or "ValueError"
    message: str
    value_of: str = ""


@dataclass(frozen=True)
class Launch:
    """One C-family kernel launch: ``groups`` work-groups of ``local`` work-items over buffers ``args``."""

    kernel: str
    args: tuple[str, ...]
    groups: int
    local: int
    check: Check | None = None

    @property
    def global_size(self) -> int:
        return self.groups * self.local


@dataclass(frozen=True)
class TritonLaunch:
    """One Triton launch: ``kernel[grid](*buffers named by args, **constexprs, num_warps=...)``.

    ``constexprs`` are the block sizes, chosen from the shapes (powers of two; at least 16 for the
    ``tl.dot`` tiles); they are data, not part of the kernel text, so a later autotuner can change them
    without re-rendering: the 1-D grid is ``programs * prod(ceil(extent / constexprs[name]) for extent, name
    in tiles)`` (``grid_for``), and kernels derive their tile counts from the constexprs the same way.
    """

    kernel: str
    args: tuple[str, ...]
    programs: int
    tiles: tuple[tuple[int, str], ...]
    constexprs: tuple[tuple[str, int], ...]
    num_warps: int = 4
    check: Check | None = None

    @property
    def params(self) -> dict[str, int]:
        return dict(self.constexprs)

    def grid_for(self, params: dict[str, int]) -> tuple[int]:
        """The grid for block sizes ``params``."""
        return (max(1, self.programs * math.prod(-(-extent // params[name]) for extent, name in self.tiles)),)

    @property
    def grid(self) -> tuple[int]:
        return self.grid_for(self.params)


@dataclass(frozen=True)
class Gemm:
    """A step between kernels: ``out = a @ b`` by the backend's BLAS (torch.matmul) on views of plan buffers.

    ``a`` is contiguous over ``a_dims`` (batch + (M, K)); ``b`` is viewed with ``b_dims``/``b_strides``
    (batch + (K, N), stride 0 on a broadcast batch dim; without its own batch dims B is just (K, N)),
    ``out`` is contiguous over ``out_dims`` (batch + (M, N)); all hold ``dtype`` (float32 or float64).
    ``fallback`` computes the Matmul's whole output (epilogue included) from ``a`` and B: a backend that
    must not use its BLAS (e.g. TF32 allowed for float32) launches it in place of this step and skips
    the ``epilogue`` kernel ("" when the GEMM writes the Matmul's output itself). See ``cstyle_matmul``.
    """

    name: str  # the Matmul kernel this step belongs to
    a: str
    a_dims: tuple[int, ...]
    a_strides: tuple[int, ...]
    b: str
    b_dims: tuple[int, ...]
    b_strides: tuple[int, ...]
    out: str
    out_dims: tuple[int, ...]
    dtype: str
    fallback: str
    epilogue: str = ""


AnyLaunch = Launch | TritonLaunch  # a kernel of the source: C-family or Triton
Step = Launch | TritonLaunch | Gemm  # what a call runs


class LaunchHeaderError(YirageError, ValueError):
    """A rendered source whose launch header is missing or damaged: not written by this version of yirage."""


@dataclass(frozen=True)
class LaunchHeader:
    """How to launch a rendered plan: what its render stage writes on the source's first line.

    ``inputs``: (buffer, graph input index, dtype); ``buffers``: (name, dims, dtype, role) of every output
    and temporary the launcher allocates; ``launches``: every kernel of the source (``Launch`` for C-family,
    ``TritonLaunch`` for a Triton module); ``steps``: what a call runs, in order (``launches`` unless the
    renderer split out ``Gemm`` steps or a mixed plan runs ``triton`` launches among them); ``extra``: a
    backend's own JSON fields.
    """

    inputs: tuple[tuple[str, int, str], ...]
    buffers: tuple[tuple[str, tuple[int, ...], str, str], ...]
    outputs: tuple[str, ...]
    launches: tuple[AnyLaunch, ...]
    scratch: tuple[Scratch, ...]
    steps: tuple[Step, ...]
    triton: tuple[TritonLaunch, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: KernelPlan, launches: Sequence[AnyLaunch], scratch: Sequence[Scratch],
           steps: Sequence[Step] | None = None, triton: Sequence[TritonLaunch] = (), **extra: Any) -> LaunchHeader:
        """The header of ``plan`` rendered into ``launches`` (``steps`` default: the launches, in order)."""
        clash = sorted(set(extra) & _FIELDS)
        if clash:
            raise ValueError(f"extra header fields {clash} would shadow the header's own; rename them")
        return cls(
            inputs=tuple((n, plan.buffers[n].index, plan.buffers[n].dtype.name) for n in plan.inputs),
            buffers=tuple((b.name, tuple(b.dims), b.dtype.name, b.role) for b in plan.buffers.values()
                          if b.role != "input"),
            outputs=tuple(plan.outputs), launches=tuple(launches), scratch=tuple(scratch),
            steps=tuple(launches if steps is None else steps), triton=tuple(triton), extra=dict(extra))

    @staticmethod
    def prefix(comment: str) -> str:
        """What the header line starts with in a language whose line comments start with ``comment``."""
        return f"{comment} {TAG}"

    def line(self, comment: str) -> str:
        """The header as one line (JSON escapes every newline), without its line break."""
        data: dict[str, Any] = {
            "inputs": [list(x) for x in self.inputs],
            "buffers": [[n, list(dims), d, role] for n, dims, d, role in self.buffers],
            "outputs": list(self.outputs),
            "launches": [asdict(x) for x in self.launches],
            "scratch": [asdict(s) for s in self.scratch],
        }
        if self.steps != self.launches:
            data["steps"] = [self._step_json(x) for x in self.steps]
        if self.triton:
            data["triton"] = [asdict(x) for x in self.triton]
        data.update(self.extra)
        return self.prefix(comment) + json.dumps(data, separators=(",", ":"))

    def write(self, body: str, comment: str) -> str:
        """``body`` (the rendered source) with this header as its first line."""
        return self.line(comment) + "\n" + body

    def _step_json(self, step: Step) -> dict[str, Any]:
        if isinstance(step, Gemm):
            return {"gemm": asdict(step)}
        if isinstance(step, TritonLaunch) and step in self.triton:
            return {"triton": step.kernel}
        return {"kernel": step.kernel}

    @classmethod
    def read(cls, source: str, where: str, comment: str) -> LaunchHeader:
        """The header on ``source``'s first line; LaunchHeaderError naming ``where`` when missing or damaged.

        ``comment`` is the source's language (``C_COMMENT`` or ``PYTHON_COMMENT``): it decides the record
        each of ``launches`` must be, so a header of the other language is refused as damaged.
        """
        if comment not in _LAUNCH_OF:
            raise ValueError(f"comment {comment!r} is not a language's: use C_COMMENT or PYTHON_COMMENT")
        first, _, _ = source.partition("\n")
        prefix = cls.prefix(comment)
        fix = ("delete the compile-cache entry it belongs to (its directory) so the plan is rendered and built "
               "again by this version of yirage")
        if not first.startswith(prefix):
            raise LaunchHeaderError(f"{where} does not start with a launch header line ({prefix.strip()!r}); {fix}")
        try:
            return cls._from_json(json.loads(first.removeprefix(prefix)), _LAUNCH_OF[comment])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LaunchHeaderError(
                f"the launch header of {where} is damaged ({type(exc).__name__}: {exc}); {fix}") from exc

    @classmethod
    def _from_json(cls, m: dict[str, Any], launch: Callable[[dict[str, Any]], AnyLaunch]) -> LaunchHeader:
        launches = tuple(launch(x) for x in m["launches"])
        triton = tuple(_triton_launch(x) for x in m.get("triton", ()))
        by_kernel = {x.kernel: x for x in launches}
        by_triton = {x.kernel: x for x in triton}
        steps: tuple[Step, ...] = launches
        if "steps" in m:
            steps = tuple(_gemm(x["gemm"]) if "gemm" in x else by_triton[x["triton"]] if "triton" in x
                          else by_kernel[x["kernel"]] for x in m["steps"])
        return cls(
            inputs=tuple((str(n), int(i), str(d)) for n, i, d in m["inputs"]),
            buffers=tuple((str(n), tuple(int(x) for x in dims), str(d), str(r)) for n, dims, d, r in m["buffers"]),
            outputs=tuple(str(n) for n in m["outputs"]),
            launches=launches,
            scratch=tuple(Scratch(str(s["name"]), int(s["count"]), str(s["dtype"])) for s in m["scratch"]),
            steps=steps, triton=triton, extra={k: v for k, v in m.items() if k not in _FIELDS})


_FIELDS = frozenset({"inputs", "buffers", "outputs", "launches", "scratch", "steps", "triton"})


def _check(x: dict[str, Any] | None) -> Check | None:
    if not x:
        return None
    return Check(str(x["status"]), str(x["error"]), str(x["message"]), str(x.get("value_of", "")))


def _launch(x: dict[str, Any]) -> Launch:
    return Launch(str(x["kernel"]), tuple(str(a) for a in x["args"]), int(x["groups"]), int(x["local"]),
                  _check(x["check"]))


def _triton_launch(x: dict[str, Any]) -> TritonLaunch:
    return TritonLaunch(str(x["kernel"]), tuple(str(a) for a in x["args"]), int(x["programs"]),
                        tuple((int(e), str(n)) for e, n in x["tiles"]),
                        tuple((str(n), int(v)) for n, v in x["constexprs"]), int(x["num_warps"]), _check(x["check"]))


#: the launch record of each language's sources, by the comment that starts the header line
_LAUNCH_OF: dict[str, Callable[[dict[str, Any]], AnyLaunch]] = {C_COMMENT: _launch, PYTHON_COMMENT: _triton_launch}
_GEMM_DIMS = ("a_dims", "a_strides", "b_dims", "b_strides", "out_dims")


def _gemm(x: dict[str, Any]) -> Gemm:
    return Gemm(**{key: tuple(int(v) for v in value) if key in _GEMM_DIMS else str(value)
                   for key, value in x.items()})


__all__ = ["C_COMMENT", "PYTHON_COMMENT", "Check", "Gemm", "Launch", "LaunchHeader", "LaunchHeaderError",
           "Scratch", "TritonLaunch"]
