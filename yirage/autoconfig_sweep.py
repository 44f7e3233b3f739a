"""``yr.auto_configure_backend`` and ``yr.BackendOptimizer``: derive a configuration, refine it by timing.

The derivation is :func:`yirage.autoconfig.derive` (device_info). The refinement times a tiny
PersistentKernel decode (a random-weight toy Llama built in memory, no files, no downloads) at a few
(num_workers, num_local_schedulers) candidates around the derived pair, round-robin so that drift in
the machine's load hits every candidate alike, and keeps the fastest median ms/step. Every
candidate's median, min and max are kept in ``BackendConfig.sweep``. Compiling is not timed.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yirage import system
from yirage.autoconfig import (
    BackendConfig,
    ConfigMismatchError,
    Setting,
    derive,
    fingerprint,
    parse,
    read_json,
    write_json,
)
from yirage.backend.base import Backend, checked_device_info
from yirage.backend.selection import current_backend, registry, resolve
from yirage.errors import NotSupportedError, YirageError

logger = logging.getLogger("yirage.autoconfig")

DEFAULT_DURATION = 5.0  # seconds of timing, split over the candidates (compiling is extra)
MIN_ROUNDS = 3  # every candidate is timed at least this often, whatever the duration
MAX_ROUNDS = 200
#: a candidate replaces the derived pair only when its median is at least this much lower (else it is noise)
KEEP_MARGIN = 0.03
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ToyModel:
    """The random-weight Llama the sweep decodes with. The default streams ~56 MB of float32 weights per
    step (more than the caches hold, like a real model); TINY is for tests."""

    hidden: int = 512
    intermediate: int = 1536
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 8192
    steps: int = 8  # decode steps per timed sample

    def build(self, seed: int = 0, backend: Backend | None = None) -> Any:
        """The toy model with seeded random weights, on ``backend``'s device (default: the CPU)."""
        import torch

        from yirage.models.config import LlamaConfig
        from yirage.models.llama import LlamaModel
        from yirage.models.placement import Placement

        config = LlamaConfig.from_dict({
            "model_type": "llama", "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab, "max_position_embeddings": 4096})
        gen = torch.Generator().manual_seed(seed)
        weights = {name: torch.randn(shape, generator=gen) * (0.5 if len(shape) == 1 else shape[-1] ** -0.5)
                   for name, shape in config.weight_shapes().items()}
        return LlamaModel(config, weights, placement=Placement.of_backend(backend) if backend else None)


TINY = ToyModel(hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, vocab=256, steps=4)
DEFAULT_MODEL = ToyModel()  # read at call time (as is DEFAULT_DURATION): None arguments mean these
PROMPT = 4  # the position every sample starts decoding from


def check_duration(duration: Any) -> float:
    """A positive finite number of seconds (None: DEFAULT_DURATION), else ValueError with the fix."""
    if duration is None:
        return DEFAULT_DURATION
    if isinstance(duration, bool) or not isinstance(duration, numbers.Real):
        raise ValueError(f"duration must be a number of seconds, got {type(duration).__name__} {duration!r}; "
                         f"pass e.g. duration={DEFAULT_DURATION:g}")
    value = float(duration)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"duration is {value:g}, but the sweep needs a positive finite time to measure in; "
                         f"pass e.g. duration={DEFAULT_DURATION:g}")
    return value


def candidates(workers: int, schedulers: int, max_threads: int | None, limit: int) -> list[tuple[int, int]]:
    """The derived pair first, then its neighbours: trade a worker for a scheduler or back, one thread fewer
    or more; at most ``limit`` pairs, none with more threads than ``max_threads`` (None: no cap)."""
    near = [(workers, schedulers), (workers - 1, schedulers + 1), (workers + 1, schedulers - 1),
            (workers - 1, schedulers), (workers, schedulers + 1), (workers + 1, schedulers)]
    out: list[tuple[int, int]] = []
    for w, s in near:
        if w >= 1 and s >= 0 and (max_threads is None or w + s <= max_threads) and (w, s) not in out:
            out.append((w, s))
    return out[:max(1, limit)]


def _max_threads(backend: Backend) -> int | None:
    """Host threads a CPU-kind device can run at once (logical cores); None for devices with their own."""
    device = checked_device_info(backend, 0)
    if device.kind != "cpu":
        return None
    logical = device.extra.get("logical_cores")
    return int(logical) if isinstance(logical, int) and logical > 0 else device.compute_units


def _decoder(model: Any, backend: Backend, pair: tuple[int, int], toy: ToyModel) -> tuple[Any, Any, Any]:
    import torch

    max_len = PROMPT + toy.steps + 2
    tokens = torch.randint(0, toy.vocab, (1, max_len), generator=torch.Generator().manual_seed(1)).to(model.device)
    step = torch.tensor([PROMPT], dtype=torch.int64, device=model.device)
    pk = model.build_decoder(step, tokens, backend=backend, num_workers=pair[0], num_local_schedulers=pair[1],
                             tasks=4 if toy.hidden < 256 else 16)
    return pk, step, tokens


def _sample(pk: Any, step: Any, steps: int) -> float:
    """Milliseconds per decode step of one run of ``steps`` steps from position PROMPT."""
    step.fill_(PROMPT)
    start = time.perf_counter()
    ran = pk(steps)
    elapsed = time.perf_counter() - start
    if ran != steps:
        raise YirageError(f"the sweep's decode ran {ran} steps instead of {steps}; this is a bug in the backend's "
                          "PersistentKernel runtime: report it")
    return 1e3 * elapsed / steps


def sweep(backend: Backend, pairs: Sequence[tuple[int, int]], duration: float, toy: ToyModel = DEFAULT_MODEL,
          progress: Progress | None = None) -> list[dict[str, Any]]:
    """Time a toy decode at every pair; rows fastest first: pair, median/min/max ms per step, samples, error."""
    import statistics

    model = toy.build(backend=backend)
    model.reset_cache(1, PROMPT + toy.steps + 2)
    rows = [{"num_workers": w, "num_local_schedulers": s, "median_ms": None, "min_ms": None, "max_ms": None,
             "samples": 0, "error": None} for w, s in pairs]
    total = len(pairs) * (1 + MIN_ROUNDS)
    done = 0
    decoders: list[Any] = []
    for row, pair in zip(rows, pairs, strict=True):
        try:
            pk, step, _tokens = _decoder(model, backend, pair, toy)
            _sample(pk, step, toy.steps)  # warm up: first run pays thread start-up and page faults
            decoders.append((pk, step))
        except (YirageError, ValueError, RuntimeError) as exc:  # recorded in the row and logged, not dropped
            logger.warning("sweep candidate %s on %r failed: %s", pair, backend.name, exc)
            row["error"] = f"{type(exc).__name__}: {exc}"
            decoders.append(None)
        done += 1
        if progress:
            progress(done, total, f"compiled {pair[0]}w+{pair[1]}s")
    live = [i for i, d in enumerate(decoders) if d is not None]
    times: dict[int, list[float]] = {i: [] for i in live}
    start, rounds = time.perf_counter(), MIN_ROUNDS
    r = 0
    while live and r < rounds:
        for i in live:
            pk, step = decoders[i]
            times[i].append(_sample(pk, step, toy.steps))
            done += 1
            if progress:
                progress(done, total, f"round {r + 1}/{rounds} {pairs[i][0]}w+{pairs[i][1]}s")
        r += 1
        if r == 1:  # now the cost of a round is known: fill the duration
            per_round = time.perf_counter() - start
            rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(duration / max(per_round, 1e-6))))
            total = len(pairs) + rounds * len(live)
    for i in live:
        rows[i].update(median_ms=statistics.median(times[i]), min_ms=min(times[i]), max_ms=max(times[i]),
                       samples=len(times[i]))
    rows.sort(key=lambda row: (row["median_ms"] is None, row["median_ms"] or 0.0))
    logger.debug("sweep on %r (%.1f s): %s", backend.name, time.perf_counter() - start,
                 [(row["num_workers"], row["num_local_schedulers"], row["median_ms"], row["error"]) for row in rows])
    return rows


