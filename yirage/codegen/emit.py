"""Source text built line by line, indented by nesting depth."""

from __future__ import annotations


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
