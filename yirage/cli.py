"""Command line: ``python -m yirage`` and ``tools/yirage_backend_manager.py``.

Subcommands: ``info`` (backends, plugins, host, default, and the active
PersistentKernel configuration with the source of each value), ``set`` (save
the default backend for later processes), ``test`` (run the conformance
kit on one backend in a child pytest and summarise it), ``benchmark``
(time the same kernel graphs on every backend against torch eager:
yirage.bench.benchmark_backends, with a progress bar on stderr) and
``optimize`` (derive a backend's PersistentKernel configuration from its
device and refine it by a timed sweep: yirage.autoconfig_sweep; ``--apply``
saves it for later processes, see yirage.autoconfig). ``dump`` and ``compare``
(fused vs unfused accuracy) live in yirage.accuracy.cli.

``test`` on a backend that cannot run here fails with the probe's reason,
unless the backend offers a compile-only check: a ``compile_check()`` method
returning a report with ``ok: bool`` and ``summary() -> str`` (the CUDA
backend's ``check_conformance`` report has that shape). Compiling every kernel
without a device is then the most that can be checked, and is labelled so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yirage import autoconfig, config, system
from yirage.accuracy.cli import add_parser as add_accuracy_parsers
from yirage.autoconfig_sweep import DEFAULT_DURATION, DEFAULT_MODEL, TINY, auto_configure_backend
from yirage.backend import selection
from yirage.bench import WORKLOADS, benchmark_backends
from yirage.errors import YirageError

logger = logging.getLogger("yirage.cli")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def kernel_path_info(backend: Any) -> dict[str, Any] | None:
    """The compiler path a backend uses (or would use) and why, for backends that can tell.

    Optional backend method ``kernel_path()``: an object with ``path`` (e.g. "triton", "torch"),
    ``reason`` (a sentence) and ``summary()`` (e.g. "would use: torch lowering (triton-ascend not
    installed)"). The domestic backends have it; None for backends without it.
    """
    method = getattr(backend, "kernel_path", None)
    if not callable(method):
        return None
    try:
        path = method()
        return {"path": str(path.path), "reason": str(path.reason), "summary": str(path.summary())}
    except Exception as exc:  # noqa: BLE001 - a plugin's failing answer is shown, the rest is still described
        logger.warning("kernel_path() of backend %r failed", backend.name, exc_info=True)
        return {"path": None, "reason": "", "summary": f"kernel_path() raised {type(exc).__name__}: {exc}"}


def collect_info() -> dict[str, Any]:
    """Everything ``info`` shows, as plain data (the ``--json`` output)."""
    reg = selection.registry()
    backends = []
    for backend in reg.backends():
        described = selection.describe(backend)
        path = kernel_path_info(backend)
        if path is not None:
            described["kernel_path"] = path
        backends.append(described)
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
    try:
        active: dict[str, Any] = autoconfig.resolve_pk_config(selection.current_backend(need="persistent")).as_dict()
    except YirageError as exc:  # shown in place of the configuration; the rest is still described
        active = {"error": str(exc)}
    active["applied_file"] = str(autoconfig.applied_path())
    return {
        "host": system.host_facts(),
        "backends": backends,
        "plugins": plugins,
        "conflicts": list(reg.conflicts),
        "probe_timeout": reg.plugins.time_limit,
        "default": default,
        "settings_file": str(config.config_path()),
        "pk_config": active,
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


_ALL_DTYPES = {"float32", "float16", "bfloat16", "float64", "int32", "int64"}
_FLOAT_WEIGHTS = {"float32", "float16", "bfloat16"}


def capability_cells(caps: dict[str, Any] | None) -> list[str]:
    """The ``graphs`` and ``PK`` cells of a backend row: the dtypes it compiles; its PersistentKernel runtime's
    kind (persistent, launched, serial; ``yes`` where undeclared) and the quantized weights it reads."""
    if caps is None:
        return ["?", "?"]
    dtypes = set(caps["kernel_dtypes"])
    lacking = sorted(_ALL_DTYPES - dtypes)
    if not dtypes:
        graphs = "no"
    elif dtypes <= _ALL_DTYPES and len(lacking) <= 2:
        graphs = "all" + (f" but {','.join(lacking)}" if lacking else "")
    else:
        graphs = ",".join(sorted(dtypes))
    extra = sorted(set(caps["weight_formats"]) - _FLOAT_WEIGHTS)
    kind = caps.get("persistent_kind") or "yes"
    pk = (kind + (f"+{','.join(extra)}" if extra else "")) if caps["persistent"] else "no"
    return [graphs, pk]


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
    rows = [["backend", "status", "prio", "graphs", "PK", "device", "units", "memory (free/total)", "plugin"]]
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
            b["name"], status, str(b["priority"]), *capability_cells(b.get("capabilities")), dev.get("name", "-"),
            str(dev.get("compute_units") or "-"),
            memory, f"{plugin['distribution']} {plugin['version']}".strip(),
        ])
    print(f"Backends ({len(info['backends'])} discovered; * = available, but auto passes over it; graphs = "
          "kernel-graph dtypes it compiles; PK = PersistentKernel runtime: persistent (honours num_workers/"
          "num_local_schedulers), resident (honours num_workers), launched or serial (ignore them), +quantized "
          "weights it reads)")
    print(_table(rows))
    print()
    print("Reasons")
    for b in info["backends"]:
        extra = f" ({b['error']})" if b.get("error") else ""
        print(f"  {b['name']:<10} {b['reason']}{extra}")
    paths = [(b["name"], b["kernel_path"]) for b in info["backends"] if b.get("kernel_path")]
    if paths:
        print()
        print("Compiler paths (kernel plans and PersistentKernels)")
        for name, path in paths:
            print(f"  {name:<10} {path['summary']}")
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
    print_pk_config(info["pk_config"])


def print_pk_config(active: dict[str, Any]) -> None:
    """The PersistentKernel configuration of the default backend, each value with its source."""
    print()
    if "error" in active:
        print(f"PersistentKernel configuration: unknown: {active['error']}")
        return
    print(f"PersistentKernel configuration (backend {active['backend']}, when num_workers/num_local_schedulers "
          "are not passed)")
    for name, setting in active["settings"].items():
        print(f"  {name:<21} {setting['value']!s:<6} {setting['source']:<9} {setting['detail']}")
    print(f"  applied configurations: {active['applied_file']} (`optimize --backend B --apply` writes it)")


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


#: the kit's ``--quick`` subset: everything but the extreme-value cases and the seeded random graphs
QUICK_SELECTION = "not extreme and not random"
KIT = "yirage.testing.conformance"


@dataclass
class KitResult:
    """Outcome counts of one conformance-kit run, from its JUnit XML report."""

    passed: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test id, first line of the message)
    errors: list[tuple[str, str]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # skip reason -> count

    @property
    def ok(self) -> bool:
        return not self.failed and not self.errors and self.passed > 0


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else "(no message)"


def parse_junit(path: Path) -> KitResult:
    """Count passed/failed/error/skipped test cases in the JUnit XML file pytest wrote."""
    result = KitResult()
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}" if case.get("classname") else str(case.get("name"))
        failure, error, skip = case.find("failure"), case.find("error"), case.find("skipped")
        if failure is not None:
            result.failed.append((test_id, _first_line(failure.get("message"))))
        elif error is not None:
            result.errors.append((test_id, _first_line(error.get("message"))))
        elif skip is not None:
            result.skipped[_first_line(skip.get("message"))] += 1
        else:
            result.passed += 1
    return result


def print_kit_summary(name: str, quick: bool, result: KitResult) -> None:
    subset = f' (quick: -k "{QUICK_SELECTION}")' if quick else ""
    skipped = sum(result.skipped.values())
    print()
    print(f"conformance kit on {name!r}{subset}: {result.passed} passed, {len(result.failed)} failed, "
          f"{len(result.errors)} errors, {skipped} skipped")
    for reason, count in result.skipped.most_common():
        print(f"  skipped {count}x: {reason}")
    for test_id, message in result.failed:
        print(f"  FAILED {test_id}: {message}")
    for test_id, message in result.errors:
        print(f"  ERROR  {test_id}: {message}")
    if result.ok:
        print(f"PASS: {name!r} passes the conformance kit{' subset' if quick else ''}")
    elif not result.failed and not result.errors:
        print(f"FAIL: no case passed on {name!r} (every case was skipped): it does not conform")
    else:
        print(f"FAIL: {len(result.failed) + len(result.errors)} case(s) failed on {name!r}; rerun one with "
              f"`python -m pytest --pyargs {KIT} --yirage-backend {name} -k '<test name>'`")


def run_kit(name: str, quick: bool) -> int:
    """Run the kit on ``name`` in a child pytest, echo its output, print the summary; 0 only if nothing failed."""
    for module in ("pytest", "hypothesis", "torch"):
        if importlib.util.find_spec(module) is None:
            raise YirageError(f"the conformance kit needs {module}, which is not installed; "
                              f"install it (`pip install {module}`) and run the test again")
    with tempfile.TemporaryDirectory(prefix="yirage-kit-") as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "--pyargs", KIT, "--yirage-backend", name, "-q",
               "-p", "no:cacheprovider", f"--junitxml={report}"]
        if quick:
            cmd += ["-k", QUICK_SELECTION]
        sys.stdout.flush()
        # cwd: a fresh directory, so no project's pytest configuration (addopts, conftest) changes the kit
        with subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
            assert child.stdout is not None
            for line in child.stdout:
                sys.stdout.write(line)
            code = child.wait()
        if not report.exists():
            raise YirageError(f"the conformance kit did not run on {name!r} (pytest exit {code}); "
                              f"its output above says why: fix that and run the test again")
        result = parse_junit(report)
    print_kit_summary(name, quick, result)
    if code != 0 and result.ok:  # e.g. an error in a session fixture that is not a test case
        print(f"FAIL: pytest exited with status {code}; see its output above")
        return 1
    return 0 if result.ok else 1


def run_compile_only(name: str, reason: str, check: Any) -> int:
    """Run a backend's compile-only check (for a backend with no device here) and print its summary."""
    print(f"{name!r} cannot run here: {reason}")
    print("running its COMPILE-ONLY check instead: every kernel is compiled, none is run on a device")
    sys.stdout.flush()
    report = check()
    if not hasattr(report, "ok") or not callable(getattr(report, "summary", None)):
        raise YirageError(f"backend {name!r}: compile_check() returned {type(report).__name__}, not a report "
                          f"with `ok` and `summary()`; fix the backend's compile_check")
    print(f"[compile-only] {report.summary()}")
    verdict = "PASS" if report.ok else "FAIL"
    print(f"{verdict} (compile-only: nothing was executed, numerical conformance was NOT checked)")
    return 0 if report.ok else 1