def refine(cfg: BackendConfig, backend: Backend, duration: float, max_candidates: int = 4,
           toy: ToyModel = DEFAULT_MODEL, progress: Progress | None = None) -> BackendConfig:
    """Time the candidates around ``cfg``'s pair and keep the fastest (settings marked "measured")."""
    pairs = candidates(cfg.num_workers, cfg.num_local_schedulers, _max_threads(backend), max_candidates)
    if len(pairs) < 2:
        logger.debug("nothing to sweep on %r: the derived pair %s has no neighbours", backend.name, pairs)
        return cfg
    try:
        rows = sweep(backend, pairs, duration, toy, progress)
    except NotSupportedError as exc:  # e.g. a backend without a PersistentKernel runtime: stays derived
        logger.warning("backend %r: configuration not measured (%s); keeping the derived one", backend.name, exc)
        return cfg
    cfg.sweep = rows
    best = rows[0]
    if best["median_ms"] is None:
        raise YirageError(f"the sweep on backend {backend.name!r} could not run any candidate: "
                          + "; ".join(f"{r['num_workers']}w+{r['num_local_schedulers']}s: {r['error']}"
                                      for r in rows) + ". Fix that, or pass sweep=False for the derived values")
    how = (f"fastest median of {len(rows)} candidates: {best['median_ms']:.3f} ms/step on a toy "
           f"{toy.layers}-layer Llama (hidden {toy.hidden}), {best['samples']} samples each")
    derived = next(r for r in rows if (r["num_workers"], r["num_local_schedulers"]) == pairs[0])
    if derived is not best and derived["median_ms"] is not None \
            and best["median_ms"] > (1 - KEEP_MARGIN) * derived["median_ms"]:
        how = (f"the derived pair measured {derived['median_ms']:.3f} ms/step, within {KEEP_MARGIN:.0%} of the "
               f"fastest of {len(rows)} candidates ({best['median_ms']:.3f}): kept, as the difference is noise-sized")
        best = derived
    w, s = best["num_workers"], best["num_local_schedulers"]
    cfg.settings["num_workers"] = Setting(w, "measured", how)
    cfg.settings["num_local_schedulers"] = Setting(s, "measured", how)
    if cfg.settings.get("threads") and cfg.settings["threads"].value is not None:
        cfg.settings["threads"] = Setting(w + s, "measured", "one host thread per worker and scheduler")
    logger.debug("sweep on %r chose %d workers + %d schedulers (%s)", backend.name, w, s, how)
    return cfg


