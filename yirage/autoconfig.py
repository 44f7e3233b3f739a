"""A backend's PersistentKernel configuration: derived, saved, applied, and where each value came from.

Why: ``num_workers``/``num_local_schedulers`` decide decode speed, and the best values depend on
the device. They are DERIVED from ``device_info()`` (the backend's own ``default_config``; for a
GPU whose backend proposes none, Mirage MPK's split of SMs into workers and schedulers), then
REFINED by a short timed sweep (``yirage.autoconfig_sweep``: ``yr.auto_configure_backend``).

Every value is a :class:`Setting` that carries its source:

- ``derived``: computed from ``device_info()`` / ``memory_info()``
- ``measured``: chosen by the timed sweep
- ``saved``: read from a saved configuration (an applied one, or ``BackendOptimizer.load_config``)
- ``explicit``: passed by the caller (``PersistentKernel(num_workers=...)``)
- ``default``: the backend proposes nothing and nothing was saved (one worker, one scheduler)

Applied configurations (``yirage_backend_manager.py optimize --backend B --apply``) live in
``autoconfig.json`` next to the settings file of :mod:`yirage.config` (``$YIRAGE_CONFIG_DIR``,
``$XDG_CONFIG_HOME/yirage`` or ``~/.config/yirage``), one entry per backend name::

    {"schema": 1, "configs": {"cpu": {<a saved configuration, as save_config writes it>}}}

A PersistentKernel (and so InferEngine and LlamaModel.build_decoder) uses the entry of its backend
when the caller passes no ``num_workers``/``num_local_schedulers``; explicit arguments always win.
Backends read what else applies to them with :func:`saved_for` (the cpu backend runs its kernel graphs
on the entry's ``threads``).
An entry saved for another device (its fingerprint: vendor, name, kind, compute units) is ignored
with a WARNING; a corrupted file raises :class:`SavedConfigError` naming the path and the fix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

from yirage import config as settings
from yirage.backend.base import Backend, DeviceInfo, checked_device_info, checked_memory_info
from yirage.backend.runtime_contract import CONFIG_FIELDS, RuntimeKind
from yirage.errors import NotSupportedError, PluginError

logger = logging.getLogger("yirage.autoconfig")

SCHEMA = 1
SOURCES = ("derived", "measured", "saved", "explicit", "default")
#: what the PersistentKernel runtimes read (those whose kind honours them); the other settings describe the device
PK_KEYS = CONFIG_FIELDS
_FIX = "delete it, or write a new one with `python tools/yirage_backend_manager.py optimize --backend {b} --apply`"


class SavedConfigError(settings.ConfigError):
    """A saved backend configuration that cannot be used (malformed, wrong types, bad values)."""


class ConfigMismatchError(SavedConfigError):
    """A saved configuration made for another backend or device."""


@dataclass(frozen=True)
class Setting:
    """One configuration value and where it came from (one of SOURCES), with a sentence saying how."""

    value: Any
    source: str
    detail: str = ""
    tunable: bool = True  # False: the backend exposes no knob for it; shown for information

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source, "detail": self.detail, "tunable": self.tunable}


@dataclass
class BackendConfig:
    """A configuration for one backend on one device; ``settings`` maps names to :class:`Setting`."""

    backend: str
    device: dict[str, Any]
    fingerprint: str
    settings: dict[str, Setting]
    sweep: list[dict[str, Any]] = field(default_factory=list)  # the measured candidates, fastest first

    @property
    def num_workers(self) -> int:
        return int(self.settings["num_workers"].value)

    @property
    def num_local_schedulers(self) -> int:
        return int(self.settings["num_local_schedulers"].value)

    def values(self) -> dict[str, Any]:
        """Plain values by name (what a runtime reads)."""
        return {name: s.value for name, s in self.settings.items()}

    def sources(self) -> dict[str, str]:
        return {name: s.source for name, s in self.settings.items()}

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (what save_config writes)."""
        return {"schema": SCHEMA, "backend": self.backend, "device": dict(self.device),
                "fingerprint": self.fingerprint, "settings": {n: s.as_dict() for n, s in self.settings.items()},
                "sweep": [dict(row) for row in self.sweep]}

    def report(self) -> str:
        """Readable text: every setting with its value, source and how it was found; then the sweep as a table
        (candidate, median/min/max ms per step, samples)."""
        lines = [f"Configuration for backend {self.backend!r} on {self.device.get('name')} "
                 f"({self.device.get('compute_units')} compute units)"]
        for name, s in self.settings.items():
            note = "" if s.tunable else " [not tunable]"
            lines.append(f"  {name:<21} {_show(name, s.value):<9} {s.source:<9} {s.detail}{note}")
        if not self.sweep:
            return "\n".join([*lines, "Not measured: only the derived values (no sweep ran)"])
        rows = [["candidate", "median ms/step", "min", "max", "samples", ""]]
        for r in self.sweep:
            label = f"{r['num_workers']} workers + {r['num_local_schedulers']} schedulers"
            if r.get("error") or r.get("median_ms") is None:
                rows.append([label, "error", "-", "-", "0", str(r.get("error"))])
                continue
            chosen = (r["num_workers"], r["num_local_schedulers"]) == (self.num_workers, self.num_local_schedulers)
            rows.append([label, f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}", f"{r['max_ms']:.3f}",
                         str(r["samples"]), "chosen" if chosen else ""])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        table.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([*lines, "", "Measured alternatives (toy decode; median over the samples, compiling "
                                      "excluded)", *table])

    def __str__(self) -> str:
        parts = ", ".join(f"{n}={_show(n, s.value)} ({s.source})" for n, s in self.settings.items())
        return f"{self.backend} on {self.device.get('name', '?')}: {parts}"


