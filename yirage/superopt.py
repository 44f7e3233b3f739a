"""``g.superoptimize()``: search fused-kernel candidates on the target backend, prove them equal, time them, keep one.

Mirage searches kernel and thread-block graphs for the fastest equivalent program. yirage's search space today is
the fusion partition: every ``FusionPolicy`` (which inlinings the partitioner may make: pointwise chains, prologues
into row ops and matmuls, epilogues, RMSNorm as a matmul row scale) gives a plan; equal plans are tried once. Per-plan
schedule knobs declared by backends (tile sizes, work splits) are the next dimension of the same search.

Each candidate is compiled on the target backend and **verified before it is timed**: it runs on seeded random
inputs (valid ids and lengths for embedding and attention inputs) and every output is compared with the graph
evaluated in float64 by torch (``yirage.reference.verify``, the conformance kit's tolerances). A candidate that
fails is never timed or chosen. The verified ones are timed on the target device in interleaved rounds, their
order shuffled each round (warm-up first, then ``profile_iters`` calls per round, the device synchronized around
each batch); a candidate replaces the current best only when its median beats it by more than the best's own
spread (and at least 2%), so noise does
not pick a winner. The default fusion is the first candidate and wins ties.

The winner is cached in the compile cache (``<cache>/superopt/<key>.json``, written privately and atomically),
keyed by the graph's content hash (shapes, dtypes, strides, ops), the backend, its target and fingerprint and
this search's version: a second process reuses it without searching; an entry that does not parse or names an
unknown policy is searched again. ``YIRAGE_SUPEROPTIMIZE=0`` turns the search off (the default fusion is used).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from yirage.backend.selection import current_backend, resolve
from yirage.compiler.cache import cache_root, private_dir, private_root, write_private
from yirage.compiler.fusion import DEFAULT_POLICY, FusionPolicy
from yirage.compiler.lower import build_plan
from yirage.errors import YirageError
from yirage.graph.kernel_graph import KernelGraph, install_superoptimizer
from yirage.reference.magnitude import graph_oracle
from yirage.reference.verify import DTYPE_TOLERANCE, assert_same_floats, random_inputs
from yirage.runtime.executable import Executable
from yirage.runtime.graphs import graph_dtypes

logger = logging.getLogger("yirage.superopt")

SEARCH_VERSION = "1"
ENV = "YIRAGE_SUPEROPTIMIZE"
#: Mirage's search configurations; yirage searches the same space for each (recorded in the report)
CONFIGS = (None, "mlp", "attention", "lora")


class SuperoptimizeError(YirageError, ValueError):
    """A superoptimize call with arguments it cannot use."""


@dataclass
class Trial:
    """One candidate: its fusion policy, kernel count, whether it matched the oracle, and its median time."""

    policy: str
    kernels: int
    verified: bool = False
    error: str = ""
    median_us: float | None = None
    spread_us: float | None = None  # interquartile range of the timed batches


@dataclass
class Report:
    """What ``superoptimize`` tried and chose (``str(report)`` is a table)."""

    graph: str
    backend: str
    config: str | None
    winner: str
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0
    from_cache: bool = False
    note: str = ""

    def __str__(self) -> str:
        cached = " (from the cache)" if self.from_cache else ""
        note = f"; {self.note}" if self.note else ""
        head = f"superoptimize graph {self.graph[:12]} on {self.backend}: winner {self.winner}{cached}; " \
               f"{self.seconds:.1f} s{note}"
        rows = [f"  {t.policy:44} {t.kernels:3} kernel(s)  "
                + (f"{t.median_us:10.1f} us (spread {t.spread_us:.1f})" if t.median_us is not None else
                   ("verified, not timed" if t.verified else f"REJECTED: {t.error[:120]}"))
                for t in self.trials]
        return "\n".join([head, *rows])


class Superoptimized:
    """The graph compiled with the chosen plan: call it like the graph (``g(inputs=[...])`` or ``g([...])``)."""

    def __init__(self, graph: KernelGraph, executable: Any, report: Report) -> None:
        self.graph, self.executable, self.report = graph, executable, report

    def __call__(self, inputs: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
        if kwargs:
            if set(kwargs) != {"inputs"} or inputs is not None:
                raise SuperoptimizeError(f"a superoptimized graph takes its inputs once, as a list: got "
                                         f"{sorted(kwargs)}{' and a positional list' if inputs is not None else ''}")
            inputs = kwargs["inputs"]
        return self.executable(inputs)

    def to_json(self, *args: Any, **kwargs: Any) -> str:
        return self.graph.to_json(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Superoptimized {self.graph.digest[:12]} on {self.report.backend}: {self.report.winner}>"


def superoptimize(graph: KernelGraph, *, config: str | None = None, backend: Any = None, warmup_iters: int = 3,
                  profile_iters: int = 10, rounds: int = 5, time_budget_s: float = 60.0,
                  use_cached_graphs: bool = True, seed: int = 0) -> Superoptimized:
    """Search ``graph``'s fusion plans on ``backend`` (module docstring); return the fastest verified one."""
    if config not in CONFIGS:
        raise SuperoptimizeError(f"config={config!r}: use one of {', '.join(map(repr, CONFIGS))}")
    for name, value in (("warmup_iters", warmup_iters), ("profile_iters", profile_iters), ("rounds", rounds)):
        if type(value) is not int or value < (0 if name == "warmup_iters" else 1):
            raise SuperoptimizeError(f"{name}={value!r}: pass a positive int")
    if not time_budget_s > 0:
        raise SuperoptimizeError(f"time_budget_s={time_budget_s!r}: pass a positive number of seconds")
    started = time.perf_counter()
    snapshot = graph.copy()
    dtypes = graph_dtypes(snapshot)
    chosen = current_backend(need="kernel_graphs", dtypes=dtypes) if backend is None else \
        resolve(backend, need="kernel_graphs", dtypes=dtypes)
    if os.environ.get(ENV, "1").strip() == "0":
        exe = _compile(snapshot, chosen, DEFAULT_POLICY)
        return Superoptimized(graph, exe, Report(snapshot.digest, chosen.name, config, DEFAULT_POLICY.name,
                                                 note=f"search off ({ENV}=0)"))
    key = _key(snapshot, chosen)
    if use_cached_graphs:
        policy = _cached(key)
        if policy is not None:
            exe = _compile(snapshot, chosen, policy)
            report = Report(snapshot.digest, chosen.name, config, policy.name, from_cache=True,
                            seconds=time.perf_counter() - started)
            return Superoptimized(graph, exe, report)
    report = Report(snapshot.digest, chosen.name, config, DEFAULT_POLICY.name)
    deadline = started + time_budget_s
    candidates = _candidates(snapshot, report)
    inputs = _inputs(snapshot, chosen, seed)
    verified = []
    for policy, plan in _progress(candidates, "superoptimize: verify"):
        trial = next(t for t in report.trials if t.policy == policy.name)
        if time.perf_counter() > deadline and verified:
            trial.error = "not tried: the time budget was spent"
            continue
        try:
            exe = _compile(snapshot, chosen, policy, plan)
            _verify(snapshot, exe, inputs)
        except (AssertionError, YirageError, RuntimeError) as exc:  # a wrong or failing candidate is rejected
            trial.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logger.debug("candidate %s rejected: %s", policy.name, trial.error)
            continue
        trial.verified = True
        verified.append((policy, exe, trial))
    if not verified:
        raise SuperoptimizeError(f"no candidate plan of graph {snapshot.digest[:12]} matched the float64 oracle on "
                                 f"{chosen.name}: {report.trials[0].error}; compile it with g.compile('reference')")
    winner = _time(verified, inputs, chosen, warmup_iters, profile_iters, rounds, deadline)
    report.winner = winner[0].name
    report.seconds = time.perf_counter() - started
    _store(key, winner[0], report)
    logger.info("%s", report)
    return Superoptimized(graph, winner[1], report)


