"""Command line: ``python -m yirage`` and ``tools/backend_manager.py``.

Subcommands: ``info`` (backends, plugins, host, default) and ``set`` (save
the default backend for later processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from yirage import config, system
from yirage.backend import selection
from yirage.errors import YirageError


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def collect_info() -> dict[str, Any]:
    """Everything ``info`` shows, as plain data (the ``--json`` output)."""
    reg = selection.registry()
    backends = [selection.describe(b) for b in reg.backends()]
    try:
        default: dict[str, Any] = {"backend": selection.get_backend().value}
    except YirageError as exc:
        default = {"backend": None, "error": str(exc)}
    try:
        saved = config.load().get("backend")
    except YirageError as exc:
        saved, default["settings_error"] = None, str(exc)
    default["requested"] = selection._requested or saved or "auto"
    default["auto_report"] = [d.__dict__ for d in selection.last_auto_report()]
    plugins = [r.__dict__ for r in reg.plugins.records]
    return {
        "host": system.host_facts(),
        "backends": backends,
        "plugins": plugins,
        "conflicts": list(reg.conflicts),
        "probe_timeout": reg.plugins.time_limit,
        "default": default,
        "settings_file": str(config.config_path()),
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_info(info: dict[str, Any]) -> None:
    host = info["host"]
    caches = ", ".join(f"{k} {_size(v)}" for k, v in host["caches"].items()) or "unknown"
    print("Host")
    print(f"  CPU      {host['cpu_model']} ({host['machine']}, SIMD {host['simd_bits'] or '?'} bit)")
    print(
        f"  cores    {host['physical_cores']} physical, {host['logical_cores']} logical, "
        f"{host['usable_cores']} usable by this process"
    )
    print(f"  caches   {caches}")
    print(f"  RAM      {_gib(host['ram_total'])} total, {_gib(host['ram_available'])} available")
    print(f"  OS       {host['os']}, Python {host['python']}")
    print()
    rows = [["backend", "status", "prio", "device", "units", "memory (free/total)", "plugin"]]
    for b in info["backends"]:
        status = "available" if b["available"] else "unavailable"
        if b["available"] and not b["auto"]:
            status = "available*"
        dev, mem = b["device"] or {}, b["memory"] or {}
        if b.get("error"):
            status = "error"
        memory = f"{_gib(mem.get('free'))} / {_gib(mem.get('total'))}" if mem else "-"
        plugin = b["plugin"]
        rows.append([
            b["name"], status, str(b["priority"]), dev.get("name", "-"), str(dev.get("compute_units") or "-"),
            memory, f"{plugin['distribution']} {plugin['version']}".strip(),
        ])
    print(f"Backends ({len(info['backends'])} discovered; * = available, but auto passes over it)")
    print(_table(rows))
    print()
    print("Reasons")
    for b in info["backends"]:
        extra = f" ({b['error']})" if b.get("error") else ""
        print(f"  {b['name']:<10} {b['reason']}{extra}")
    problems = [p for p in info["plugins"] if p["status"] != "loaded" or p["error"]]
    if problems or info["conflicts"]:
        print()
        print("Plugin problems")
        for p in problems:
            print(f"  {p['name']} ({p['distribution']} {p['version']}): {p['status']}: {p['error']}")
        for message in info["conflicts"]:
            print(f"  {message}")
    print()
    print(f"Time limit per plugin import and probe: {info['probe_timeout']:g} s (YIRAGE_PROBE_TIMEOUT)")
    default = info["default"]
    if default["backend"]:
        print(f"Default backend: {default['backend']} (requested: {default['requested']})")
    else:
        print(f"Default backend: none: {default['error']}")


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=str)
        print()
    else:
        print_info(info)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    name = args.backend.strip().lower()
    if not args.force:
        backend = selection.resolve(name)  # raises with the reason when unusable
        chosen = f" (auto picks {backend.name!r} here)" if name == "auto" else ""
    else:
        chosen = ""
    path = config.save(backend=name)
    print(f"default backend saved as {name!r}{chosen} in {path}; YIRAGE_BACKEND still overrides it")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yirage", description="yirage backend manager")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="list backends, plugins, host facts and the default backend")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=cmd_info)
    set_ = sub.add_parser("set", help="save the default backend for later processes")
    set_.add_argument("backend", help="a backend name or 'auto'")
    set_.add_argument("--force", action="store_true", help="save even if the backend is unavailable here")
    set_.set_defaults(func=cmd_set)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except YirageError as exc:
        print(f"yirage: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
