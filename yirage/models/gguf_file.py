"""A GGUF file's header, parsed in one checked pass: its metadata as Python values and its tensors as views.

Why not ``gguf.GGUFReader`` (the library llama.cpp publishes, still used here for its type tables and
dequantizers): it builds numpy objects for every metadata element (about 0.7 KB and 11 us per number, 1.4 KB and
30 us per string), so SmolLM2's 49152-token vocabulary and 48900 merges took 4 s to open, on every load, and a
small file declaring a 10**7-element array cost gigabytes and minutes before any value could be checked. This
reader walks the header once through a read-only memory map, checks every count, length and extent against the
file and the limits below before it makes anything, and keeps plain Python values: the same file opens in about
0.1 s.

``GGUFFile`` offers what yirage reads of a ``GGUFReader``: ``fields`` (name -> ``GGUFField`` with ``types``,
``data`` and ``contents()``) and ``tensors`` (``GGUFTensor``: name, ggml ``tensor_type``, ggml-order ``shape``
and ``data``, a read-only view of the file laid out as GGUFReader lays it out: float types as their numpy dtype,
the others as rows of bytes).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yirage.models.config import ModelError

#: Limits a GGUF header is checked against before anything is made for it. Real Llama-family files stay far below
#: them: the largest vocabularies have 262144 tokens (Gemma 3), the longest merge lists 280147 (Llama 3), a
#: 126-layer model about 1.1k tensors and 50 keys.
MAX_ARRAY_LEN = 1 << 20
MAX_METADATA_ELEMENTS = 1 << 21  # all arrays together
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 16
GGML_MAX_DIMS = 4
# GGUFValueType -> struct code: UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, -, -, UINT64, INT64, FLOAT64
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# ggml types GGUFReader presents as their numpy dtype (the rest as bytes, a row's blocks after one another)
_FLOAT_TENSORS = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class GGUFError(ModelError):
    """A GGUF file yirage cannot read; the message names the cause and the fix."""


@dataclass(frozen=True)
class GGUFField:
    """One metadata entry: ``types`` as GGUFReader lists them ([ARRAY, element type] for an array), ``value``."""

    name: str
    types: list[Any]
    value: Any

    @property
    def data(self) -> Any:
        """The elements of an array (what ``len`` counts), the value itself otherwise."""
        return self.value

    def contents(self) -> Any:
        """The value as Python: str, int, float, bool, or a list of them."""
        return self.value.tolist() if hasattr(self.value, "tolist") else self.value


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: fastest-varying dimension first
    n_bytes: int
    data: Any  # a read-only numpy view of the file


class GGUFFile:
    """The parsed header of ``path``; see the module docstring. Tensor data is read only when a view is used."""

    def __init__(self, path: Path, fields: dict[str, GGUFField], tensors: list[GGUFTensor]) -> None:
        self.path, self.fields, self.tensors = path, fields, tensors


class _Cursor:
    """Reads a GGUF header through a read-only memory map and never past the file's end (so nothing it is told
    to read can make it allocate more than the file holds)."""

    def __init__(self, buf: Any, size: int, name: str) -> None:
        self.buf, self.size, self.name, self.pos, self.order = buf, size, name, 0, "<"

    def fail(self, what: str, why: str) -> GGUFError:
        return GGUFError(f"{self.name!r} starts like a GGUF file but cannot be parsed ({what} {why}); the file is "
                         "truncated or corrupt: download or convert it again")

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n > self.size - start:
            raise self.fail(what, f"needs {n} bytes at offset {start}, past the end of the file ({self.size} bytes)")
        self.pos = start + n
        return start

    def scalar(self, kind: int, what: str) -> Any:
        code = _SCALARS[kind]
        return struct.unpack_from(self.order + code, self.buf, self.take(struct.calcsize(code), what))[0]

    def uint(self, width: int, what: str) -> int:
        return self.scalar(_UINT32 if width == 4 else 10, what)

    def text(self, what: str) -> str:
        n = self.uint(8, f"the length of {what}")
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(what, f"is not UTF-8 text ({exc})") from exc

    def texts(self, count: int, what: str) -> list[str]:
        """An array of ``count`` strings (each a u64 length and its bytes)."""
        unpack, buf, size, pos = struct.Struct(self.order + "Q").unpack_from, self.buf, self.size, self.pos
        out = []
        try:
            for _ in range(count):
                if pos + 8 > size:
                    break
                end = pos + 8 + unpack(buf, pos)[0]
                if end > size:
                    break
                out.append(buf[pos + 8:end].decode("utf-8"))
                pos = end
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} (string {len(out)})", f"is not UTF-8 text ({exc})") from exc
        if len(out) < count:
            raise self.fail(what, f"(an array of {count} strings) runs past the end of the file ({size} bytes)")
        self.pos = pos
        return out

    def numbers(self, kind: int, count: int, what: str) -> Any:
        import numpy as np

        dtype = np.dtype(_NUMPY[kind]).newbyteorder(self.order)
        start = self.take(count * dtype.itemsize, f"{what} (an array of {count} values)")
        return np.frombuffer(self.buf, dtype, count, start).astype(dtype.newbyteorder("="))


def read_file(path: Path) -> GGUFFile:
    """The header of the GGUF file ``path`` (its magic bytes already checked), every count, length and tensor
    extent checked against the file and the limits above before anything is made for it; GGUFError otherwise."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFValueType

    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        h = _Cursor(buf, size, str(path))
        h.take(4, "the magic bytes")
        version = h.uint(4, "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine (gguf.GGUFReader's own test)
            h.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in (2, 3):
            raise GGUFError(f"GGUF file {str(path)!r} has version {version}; yirage reads versions 2 and 3: "
                            "re-convert the model with a current llama.cpp")
        tensors, keys = h.uint(8, "the tensor count"), h.uint(8, "the metadata key count")
        _check_limit(path, "tensor count", tensors, MAX_TENSORS, "a 126-layer Llama has about 1.1k tensors")
        _check_limit(path, "metadata key count", keys, MAX_KEYS, "real files have about 50 keys")
        fields = _read_metadata(h, keys, GGUFValueType)
        alignment = fields["general.alignment"].value if "general.alignment" in fields else 32
        infos = [_read_tensor_info(h, i, GGML_QUANT_SIZES) for i in range(tensors)]
        start = -(-h.pos // alignment) * alignment
    names = [t[0] for t in infos]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise h.fail(f"tensor {twice!r}", "appears twice")
    for name, dims, kind, offset, n_bytes in infos:
        if start + offset + n_bytes > size:
            raise h.fail(f"tensor {name!r} ({kind.name}, shape {list(dims)})", f"declares {n_bytes} bytes at offset "
                         f"{start + offset}, past the end of the file ({size} bytes)")
    data = np.memmap(path, mode="r") if infos else None
    views = []
    for name, dims, kind, offset, n_bytes in infos:
        rows = tuple(reversed(dims))
        view = data[start + offset:start + offset + n_bytes]
        if kind.name in _FLOAT_TENSORS:
            view = view.view(np.dtype(_FLOAT_TENSORS[kind.name]).newbyteorder(h.order)).reshape(rows)
        else:
            block, type_size = GGML_QUANT_SIZES[kind]
            view = view.reshape((*rows[:-1], rows[-1] // block * type_size))
        views.append(GGUFTensor(name, kind, dims, n_bytes, view))
    return GGUFFile(path, fields, views)


def _check_limit(path: Path, what: str, value: int, limit: int, real: str) -> None:
    if value > limit:
        raise GGUFError(f"GGUF file {str(path)!r} declares a {what} of {value}, more than the {limit} yirage accepts "
                        f"({real}); reading it would take gigabytes of memory before anything could be checked. The "
                        "file is damaged or not a Llama-family model: re-convert it")


def _read_metadata(h: _Cursor, count: int, value_types: Any) -> dict[str, GGUFField]:
    """``count`` metadata entries, each checked against the file and the limits before its value is made."""
    fields: dict[str, GGUFField] = {}
    elements = 0
    for i in range(count):
        key = h.text(f"the name of metadata entry {i}")
        if key in fields:
            raise h.fail(f"metadata key {key!r}", "appears twice")
        kind = h.uint(4, f"the type of metadata {key!r}")
        if kind == _ARRAY:
            sub, n = h.uint(4, f"the element type of metadata {key!r}"), h.uint(8, f"the length of metadata {key!r}")
            if n > MAX_ARRAY_LEN:
                raise GGUFError(f"GGUF metadata {key!r} is an array of {n} values, more than the {MAX_ARRAY_LEN} "
                                "yirage accepts (the largest real vocabularies have 262144 tokens): reading it "
                                "would take gigabytes of memory. The file is damaged or not a Llama-family model: "
                                "re-convert it")
            elements += n
            _check_limit(Path(h.name), "total of metadata array values", elements, MAX_METADATA_ELEMENTS,
                         "a real vocabulary's tokens, scores, types and merges stay under a million")
            if sub == _STRING:
                value = h.texts(n, f"metadata {key!r}")
            elif sub in _SCALARS:
                value = h.numbers(sub, n, f"metadata {key!r}")
            else:
                raise h.fail(f"metadata {key!r}", f"is an array of type {sub} (arrays of arrays are not GGUF, and "
                             "other types are unknown)")
            types = [value_types.ARRAY, value_types(sub)]
        elif kind == _STRING:
            value, types = h.text(f"metadata {key!r}"), [value_types.STRING]
        elif kind in _SCALARS:
            value, types = h.scalar(kind, f"metadata {key!r}"), [value_types(kind)]
            if key == "general.alignment" and kind == _UINT32 and (value < 1 or value & (value - 1)):
                raise h.fail(f"metadata general.alignment={value}", "is not a power of two")
        else:
            raise h.fail(f"metadata {key!r}", f"has the unknown value type {kind}")
        fields[key] = GGUFField(key, types, value)
    if "general.alignment" in fields and fields["general.alignment"].types != [value_types.UINT32]:
        raise h.fail("metadata general.alignment", f"has type {fields['general.alignment'].types[0].name}, not "
                     "UINT32")
    return fields


def _read_tensor_info(h: _Cursor, i: int, sizes: dict[Any, tuple[int, int]]) -> tuple[str, tuple[int, ...], Any,
                                                                                       int, int]:
    """One tensor's entry: (name, ggml dims, type, data offset, bytes), checked to describe a whole ggml tensor."""
    from gguf import GGMLQuantizationType

    name = h.text(f"the name of tensor {i}")
    n_dims = h.uint(4, f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise h.fail(f"tensor {name!r}", f"has {n_dims} dimensions (ggml tensors have 1 to {GGML_MAX_DIMS})")
    dims = tuple(h.uint(8, f"the shape of tensor {name!r}") for _ in range(n_dims))
    raw = h.uint(4, f"the type of tensor {name!r}")
    offset = h.uint(8, f"the data offset of tensor {name!r}")
    try:
        kind = GGMLQuantizationType(raw)
    except ValueError:
        raise h.fail(f"tensor {name!r}", f"has the unknown ggml type {raw}") from None
    block, type_size = sizes[kind]
    if dims[0] % block:
        raise h.fail(f"tensor {name!r} ({kind.name}, shape {list(dims)})", f"has rows of {dims[0]} values, not "
                     f"whole {kind.name} blocks of {block}")
    return name, dims, kind, offset, math.prod(dims) // block * type_size