def _backend(backend: Any, where: str) -> Backend:
    return current_backend(need="persistent") if backend is None else resolve(backend, where, need="persistent")


def auto_configure_backend(backend: Any = None, *, sweep: bool = True, duration: float | None = None,
                           max_candidates: int = 4, model: ToyModel | None = None,
                           progress: Progress | None = None) -> BackendConfig:
    """The configuration for ``backend`` (None: the current one; "auto" works): derived from its device_info(),
    then (``sweep=True``) refined by timing a toy decode for about ``duration`` seconds (None: DEFAULT_DURATION)
    on ``model`` (None: DEFAULT_MODEL). Every value carries
    its source ("derived", "measured"). Unknown or unavailable backends, and backends that propose no
    configuration, raise with the reason and the fix."""
    seconds = check_duration(duration)
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1:
        raise ValueError(f"max_candidates must be an int >= 1, got {max_candidates!r}; pass e.g. 4")
    chosen = _backend(backend, "auto_configure_backend(backend=...)")
    cfg = derive(chosen)
    if sweep:
        refine(cfg, chosen, seconds, max_candidates, model or DEFAULT_MODEL, progress)
    return cfg


class BackendOptimizer:
    """Finds, shows, saves and loads backend configurations (see auto_configure_backend)."""

    def __init__(self, *, sweep: bool = True, duration: float | None = None, max_candidates: int = 4,
                 model: ToyModel | None = None) -> None:
        self.sweep, self.duration = bool(sweep), check_duration(duration)
        self.max_candidates, self.model = max_candidates, model
        self._found: dict[str, BackendConfig] = {}

    def get_optimal_config(self, backend: Any = None) -> BackendConfig:
        """The configuration for ``backend`` (None: the current one), found once per optimizer."""
        chosen = _backend(backend, "BackendOptimizer.get_optimal_config(backend=...)")
        if chosen.name not in self._found:
            self._found[chosen.name] = auto_configure_backend(
                chosen.name, sweep=self.sweep, duration=self.duration, max_candidates=self.max_candidates,
                model=self.model)
        return self._found[chosen.name]

    def save_config(self, path: str | Path, backend: Any = None) -> Path:
        """Write the configuration for ``backend`` as JSON (schema, backend, device fingerprint, settings)."""
        cfg = self.get_optimal_config(backend)
        return write_json(Path(path), cfg.as_dict())

    def load_config(self, path: str | Path, backend: Any = None) -> BackendConfig:
        """Read a saved configuration, refusing one that is malformed or was made for another backend/device."""
        path = Path(path)
        fix = "run BackendOptimizer().save_config(path, backend=...) on this machine to write one"
        data = read_json(path, "the backend configuration file", fix)
        if data is None:
            raise ConfigMismatchError(f"the backend configuration file {path} does not exist; {fix}")
        cfg = parse(data, f"the backend configuration file {path}")
        if backend is not None and _name(backend) != cfg.backend:
            raise ConfigMismatchError(f"{path} holds a configuration for backend {cfg.backend!r}, not "
                                      f"{_name(backend)!r}; {fix}")
        reg = registry()
        if cfg.backend not in reg:
            raise ConfigMismatchError(f"{path} was saved for backend {cfg.backend!r}, which is not installed "
                                      f"here; {fix}")
        target = reg.get(cfg.backend)
        avail = target.availability()
        if not avail.ok:
            raise ConfigMismatchError(f"{path} was saved for backend {cfg.backend!r}, which is unavailable here "
                                      f"({avail.reason}); {fix}")
        here = fingerprint(target, checked_device_info(target, 0))
        if here != cfg.fingerprint:
            raise ConfigMismatchError(f"{path} was saved for device {cfg.fingerprint!r}, but backend "
                                      f"{cfg.backend!r} runs on {here!r} here (mismatched device); {fix}")
        return cfg

    def print_system_info(self) -> None:
        """Host facts, then every available backend's device, memory and derived configuration."""
        host = system.host_facts()
        print(f"Host: {host['cpu_model']} ({host['machine']}), {host['physical_cores']} physical / "
              f"{host['logical_cores']} logical cores ({host['usable_cores']} usable), SIMD "
              f"{host['simd_bits'] or '?'} bit, RAM {host['ram_total'] / 2**30:.1f} GiB "
              f"({host['ram_available'] / 2**30:.1f} GiB available), {host['os']}, Python {host['python']}")
        for backend in registry().backends():
            avail = backend.availability()
            if not avail.ok:
                print(f"  {backend.name:<10} unavailable: {avail.reason}")
                continue
            try:
                print(f"  {backend.name:<10} {derive(backend)}")
            except YirageError as exc:  # shown: the optimizer cannot configure it, the rest are still listed
                print(f"  {backend.name:<10} not configurable: {exc}")


def _name(backend: Any) -> str:
    return backend.name if isinstance(backend, Backend) else str(getattr(backend, "value", backend)).strip().lower()