def _show(name: str, value: Any) -> str:
    if name == "memory_budget" and isinstance(value, int):
        return f"{value / 2**30:.1f} GiB"
    return str(value)


def fingerprint(backend: Backend | str, device: DeviceInfo | Mapping[str, Any]) -> str:
    """Which backend and device a configuration is for: backend name, vendor, device name, kind, compute units."""
    name = backend if isinstance(backend, str) else backend.name
    d = device.as_dict() if isinstance(device, DeviceInfo) else dict(device)
    return "|".join(str(x) for x in (name, d.get("vendor"), d.get("name"), d.get("kind"), d.get("compute_units")))


def device_summary(device: DeviceInfo) -> dict[str, Any]:
    return {"name": device.name, "vendor": device.vendor, "kind": device.kind, "compute_units": device.compute_units}


# -- derivation ------------------------------------------------------------------------------------------------
def mpk_split(units: int) -> tuple[int, int]:
    """Workers and schedulers for a GPU with ``units`` SMs / compute units, as Mirage MPK splits them.

    MPK (mirage-project/mirage, python/mirage/utils.py: get_configurations_from_gpu and get_scheduler, see
    mirage issue #354) runs one worker per SM on most SMs and packs its schedulers four to an SM (one per
    warp) on the rest: ``schedulers = 4 * (SMs - workers)``, with workers 144 from 160 SMs, 128 from 132, 96
    from 108, 64 from 68, 30 from 40, else 20. Small devices keep at least one SM for schedulers.
    """
    workers = 20
    for sms, count in ((160, 144), (132, 128), (108, 96), (68, 64), (40, 30)):
        if units >= sms:
            workers = count
            break
    workers = max(1, min(workers, units - 1))
    return workers, 4 * max(1, units - workers)


def _pk_counts(backend: Backend, device: DeviceInfo) -> tuple[dict[str, Any], str]:
    """The backend's proposal (extra keys kept) and how it was derived; NotSupportedError when there is none."""
    try:
        proposal = dict(backend.default_config(device))
        return proposal, f"{backend.name}.default_config from {device.compute_units} compute unit(s) of {device.name}"
    except NotSupportedError:
        if device.kind != "gpu" or not device.compute_units:
            raise
    workers, schedulers = mpk_split(device.compute_units)
    return ({"num_workers": workers, "num_local_schedulers": schedulers},
            f"Mirage MPK's split of {device.compute_units} SMs/compute units: workers, 4 schedulers per spare SM")


