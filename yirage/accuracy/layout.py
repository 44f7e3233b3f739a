"""The dump directory: its layout, the selection of what goes in it, a writer and a reader.

Layout (docs/accuracy_compare.md)::

    DIR/meta.json                           what was run and an index of every file (below)
    DIR/token_{t}/{op}.{input|output}.{k}.npy   the k-th input / output of op ``op`` at token step ``t``

``meta.json`` holds ``format``/``version``, ``kind`` ("fused" or "unfused"), ``source`` ("model" or
"graph"), ``model``, ``backend``, ``dtype``, ``mode``, ``tokens``, ``ops``, the fused kernels' ``map``
(fused dumps: which original ops each kernel replaces, yirage.accuracy.mapping) and ``records``: one
per file, in execution order, with ``token``, ``op``, ``io``, ``index``, ``role``, ``file``, ``dtype``
(the tensor's own dtype; bfloat16 is stored widened to float32) and ``shape``. Files are plain ``.npy``
(read with ``allow_pickle=False``: a dump from elsewhere cannot run code).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yirage.errors import YirageError

if TYPE_CHECKING:
    import numpy as np

FORMAT = "yirage-accuracy-dump"
VERSION = 1
MODES = ("input", "output", "all")
KINDS = ("fused", "unfused")
RECORD_KEYS = ("token", "op", "io", "index", "file", "dtype", "shape")
IOS = ("input", "output")


class AccuracyError(YirageError, ValueError):
    """A bad dump, path or option of the accuracy tools; the message says what is wrong and what to do."""


def _step(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise TypeError(v)
    return int(v)


def parse_tokens(value: Any) -> tuple[int, ...] | None:
    """Token selection: None or "all" (every step), a list of step indices, or "0,2" / "[0,2]"."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    items: Iterable[Any]
    if isinstance(value, str):
        text = value.strip().removeprefix("[").removesuffix("]")
        items = [p.strip() for p in text.split(",") if p.strip()]
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    else:
        items = value
    try:
        steps = tuple(sorted({_step(v) for v in items}))
    except (TypeError, ValueError):
        raise AccuracyError(f"tokens={value!r} is not a token selection; pass \"all\", a list of step indices "
                            "like [0, 2], or the text \"0,2\"") from None
    if not steps or any(v < 0 for v in steps):
        raise AccuracyError(f"tokens={value!r}: token steps must be ints >= 0 (and at least one), e.g. [0, 2]")
    return steps


@dataclass(frozen=True)
class Selection:
    """What to dump: ``mode`` (input/output/all), ``tokens`` (None: all steps) and ``ops`` (a regex or None)."""

    mode: str = "all"
    tokens: tuple[int, ...] | None = None
    ops: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise AccuracyError(f"dump mode {self.mode!r} is not one of {', '.join(MODES)}; pick one "
                                "(all: inputs and outputs)")
        object.__setattr__(self, "tokens", parse_tokens(self.tokens))
        if self.ops is not None:
            try:
                re.compile(self.ops)
            except re.error as exc:
                raise AccuracyError(f"ops={self.ops!r} is not a valid regular expression ({exc}); escape dots "
                                    "as \\. and check the brackets, e.g. 'layers\\.0\\.|qkv0'") from None

    def wants_token(self, step: int) -> bool:
        return self.tokens is None or step in self.tokens

    def wants_io(self, io: str) -> bool:
        return self.mode in ("all", io)

    def wants_op(self, names: Iterable[str]) -> bool:
        """True when the regex finds any of ``names`` (an op and the fused kernel / ops it belongs with)."""
        return self.ops is None or any(re.search(self.ops, n) for n in names)


def _numpy(tensor: Any) -> tuple[np.ndarray, str]:
    """A host numpy copy and the tensor's own dtype name (bfloat16, which numpy lacks, is widened)."""
    import numpy as np
    import torch

    if isinstance(tensor, torch.Tensor):
        dtype = str(tensor.dtype).removeprefix("torch.")
        t = tensor.detach().to("cpu")
        if t.dtype == torch.bfloat16:
            t = t.to(torch.float32)
        return t.contiguous().numpy().copy(), dtype
    array = np.array(tensor)
    return array, str(array.dtype)


def writable_dir(root: Path, what: str) -> None:
    """Make ``root`` and check a file can be created in it, before any work: permissions alone miss /proc,
    read-only mounts and root's rights, and a failure after a long run would lose it."""
    probe = root / ".yirage-write-probe"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise AccuracyError(f"{what} {str(root)!r} cannot be written ({type(exc).__name__}: {exc.strerror or exc}); "
                            "pass a writable directory") from None