def _candidates(graph: KernelGraph, report: Report) -> list[tuple[FusionPolicy, Any]]:
    """One plan per distinct partition, the default first."""
    seen: dict[tuple[str, ...], FusionPolicy] = {}
    out = []
    for policy in FusionPolicy.all():
        plan = build_plan(graph, policy)
        shape = tuple(repr(k).replace(plan.digest, "") for k in plan.kernels)
        if shape in seen:
            continue
        seen[shape] = policy
        out.append((policy, plan))
        report.trials.append(Trial(policy.name, len(plan.kernels)))
    return out


def _compile(graph: KernelGraph, backend: Any, policy: FusionPolicy, plan: Any = None) -> Any:
    plan = build_plan(graph, policy) if plan is None else plan
    start = time.perf_counter()
    run = backend.compile(plan, graph)
    return Executable(graph, plan, backend, run, time.perf_counter() - start)


def _inputs(graph: KernelGraph, backend: Any, seed: int) -> list[Any]:
    """Seeded inputs made on the CPU (valid ids and lengths), moved to the backend's device once."""
    import torch

    device = torch.device(backend.torch_device)
    return [t.to(device) for t in random_inputs(graph, seed=seed)]


def _verify(graph: KernelGraph, exe: Any, inputs: list[Any]) -> None:
    """Every output against the graph evaluated in float64; AssertionError names the first difference (raised
    explicitly: ``python -O`` does not turn the check off)."""
    import torch

    outs = [o.cpu() for o in exe(inputs)]
    refs, scales = graph_oracle(graph, [t.cpu() for t in inputs])
    for index, (out, ref, scale, node) in enumerate(zip(outs, refs, scales, graph.output_nodes, strict=True)):
        what = f"output {index}"
        if tuple(out.shape) != tuple(node.dims) or out.dtype != node.dtype.torch:
            raise AssertionError(f"{what}: {tuple(out.shape)} {out.dtype}, declared {node.dims} {node.dtype}")
        if not out.is_floating_point():
            if not torch.equal(out.to(torch.int64), ref.to(torch.int64)):
                raise AssertionError(f"{what}: integers differ from the float64 oracle")
            continue
        keep = torch.isfinite(ref)
        scale = torch.zeros_like(ref) if scale is None else torch.where(keep & torch.isfinite(scale), scale, 0.0)
        rtol, atol = DTYPE_TOLERANCE[node.dtype.name]
        assert_same_floats(out, ref, rtol, atol, scale=scale, what=what)