def derive(backend: Backend) -> BackendConfig:
    """The configuration ``device_info()`` implies, every value marked "derived" (memory: as measured).

    Raises NotSupportedError (naming the fix) for a backend that proposes no PersistentKernel configuration
    and whose device is not a GPU with a known compute-unit count.
    """
    backend.require_available()
    device = checked_device_info(backend, 0)
    try:
        proposal, how = _pk_counts(backend, device)
    except NotSupportedError as exc:
        implied = "; ".join(f"{n}={s.value} ({s.detail})" for n, s in _tuning(device).items())
        raise NotSupportedError(
            f"backend {backend.name!r} cannot be auto-configured: it proposes no PersistentKernel configuration "
            f"(no default_config) and its device ({device.kind}, compute units {device.compute_units}) is not a "
            "GPU whose SM count gives one; pass num_workers/num_local_schedulers explicitly, or add "
            "default_config(device) to the backend"
            + (f". What device_info implies otherwise: {implied}" if implied else "")) from exc
    check_counts(proposal, f"{backend.name}.default_config()", PluginError, "a bug in the plugin: report it to its "
                 "authors")
    workers, schedulers = int(proposal["num_workers"]), int(proposal["num_local_schedulers"])
    values: dict[str, Setting] = {
        "num_workers": Setting(workers, "derived", how),
        "num_local_schedulers": Setting(schedulers, "derived", how),
    }
    if device.kind == "cpu":
        values["threads"] = Setting(workers + schedulers, "derived", "one host thread per worker and scheduler")
    else:
        values["threads"] = Setting(None, "derived", "not applicable: the device schedules its own threads",
                                    tunable=False)
    for key, value in proposal.items():  # the backend's other choices (cpu: tasks_per_layer)
        values.setdefault(key, Setting(value, "derived", how))
    values["memory_budget"] = _memory_budget(backend, device)
    values.update(_tuning(device))
    logger.debug("derived %s configuration: %s (%s; caches %s)", backend.name,
                 {n: s.value for n, s in values.items()}, how, device.caches or "unknown")
    return BackendConfig(backend.name, device_summary(device), fingerprint(backend, device), values)


def _memory_budget(backend: Backend, device: DeviceInfo) -> Setting:
    """Bytes the weights, caches and intermediates may use: what the device has free now."""
    try:
        memory = checked_memory_info(backend, 0)
    except NotSupportedError as exc:
        logger.debug("backend %r reports no memory (%s); memory budget from device_info", backend.name, exc)
        return Setting(device.memory_bytes, "derived", "device_info().memory_bytes (the backend reports no free "
                                                       "memory)", tunable=False)
    free = memory.free if memory.free is not None else memory.total
    return Setting(int(free), "derived", f"free device memory now ({memory.source or 'memory_info'})", tunable=False)


def _tuning(device: DeviceInfo) -> dict[str, Setting]:
    """Kernel tuning choices the device's facts imply; no backend reads them from a config, so not tunable."""
    out: dict[str, Setting] = {}
    limit = device.extra.get("max_work_group_size")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        size = 1 << (min(limit, 256).bit_length() - 1)
        units = device.compute_units or 1
        out["work_group_size"] = Setting(
            size, "derived", f"largest power of two <= min(256, max_work_group_size={limit}); at least {units} "
            "work-groups keep every compute unit busy. Not tunable: the backend exposes no work-group knob "
            "(its kernels fix the size)", tunable=False)
    return out


#: the most workers (or local schedulers) a PersistentKernel takes. Why a bound: each one gets its own queue and
#: state, so a typo such as 1e9 would otherwise surface as "Unable to allocate 3.73 TiB" (or numpy's "maximum
#: dimension exceeded" for 2**63) deep in a runtime. The largest devices have a few hundred compute units
#: (an H100: 132 SMs, an MI300X: 304 CUs), so 4096 leaves ample room.
MAX_PK_COUNT = 4096
COUNT_LOW = {"num_workers": 1, "num_local_schedulers": 0}


def check_count(key: str, value: Any, where: str, error: type[Exception] = SavedConfigError, fix: str = "") -> int:
    """``value`` as the int count ``key`` (num_workers >= 1, num_local_schedulers >= 0, both <= MAX_PK_COUNT), else
    ``error`` naming ``where`` and the fix."""
    low = COUNT_LOW[key]
    if isinstance(value, bool) or not isinstance(value, Integral) or not low <= value <= MAX_PK_COUNT:
        raise error(f"{where}: {key} must be an int >= {low} and <= {MAX_PK_COUNT} (e.g. 'num_workers': 2, "
                    f"'num_local_schedulers': 0; a few per compute unit at most), got {value!r}; "
                    f"{fix or 'fix the values'}")
    return int(value)


def check_counts(values: Mapping[str, Any], where: str, error: type[Exception] = SavedConfigError,
                 fix: str = "") -> None:
    """num_workers and num_local_schedulers as :func:`check_count` wants them, else ``error`` naming ``where``."""
    for key in COUNT_LOW:
        check_count(key, values.get(key), where, error, fix)


