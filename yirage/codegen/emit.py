"""Source text built line by line, indented by nesting depth; and the C-family loop that keeps loads in flight."""

from __future__ import annotations

from collections.abc import Callable

#: independent loads a thread issues before it uses one, in the loops of the C-family row, attention and
#: PersistentKernel kernels: a GPU issues in order, so a loop that uses each load before the next one waits a memory
#: round trip per element (the first H100 profile: 25 us per decode attention over 80 positions, 5 us per RMSNorm
#: of 576, 74 us per argmax of 49152)
ILP = 8


def ilp_loop(index_type: str, var: str, start: str, count: int | str, stride: int,
             values: Callable[[int, str], list[str]], fold: Callable[[int, str], list[str]],
             ilp: int = ILP) -> list[str]:
    """C lines of ``for (var = start; var < count; var += stride)`` that run ``ilp`` iterations a round: every
    iteration's ``values(u, var_u)`` (loads into names ending in ``u``) first, then their ``fold(u, var_u)`` in
    iteration order, so the result is the plain loop's, bit for bit; the iterations past the last whole round run
    one at a time (as u = 0)."""
    v, it = var, index_type
    lines = [f"{it} {v} = {start};", f"for (; {v} + {(ilp - 1) * stride} < {count}; {v} += {ilp * stride}) {{"]
    lines += [f"    {it} {v}_{u} = {v} + {u * stride};" for u in range(ilp)]
    for u in range(ilp):
        lines += [f"    {line}" for line in values(u, f"{v}_{u}")]
    for u in range(ilp):
        lines += [f"    {line}" for line in fold(u, f"{v}_{u}")]
    lines += ["}", f"for (; {v} < {count}; {v} += {stride}) {{", f"    {it} {v}_0 = {v};",
              *(f"    {line}" for line in values(0, f"{v}_0") + fold(0, f"{v}_0")), "}"]
    return ["{", *(f"    {line}" for line in lines), "}"]


class Emitter:
    """Collects lines of generated source; ``with emit.block(header):`` indents the body.

    The indent unit is a parameter so that brace languages (C, MSL) can use the
    same emitter as Python; the caller writes any braces itself.
    """

    def __init__(self, indent: str = "    ") -> None:
        self.lines: list[str] = []
        self.depth = 0
        self.indent = indent

    def __call__(self, line: str) -> None:
        self.lines.append(self.indent * self.depth + line)

    def block(self, header: str) -> Emitter:
        """Emit ``header``; used as a context manager, the lines inside are one level deeper."""
        self(header)
        return self

    def __enter__(self) -> Emitter:
        self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1

    def source(self) -> str:
        """The lines so far, newline-joined with a final newline."""
        return "\n".join(self.lines) + "\n"
