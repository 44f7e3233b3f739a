"""Element types of kernel-graph tensors, with their torch and numpy twins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DType:
    """A tensor element type; ``yr.float32`` etc. are the instances."""

    name: str
    itemsize: int
    kind: str  # "float" or "int"

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, self.name)

    def __repr__(self) -> str:
        return f"yr.{self.name}"

    def __str__(self) -> str:
        return self.name


float32 = DType("float32", 4, "float")
float16 = DType("float16", 2, "float")
bfloat16 = DType("bfloat16", 2, "float")
float64 = DType("float64", 8, "float")
int32 = DType("int32", 4, "int")
int64 = DType("int64", 8, "int")

DTYPES: dict[str, DType] = {d.name: d for d in (float32, float16, bfloat16, float64, int32, int64)}


def as_dtype(value: Any) -> DType:
    """Accept ``yr.float16``, ``'float16'`` or ``torch.float16``."""
    if isinstance(value, DType):
        return value
    name = value if isinstance(value, str) else str(value).removeprefix("torch.")
    try:
        return DTYPES[name]
    except KeyError:
        known = ", ".join(f"yr.{n}" for n in DTYPES)
        raise TypeError(f"unsupported dtype {value!r}; use one of {known}") from None