def check_sweep(sweep: Any, where: str, fix: str) -> None:
    """The measured candidates of a saved configuration: ``report()`` formats every field, so a junk row is refused
    here, naming the row, instead of failing later in ``report()``."""
    if not isinstance(sweep, list) or not all(isinstance(row, dict) for row in sweep):
        raise SavedConfigError(f"{where}: 'sweep' must be a list of objects, got {sweep!r}; {fix}")
    for i, row in enumerate(sweep):
        check_counts(row, f"{where}: sweep row {i}", fix=fix)
        error = row.get("error")
        if error is not None and not isinstance(error, str):
            raise SavedConfigError(f"{where}: sweep row {i}: 'error' must be a string or null, got {error!r}; {fix}")
        if error or row.get("median_ms") is None:
            continue  # a failed candidate: report() shows its error only
        for key in ("median_ms", "min_ms", "max_ms"):
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise SavedConfigError(f"{where}: sweep row {i}: {key!r} must be a finite number >= 0 (milliseconds "
                                       f"per step), got {value!r}; {fix}")
        samples = row.get("samples")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise SavedConfigError(f"{where}: sweep row {i}: 'samples' must be an int >= 1 for a measured row, got "
                                   f"{samples!r}; {fix}")


# -- saved configurations ---------------------------------------------------------------------------------------
def parse(data: Any, where: str) -> BackendConfig:
    """A saved configuration (the JSON of :meth:`BackendConfig.as_dict`), validated; values marked "saved"."""
    if not isinstance(data, dict):
        raise SavedConfigError(f"{where} must hold a JSON object (a saved backend configuration), got "
                               f"{type(data).__name__}; {_FIX.format(b='B')}")
    backend = data.get("backend")
    fix = _FIX.format(b=backend if isinstance(backend, str) and backend else "B")
    if data.get("schema") != SCHEMA:
        raise SavedConfigError(f"{where} has schema {data.get('schema')!r}; this yirage reads schema {SCHEMA}: {fix}")
    for key, kind in (("backend", str), ("fingerprint", str), ("device", dict), ("settings", dict)):
        if not isinstance(data.get(key), kind) or not data.get(key):
            raise SavedConfigError(f"{where}: {key!r} must be a non-empty {kind.__name__}, got "
                                   f"{data.get(key)!r}; {fix}")
    out: dict[str, Setting] = {}
    for name, raw in data["settings"].items():
        if not isinstance(raw, dict) or "value" not in raw or not isinstance(raw.get("source", ""), str):
            raise SavedConfigError(f"{where}: setting {name!r} must be an object with a 'value' (and a 'source'), "
                                   f"got {raw!r}; {fix}")
        was = raw.get("source") or "?"
        out[str(name)] = Setting(raw["value"], "saved", f"from {where} (was {was}: {raw.get('detail', '')})",
                                 bool(raw.get("tunable", True)))
    missing = [k for k in PK_KEYS if k not in out]
    if missing:
        raise SavedConfigError(f"{where}: settings {', '.join(missing)} are missing; {fix}")
    check_counts({k: out[k].value for k in PK_KEYS}, where, fix=fix)
    for key in ("threads", "memory_budget"):
        value = out[key].value if key in out else None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise SavedConfigError(f"{where}: {key} must be an int >= 0 or null, got {value!r}; {fix}")
    sweep = data.get("sweep", [])
    check_sweep(sweep, where, fix)
    return BackendConfig(backend, dict(data["device"]), data["fingerprint"], out, list(sweep))