def cmd_test(args: argparse.Namespace) -> int:
    name = args.backend.strip().lower()
    backend = selection.registry().get(name)  # unknown names raise the registry's error
    availability = backend.availability()
    if availability.ok:
        return run_kit(name, args.quick)
    check = getattr(backend, "compile_check", None)
    if callable(check):
        return run_compile_only(name, availability.reason, check)
    raise YirageError(f"backend {name!r} cannot be tested on this machine: {availability.reason}. "
                      f"Run the test where its device is present (`python -m yirage info` lists what runs here)")


def _duration(text: str) -> float:
    """argparse type of --duration: a positive finite number of seconds (argparse exits 2 with the message)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; pass e.g. --duration 10") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number of seconds; pass e.g. --duration 10")
    return value


def _progress_reporter(desc: str = "benchmark", unit: str = "cell") -> tuple[Any, Any]:
    """(progress callback ``(done, total, label)``, close function): a tqdm bar on stderr when tqdm is installed,
    else one plain line per step on stderr (tqdm is optional: yirage does not depend on it)."""
    if importlib.util.find_spec("tqdm") is not None:
        from tqdm import tqdm

        bars: list[Any] = []  # made on the first call, when the total is known

        def update(done: int, total: int, label: str) -> None:
            if not bars:
                bars.append(tqdm(total=total, file=sys.stderr, unit=unit, desc=desc, leave=False))
            bars[0].total = total
            bars[0].n = done
            bars[0].set_postfix_str(label, refresh=False)
            bars[0].refresh()

        return update, lambda: bars and bars[0].close()

    def line(done: int, total: int, label: str) -> None:
        print(f"{desc} [{done}/{total}] {label}", file=sys.stderr, flush=True)

    return line, lambda: None


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_benchmark(result: dict[str, Any]) -> None:
    """The benchmark as a table: one row per (backend, workload); then the unavailable and skipped backends."""
    rows = [["backend", "workload", "median us", "p10-p90 us", "eager us", "eager/yirage", "samples", "compile s"]]
    errors = []
    for name, b in result["backends"].items():
        for wl, c in b["workloads"].items():
            if c["error"]:
                compiled = "-" if c["compile_s"] is None else f"{c['compile_s']:.2f}"
                rows.append([name, wl, "error", "-", "-", "-", "0", compiled])
                errors.append(f"  {name} {wl}: {c['error']}")
                continue
            rows.append([name, wl, _us(c["median_us"]), f"{_us(c['p10_us'])}-{_us(c['p90_us'])}",
                         _us(c["eager_median_us"]), f"{c['vs_eager']:.2f}x", str(c["samples"]),
                         f"{c['compile_s']:.2f}"])
    torch = result["torch"]
    print(f"yirage kernel graphs vs torch eager (torch {torch['version']}, {torch['threads']} threads); "
          f"{result['timing_seconds']:.1f} s timing, {result['compile_seconds']:.1f} s compiling (excluded)")
    load = result["other_load_cores"]
    if load is not None and load > 0.25:
        print(f"WARNING: other processes used {load:.2f} of {result['cpu_count']} cores meanwhile: these figures "
              "are noisy; rerun on a quiet machine")
    if len(rows) > 1:
        print(_table(rows))
    else:
        print("no backend could be timed (see below)")
    print("eager/yirage = torch eager median / yirage median on the same inputs: > 1 means yirage is faster")
    geo = [f"{n} {b['summary']['vs_eager_geomean']:.2f}x" for n, b in result["backends"].items()
           if b["summary"]["vs_eager_geomean"] is not None]
    if geo:
        print(f"geometric mean of eager/yirage: {', '.join(geo)}")
    if errors:
        print("Errors (not timed)")
        print("\n".join(errors))
    off = [(n, b["reason"]) for n, b in result["backends"].items() if not b["available"]]
    if off:
        print("Unavailable")
        for name, reason in off:
            print(f"  {name:<10} {reason}")
    for name, reason in result["skipped"].items():
        print(f"Skipped {name}: {reason}")


def cmd_benchmark(args: argparse.Namespace) -> int:
    output = Path(args.output) if args.output else None
    if output is not None and not output.parent.is_dir():  # before the run, not after it
        raise YirageError(f"--output {output}: the directory {output.parent} does not exist; create it or pass "
                          "another path")
    progress, close = _progress_reporter()
    try:  # unknown backends raise UnknownBackendError, a YirageError: main prints it and exits 2
        result = benchmark_backends(args.duration, backends=args.backends, workloads=args.workloads,
                                    progress=progress)
    finally:
        close()
    text = json.dumps(result, indent=2)
    if output is not None:
        try:
            output.write_text(text + "\n")
        except OSError as exc:
            raise YirageError(f"cannot write --output {output}: {exc}; pass a writable path") from exc
    if args.json:
        print(text)
    else:
        print_benchmark(result)
        if output is not None:
            print(f"results written to {output}")
    return 0


TOY_MODELS = {"small": DEFAULT_MODEL, "tiny": TINY}


def cmd_optimize(args: argparse.Namespace) -> int:
    progress, close = _progress_reporter("optimize", "step")
    try:  # unknown/unavailable backends raise YirageErrors: main prints them and exits 2
        cfg = auto_configure_backend(args.backend.strip().lower(), sweep=not args.no_sweep, duration=args.duration,
                                     max_candidates=args.candidates, model=TOY_MODELS[args.model],
                                     progress=progress)
    finally:
        close()
    applied = autoconfig.apply(cfg) if args.apply else None
    if args.json:
        print(json.dumps({**cfg.as_dict(), "applied": None if applied is None else str(applied)}, indent=2))
        return 0
    print(cfg.report())
    if applied is not None:
        print(f"applied: saved in {applied}; PersistentKernels on backend {cfg.backend!r} on this device now use "
              "it when num_workers/num_local_schedulers are not passed (explicit arguments still win)")
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
    test = sub.add_parser("test", help="run the conformance kit on one backend and summarise the outcome")
    test.add_argument("backend", help="a backend name (see `info`)")
    test.add_argument("--quick", action="store_true",
                      help=f'only a fast subset of the kit (-k "{QUICK_SELECTION}"); no effect on a compile-only check')
    test.set_defaults(func=cmd_test)
    bench = sub.add_parser("benchmark", help="time the same kernel graphs on every available backend vs torch eager")
    bench.add_argument("--duration", type=_duration, default=10.0,
                       help="seconds of timing, split over backends x workloads; compiling is extra (default 10)")
    bench.add_argument("--output", metavar="PATH", help="also write the results as JSON to PATH")
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bench.add_argument("--backends", nargs="+", metavar="NAME",
                       help="backends to run (default: every discovered one; reference only when named)")
    bench.add_argument("--workloads", nargs="+", metavar="NAME", choices=list(WORKLOADS),
                       help=f"workloads to run (default: all of {', '.join(WORKLOADS)})")
    bench.set_defaults(func=cmd_benchmark)
    opt = sub.add_parser("optimize", help="derive a backend's PersistentKernel configuration and refine it by a "
                                          "timed sweep; --apply saves it for later processes")
    opt.add_argument("--backend", default="auto", help="a backend name or 'auto' (default: auto)")
    opt.add_argument("--apply", action="store_true",
                     help="save the result: later PersistentKernels/InferEngines on this backend and device use it")
    opt.add_argument("--json", action="store_true", help="print the configuration as one JSON object")
    opt.add_argument("--duration", type=_duration, default=DEFAULT_DURATION,
                     help=f"seconds of timing, split over the candidates; compiling is extra "
                          f"(default {DEFAULT_DURATION:g})")
    opt.add_argument("--candidates", type=int, choices=range(1, 7), default=4, metavar="{1..6}",
                     help="how many (workers, schedulers) pairs around the derived one to time (default 4)")
    opt.add_argument("--model", choices=sorted(TOY_MODELS), default="small",
                     help="the random-weight toy Llama the sweep decodes (tiny: fast, for tests; default small)")
    opt.add_argument("--no-sweep", action="store_true", help="only derive from the device; time nothing")
    opt.set_defaults(func=cmd_optimize)
    add_accuracy_parsers(sub)  # compare, dump: yirage.accuracy
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
