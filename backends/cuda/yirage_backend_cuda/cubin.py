"""What a cubin says about itself: the SM it was built for and the kernels it holds.

A cubin is an ELF file (machine EM_CUDA); reading its header and symbol table
with ``struct`` lets tests and the loader check a build without a GPU and
without ``cuobjdump``: the arch is in ``e_flags`` (bits 8-15 from ELF ABI
version 8, CUDA 12.8+; bits 0-7 before) and each ``__global__`` entry is a
function symbol marked STO_CUDA_ENTRY.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from yirage.errors import YirageError

EM_CUDA = 190
SHT_SYMTAB = 2
STT_FUNC = 2
STO_CUDA_ENTRY = 0x10


class CubinError(YirageError, ValueError):
    """Bytes that are not a well-formed 64-bit little-endian CUDA ELF (a truncated or foreign file)."""


@dataclass(frozen=True)
class CubinInfo:
    """The SM arch (``"sm_80"``) a cubin runs on, its ELF ABI version and its kernel entry names."""

    arch: str
    abi_version: int
    kernels: tuple[str, ...]


def _fail(why: str) -> CubinError:
    return CubinError(f"not a valid cubin: {why}; rebuild it (delete the compile-cache entry, or recompile with "
                      "NVRTC for an sm_XX arch, not compute_XX, which gives PTX only)")


def inspect_cubin(data: bytes) -> CubinInfo:
    """Parse ``data`` as a cubin; raise CubinError naming what is wrong with it."""
    try:
        return _inspect(bytes(data))
    except struct.error as exc:  # a read past the end that the checks below did not foresee
        raise _fail(f"truncated ({exc})") from exc


def _inspect(data: bytes) -> CubinInfo:
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise _fail(f"no ELF header ({len(data)} bytes starting {bytes(data[:4])!r})")
    if data[4] != 2 or data[5] != 1:
        raise _fail(f"ELF class {data[4]} / data encoding {data[5]}, expected 64-bit little-endian (2/1)")
    abi_version = data[8]
    machine, = struct.unpack_from("<H", data, 18)
    if machine != EM_CUDA:
        raise _fail(f"ELF machine {machine}, expected EM_CUDA ({EM_CUDA})")
    shoff, = struct.unpack_from("<Q", data, 40)
    flags, = struct.unpack_from("<I", data, 48)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sm = (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF
    if sm < 10:
        raise _fail(f"e_flags {flags:#x} name no SM arch")
    if shentsize != 64 or shoff + shnum * 64 > len(data):
        raise _fail(f"section table ({shnum} x {shentsize} bytes at {shoff}) runs past the {len(data)}-byte file")
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * 64) for i in range(shnum)]
    kernels: list[str] = []
    for sec in sections:
        if sec[1] != SHT_SYMTAB:
            continue
        offset, size, link, entsize = sec[4], sec[5], sec[6], sec[9]
        if link >= shnum or entsize != 24 or offset + size > len(data):
            raise _fail("malformed symbol table")
        str_off, str_size = sections[link][4], sections[link][5]
        for pos in range(offset, offset + size, 24):
            name_at, info, other = struct.unpack_from("<IBB", data, pos)
            if info & 0xF == STT_FUNC and other & STO_CUDA_ENTRY:
                end = data.find(b"\0", str_off + name_at, str_off + str_size)
                if name_at >= str_size or end < 0:
                    raise _fail("a symbol name runs past its string table")
                kernels.append(data[str_off + name_at:end].decode("utf-8", "replace"))
    return CubinInfo(f"sm_{sm}", abi_version, tuple(sorted(kernels)))
