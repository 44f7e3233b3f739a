"""Reading kernel-graph JSON: every malformed document becomes one GraphError that says what is wrong.

``KernelGraph.from_json`` takes JSON text, a file path (Mirage's
``from_json("graph.json")``) or an already-parsed dict; this module turns
each into a checked dict, so nothing but GraphError escapes on bad input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from yirage.graph.dtypes import DTYPES
from yirage.graph.ops import OPS, GraphError

FORMAT_VERSION = 1
#: the attributes each op records (to_dict writes them all)
ATTRS: dict[str, tuple[str, ...]] = {"reduction": ("dim",), "softmax": ("dim",), "clamp": ("min_val", "max_val"),
                                     "rms_norm": ("eps", "normalized_shape"), "attention": ("scale",)}
#: attributes a hand-written document may leave out, with the value they then take
OPTIONAL_ATTRS: dict[str, dict[str, Any]] = {"clamp": {"min_val": None, "max_val": None},
                                             "attention": {"scale": None}}
#: operands an op may omit at the end (attention's lengths)
OPTIONAL_OPERANDS = {"attention": 1}
_NODE_KEYS = frozenset({"op", "inputs", "attrs", "dims", "dtype", "strides", "name"})


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_source(source: Any) -> dict[str, Any]:
    """JSON text (a str starting with '{'), a path (str or os.PathLike), bytes, or a dict -> the parsed dict."""
    if isinstance(source, dict):
        data = source
    else:
        if isinstance(source, (bytes, bytearray)):
            try:
                text = bytes(source).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise GraphError(f"kernel-graph JSON bytes are not UTF-8 ({exc})") from None
        elif isinstance(source, str) and source.lstrip().startswith("{"):
            text = source
        elif isinstance(source, (str, os.PathLike)):
            text = _read_file(source)
        else:
            raise GraphError(
                f"from_json takes JSON text, a file path or a dict, got {type(source).__name__}; "
                "pass g.to_json() output or the path it was saved to"
            )
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise GraphError(
                f"kernel-graph JSON is not valid JSON ({exc}); pass text written by g.to_json() "
                "(a str starting with '{' is read as JSON text: pass pathlib.Path(name) for such a file name)"
            ) from None
    if not isinstance(data, dict):
        raise GraphError(
            f"kernel-graph JSON must be an object with keys 'format', 'nodes' and 'outputs', got {type(data).__name__}"
        )
    return data


def _read_file(source: str | os.PathLike[str]) -> str:
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL, or bytes that are not UTF-8
        what = "neither JSON text (which starts with '{') nor a readable file" if isinstance(source, str) else \
            "not a readable file"
        raise GraphError(f"from_json: {_short(os.fspath(source))} is {what}: {exc}") from None


def field_of(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``raw[key]``, which must exist and have type ``kind`` (bools are not ints)."""
    if key not in raw:
        raise GraphError(f"{where} has no {key!r} key; the document was not written by g.to_json() or was cut")
    value = raw[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise GraphError(f"{where}: {key!r} must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise GraphError(f"{where}: {key!r} must be {_kind_name(kind)}, got {type(value).__name__} {_short(value)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {list: "a list", dict: "an object", str: "a string", int: "an int", type(None): "null"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def check_document(data: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The format version and the two top-level lists, checked."""
    fmt = data.get("format")
    if type(fmt) is not int or fmt != FORMAT_VERSION:
        raise GraphError(f"unsupported kernel-graph JSON format {fmt!r}; expected {FORMAT_VERSION}")
    return field_of(data, "nodes", list, "the document"), field_of(data, "outputs", list, "the document")


def check_node(i: int, raw: Any) -> dict[str, Any]:
    """One node's keys and their types; the op itself re-validates operands and attrs when it is added."""
    where = f"node {i}"
    if not isinstance(raw, dict):
        raise GraphError(f"{where} must be an object, got {type(raw).__name__} {_short(raw)}")
    extra = sorted(set(raw) - _NODE_KEYS, key=str)
    if extra:
        raise GraphError(f"{where}: unknown keys {extra}; a node has {sorted(_NODE_KEYS)}")
    op = field_of(raw, "op", str, where)
    field_of(raw, "dims", list, where)
    dtype = field_of(raw, "dtype", str, where)
    if dtype not in DTYPES:
        raise GraphError(f"{where}: unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if op == "input":
        if raw.get("inputs") or raw.get("attrs"):
            raise GraphError(f"{where}: an input node takes no inputs or attrs")
        if raw.get("strides") is not None:
            field_of(raw, "strides", list, where)
        if "name" in raw:
            field_of(raw, "name", str, where)
        return raw
    if op not in OPS:
        raise GraphError(f"{where}: unknown op {op!r}; known ops: input, {', '.join(sorted(OPS))}")
    if "strides" in raw or "name" in raw:
        raise GraphError(f"{where}: only input nodes carry 'strides' or 'name'")
    inputs = field_of(raw, "inputs", list, where)
    if any(isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < i for j in inputs):
        raise GraphError(f"{where}: inputs {_short(inputs)} must refer to earlier nodes")
    arity = OPS[op].arity
    if not arity - OPTIONAL_OPERANDS.get(op, 0) <= len(inputs) <= arity:
        raise GraphError(f"{where}: op {op!r} takes {arity} operand(s), got {len(inputs)}")
    attrs = {**OPTIONAL_ATTRS.get(op, {}), **field_of(raw, "attrs", dict, where)}
    known = ATTRS.get(op, ())
    extra = sorted(set(attrs) - set(known))
    if extra:
        raise GraphError(f"{where}: unknown attrs {extra} for op {op!r}")
    missing = sorted(set(known) - set(attrs))
    if missing:
        raise GraphError(f"{where}: op {op!r} needs attrs {missing}")
    return {**raw, "attrs": attrs}