def read_json(path: Path, what: str, fix: str) -> Any:
    """The JSON in ``path`` (None when it does not exist); unreadable or malformed: SavedConfigError with the fix."""
    try:
        text = settings.read_regular(path).decode("utf-8")  # a FIFO is refused, not opened: it would block forever
    except (FileNotFoundError, NotADirectoryError):  # ENOTDIR: a parent is a file (HOME=/dev/null): none saved
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise SavedConfigError(f"{what} {path} cannot be read ({exc}); {fix}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SavedConfigError(f"{what} {path} is not valid JSON ({exc}); {fix}") from exc


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` atomically (a new temp file, then rename), so a crash never leaves a torn file; neither a
    link at ``path`` nor one planted at a temporary name is followed (``settings.write_atomic``)."""
    if path.is_symlink():
        raise settings.UnsafeConfigError(f"{path} is a symbolic link; yirage does not write through links, where one "
                                         "could redirect the write to another file: delete the link or pass another "
                                         "path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        settings.write_atomic(path, json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise SavedConfigError(f"cannot write {path}: {exc}; pass a writable path (or point YIRAGE_CONFIG_DIR "
                               "elsewhere)") from exc
    return path


def applied_path() -> Path:
    """Where applied configurations live: ``autoconfig.json`` next to the settings file."""
    return settings.config_path().with_name("autoconfig.json")


def load_applied() -> dict[str, BackendConfig]:
    """Every applied configuration by backend name, validated ({} when none was applied)."""
    path = applied_path()
    data = read_json(path, "the applied backend configurations file", _FIX.format(b="B"))
    if data is None:
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("configs"), dict):
        raise SavedConfigError(f"the applied backend configurations file {path} must be an object with "
                               f"\"schema\": {SCHEMA} and \"configs\": {{backend: configuration}}; "
                               f"{_FIX.format(b='B')}")
    out = {}
    for name, entry in data["configs"].items():
        cfg = parse(entry, f"the applied configuration of {name!r} in {path}")
        if cfg.backend != name:
            raise SavedConfigError(f"{path}: the entry under {name!r} is for backend {cfg.backend!r}; "
                                   f"{_FIX.format(b=name)}")
        out[name] = cfg
    return out


def apply(cfg: BackendConfig) -> Path:
    """Save ``cfg`` for later processes (replacing that backend's entry); a corrupted file is overwritten."""
    path = applied_path()
    settings.check_writable_target(path)  # a private directory and no link, before the old file is even read
    try:
        data = read_json(path, "the applied backend configurations file", "")
    except SavedConfigError as exc:
        logger.warning("replacing the unusable %s: %s", path, exc)
        data = None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("configs"), dict):
        data = {"schema": SCHEMA, "configs": {}}
    data["configs"][cfg.backend] = cfg.as_dict()
    write_json(path, data)
    logger.info("applied configuration for backend %r saved in %s: %s", cfg.backend, path, cfg)
    return path


def saved_for(backend: Backend, device: DeviceInfo) -> BackendConfig | None:
    """The applied configuration of ``backend`` for this device, or None (other device: a WARNING)."""
    cfg = load_applied().get(backend.name)
    if cfg is None:
        return None
    here = fingerprint(backend, device)
    if cfg.fingerprint != here:
        logger.warning("ignoring the applied configuration of backend %r in %s: it was made for device %r, "
                       "this one is %r; run `python tools/yirage_backend_manager.py optimize --backend %s --apply` to "
                       "configure this device", backend.name, applied_path(), cfg.fingerprint, here, backend.name)
        return None
    return cfg


# -- what a PersistentKernel runs with -----------------------------------------------------------------------------
def resolve_pk_config(backend: Backend, num_workers: Any = None, num_local_schedulers: Any = None) -> BackendConfig:
    """Explicit arguments, else the applied configuration for this device, else the backend's default_config,
    else one worker and one scheduler; each value says which. A backend that cannot describe its device gets
    no saved configuration (nothing to match it with)."""
    device: DeviceInfo | None = None
    try:
        device = checked_device_info(backend, 0)
        proposal = dict(backend.default_config(device))
        how, source = f"{backend.name}.default_config from device_info()", "derived"
    except NotSupportedError as exc:
        proposal = {"num_workers": 1, "num_local_schedulers": 1}
        how, source = f"one worker and one scheduler: {exc}", "default"
    values = {k: Setting(v, source, how) for k, v in proposal.items()}
    both = num_workers is not None and num_local_schedulers is not None
    saved = None if both or device is None else saved_for(backend, device)  # both explicit: the file has no say
    if saved is not None:
        for key in PK_KEYS:
            values[key] = saved.settings[key]
        logger.info("backend %r: using the applied configuration from %s: num_workers=%d, "
                    "num_local_schedulers=%d", backend.name, applied_path(), saved.num_workers,
                    saved.num_local_schedulers)
    for key, value in (("num_workers", num_workers), ("num_local_schedulers", num_local_schedulers)):
        if value is not None:
            values[key] = Setting(int(value), "explicit", "passed by the caller")
    kind = backend.persistent_kind
    for key in PK_KEYS:  # a runtime that ignores a field says so, instead of storing it silently
        ignored = kind.ignores(key) if isinstance(kind, RuntimeKind) else ""
        if ignored and key in values:
            s = values[key]
            values[key] = Setting(s.value, s.source, f"{ignored}; {s.detail}", tunable=False)
    logger.debug("PersistentKernel on %r runs with %s", backend.name,
                 {k: (s.value, s.source) for k, s in values.items()})
    summary = device_summary(device) if device is not None else {"name": "(not described)"}
    return BackendConfig(backend.name, summary, fingerprint(backend, summary), values)