def _sync(backend: Any) -> Any:
    import torch

    module = getattr(torch, torch.device(backend.torch_device).type, None)
    return getattr(module, "synchronize", None) or (lambda: None)


def _time(verified: list[tuple[FusionPolicy, Any, Trial]], inputs: list[Any], backend: Any, warmup: int,
          iters: int, rounds: int, deadline: float) -> tuple[FusionPolicy, Any]:
    """Interleaved rounds of ``iters`` calls per candidate; the default keeps the lead unless clearly beaten."""
    sync = _sync(backend)
    for _, exe, _ in verified:
        for _ in range(warmup):
            exe(inputs)
    sync()
    samples: dict[str, list[float]] = {policy.name: [] for policy, _, _ in verified}
    order = list(verified)
    shuffle = random.Random(0).shuffle  # a batch pays for what the one before it left: vary who goes before whom
    for _ in _progress(range(rounds), "superoptimize: time"):
        shuffle(order)
        for policy, exe, _ in order:
            start = time.perf_counter()
            for _ in range(iters):
                exe(inputs)
            sync()
            samples[policy.name].append((time.perf_counter() - start) / iters * 1e6)
        if time.perf_counter() > deadline:
            break
    best = verified[0]
    for policy, _exe, trial in verified:
        times = sorted(samples[policy.name])
        trial.median_us = statistics.median(times)
        trial.spread_us = times[(3 * len(times)) // 4] - times[len(times) // 4] if len(times) > 1 else 0.0
        logger.debug("candidate %s: %.1f us (spread %.1f)", policy.name, trial.median_us, trial.spread_us)
    for policy, exe, trial in verified[1:]:
        lead = best[2]
        assert lead.median_us is not None and trial.median_us is not None
        margin = max(0.02 * lead.median_us, lead.spread_us or 0.0, trial.spread_us or 0.0)
        if trial.median_us < lead.median_us - margin:
            best = (policy, exe, trial)
    return best[0], best[1]


def _progress(items: Any, what: str) -> Any:
    """A tqdm bar on a terminal (tqdm decides: disable=None), else the items as they are."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=what, disable=None, leave=False)


# -- the cache ------------------------------------------------------------------------------------------------------

def _key(graph: KernelGraph, backend: Any) -> str:
    parts = [SEARCH_VERSION, graph.digest, backend.name]
    for attr in ("target", "fingerprint"):
        fn = getattr(backend, attr, None)
        parts.append(str(fn()) if callable(fn) else "")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _entry(key: str) -> Any:
    return private_dir(private_root(cache_root()) / "superopt") / f"{key}.json"


def _cached(key: str) -> FusionPolicy | None:
    """The winner stored for ``key``, or None (missing, or damaged: then searched again, with a warning)."""
    path = _entry(key)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("version") != SEARCH_VERSION or doc.get("key") != key:
            raise ValueError("another key or version")
        policy = FusionPolicy(**doc["policy"])
        if not all(type(v) is bool for v in asdict(policy).values()):
            raise ValueError("policy flags are not booleans")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("superoptimize cache entry %s is damaged (%s: %s); searching again", path,
                       type(exc).__name__, exc)
        return None
    return policy


def _store(key: str, policy: FusionPolicy, report: Report) -> None:
    doc = {"version": SEARCH_VERSION, "key": key, "policy": asdict(policy), "winner": policy.name,
           "trials": [asdict(t) for t in report.trials]}
    write_private(_entry(key), json.dumps(doc, indent=1) + "\n")


install_superoptimizer(superoptimize)