class DumpWriter:
    """Writes one dump directory; ``close()`` writes meta.json last, so a dump without it is incomplete."""

    def __init__(self, root: str | os.PathLike[str], meta: dict[str, Any]) -> None:
        self.root = Path(root)
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise AccuracyError(f"dump directory {str(self.root)!r} exists and is not empty; dump into a new "
                                "directory (two dumps in one would mix their files) or delete it first")
        writable_dir(self.root, "dump directory")
        self.meta = {"format": FORMAT, "version": VERSION, **meta, "records": []}
        self._seen: set[tuple[int, str, str, int]] = set()

    def write(self, token: int, op: str, io: str, index: int, tensor: Any, role: str = "") -> None:
        key = (token, op, io, index)
        if key in self._seen:
            raise AccuracyError(f"{op}.{io}.{index} of token {token} was dumped twice; op names must be unique")
        self._seen.add(key)
        import numpy as np

        array, dtype = _numpy(tensor)
        rel = f"token_{token}/{op}.{io}.{index}.npy"
        (self.root / f"token_{token}").mkdir(exist_ok=True)
        np.save(self.root / rel, array, allow_pickle=False)
        self.meta["records"].append({"token": token, "op": op, "io": io, "index": index, "role": role,
                                     "file": rel, "dtype": dtype, "shape": list(array.shape)})

    def close(self) -> Path:
        tmp = self.root / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1))
        tmp.replace(self.root / "meta.json")
        return self.root


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_record(i: int, r: Any, bad: str) -> None:
    """One meta.json record well formed: the reader indexes, sorts and joins on these fields, so a junk value
    (e.g. "token": [0]) is refused here, naming the record, instead of failing later with a bare TypeError."""
    if not isinstance(r, dict) or any(k not in r for k in RECORD_KEYS):
        raise AccuracyError(f"{bad}: record {i} lacks one of {RECORD_KEYS}; dump again")
    problems = [f"{key}={r[key]!r} is not an int >= 0" for key in ("token", "index") if not _is_index(r[key])]
    problems += [f"{key}={r[key]!r} is not a non-empty string" for key in ("op", "file", "dtype")
                 if not isinstance(r[key], str) or not r[key]]
    if r["io"] not in IOS:
        problems.append(f"io={r['io']!r} is not one of {IOS}")
    if not isinstance(r["shape"], list) or not all(_is_index(d) for d in r["shape"]):
        problems.append(f"shape={r['shape']!r} is not a list of ints >= 0")
    if problems:
        raise AccuracyError(f"{bad}: record {i}: {'; '.join(problems)}; dump again")
    f = Path(r["file"])
    if f.is_absolute() or ".." in f.parts:
        raise AccuracyError(f"{bad}: record {i} names the file {r['file']!r} outside the dump directory")


class DumpReader:
    """A dump directory checked up front: meta.json readable, of this format, every record well formed."""

    def __init__(self, root: str | os.PathLike[str], what: str = "dump") -> None:
        self.root = Path(root)
        self.what = what
        if not self.root.exists():
            raise AccuracyError(f"{what} path {str(self.root)!r} does not exist; pass the directory a dump wrote "
                                "(python -m yirage dump ... --output DIR), the one holding meta.json")
        if not self.root.is_dir():
            raise AccuracyError(f"{what} path {str(self.root)!r} is a file; pass the dump directory that holds "
                                "meta.json")
        meta_path = self.root / "meta.json"
        if not meta_path.is_file():
            raise AccuracyError(f"{what} {str(self.root)!r} has no meta.json: it is not a dump directory, or the "
                                "dump did not finish (meta.json is written last); dump again")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AccuracyError(f"{meta_path} is corrupted (not valid JSON: {exc}); dump again") from None
        self.meta = self._check(meta, meta_path)
        self.records = meta["records"]
        self.index = {(r["token"], r["op"], r["io"], r["index"]): r for r in self.records}

    def _check(self, meta: Any, path: Path) -> dict[str, Any]:
        bad = f"{path} is corrupted or not a yirage accuracy dump"
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise AccuracyError(f"{bad}: its format is {meta.get('format') if isinstance(meta, dict) else meta!r}, "
                                f"expected {FORMAT!r}; pass a directory written by yirage's dump")
        if meta.get("version") != VERSION:
            raise AccuracyError(f"{path}: dump format version {meta.get('version')!r}, this yirage reads version "
                                f"{VERSION}; dump again with this version")
        if meta.get("kind") not in KINDS or not isinstance(meta.get("records"), list):
            raise AccuracyError(f"{bad}: 'kind' must be one of {KINDS} and 'records' a list; dump again")
        if meta["kind"] == "fused" and not isinstance(meta.get("map"), list):
            raise AccuracyError(f"{bad}: a fused dump needs its 'map' (fused kernel -> original ops); dump again")
        for i, r in enumerate(meta["records"]):
            _check_record(i, r, bad)
        return meta

    def load(self, record: dict[str, Any]) -> np.ndarray:
        """One record's array, with a clear error if its file is missing, corrupt or not the recorded shape."""
        import numpy as np

        path = self.root / record["file"]
        try:
            array = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise AccuracyError(f"{self.what} {str(self.root)!r}: {record['file']} is listed in meta.json but "
                                "missing; the dump is incomplete, dump again") from None
        except (ValueError, OSError, EOFError) as exc:
            raise AccuracyError(f"{self.what} {str(self.root)!r}: {record['file']} is not a readable .npy file "
                                f"({exc}); dump again") from None
        if list(array.shape) != list(record["shape"]):
            raise AccuracyError(f"{self.what} {str(self.root)!r}: {record['file']} has shape {array.shape}, but "
                                f"meta.json says {record['shape']}; the dump is corrupted, dump again")
        return array

    def get(self, token: int, op: str, io: str, index: int) -> dict[str, Any] | None:
        return self.index.get((token, op, io, index))

    @property
    def tokens(self) -> list[int]:
        return sorted({r["token"] for r in self.records})
