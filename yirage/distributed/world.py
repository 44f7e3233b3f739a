"""Who this process is in a multi-rank run, and the torch.distributed process group it joins.

The contract is torchrun's: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``. ``mpirun`` launches are mapped onto it
(Open MPI's ``OMPI_COMM_WORLD_*``, MPICH / Intel MPI's ``PMI_RANK`` /
``PMI_SIZE``, MVAPICH2's ``MV2_COMM_WORLD_*``); MASTER_ADDR and MASTER_PORT
must then be exported by the user (``mpirun -x MASTER_ADDR=host -x
MASTER_PORT=29500``), since MPI has no rendezvous address torch can use.
Explicit arguments win over the environment.

``init_world`` joins the process group with the collective backend the yirage
Backend names (``Backend.collective_backend()``) and a timeout
(``YIRAGE_DIST_TIMEOUT``, seconds) that bounds the rendezvous and every
collective, so a dead or stuck rank ends the others with an error instead
of a hang. It creates the rendezvous store itself and keeps it: after a failed
collective the survivors use it to find out which rank is gone
(``yirage.distributed.collectives``).
"""

from __future__ import annotations

import atexit
import importlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from yirage.errors import YirageError

#: seconds a rendezvous or a collective may take when YIRAGE_DIST_TIMEOUT is unset: long enough for a
#: slow rank to finish loading its shards before the first collective, short enough that a dead peer is noticed
DEFAULT_TIMEOUT_S = 300.0

#: (launcher, rank variable, world-size variable, local-rank variable), torchrun first
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Open MPI mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH / Intel MPI mpirun", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("MVAPICH2 mpirun", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
)

#: collective backends that a separate package registers with torch.distributed, and that package
PROVIDERS = {"hccl": "torch_npu", "cncl": "torch_mlu", "mccl": "torch_musa"}
#: what to install when torch itself lacks a built-in collective backend
BUILTIN_HINTS = {
    "gloo": "a torch build with gloo (every PyPI wheel of torch has it: pip install torch)",
    "nccl": "a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu124)",
    "mpi": "a torch built from source against MPI (no PyPI wheel has the mpi backend)",
    "xccl": "an XPU build of torch (pip install torch --index-url https://download.pytorch.org/whl/xpu)",
}


class DistributedError(YirageError, RuntimeError):
    """A multi-rank run that cannot start or cannot go on; the message names the rank, the cause and the fix."""


@dataclass(frozen=True)
class World:
    """This process's place in the run: ``rank`` of ``world_size``, ``local_rank`` on its machine."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "single process"  # "explicit", "torchrun", "Open MPI mpirun", ...

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def _int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise DistributedError(f"{what}={value!r} is not an integer; the launcher's environment is broken: start "
                                   "the ranks with torchrun (or mpirun), or pass rank= and world_size=") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DistributedError(f"{what}={value!r} must be an integer >= {minimum}; fix the launcher's environment "
                               "or the rank=/world_size= arguments")
    return value


def _checked(rank: Any, size: Any, local: Any, names: tuple[str, str, str], source: str,
             env: Mapping[str, str]) -> World:
    rank, size = _int(rank, names[0], 0), _int(size, names[1], 1)
    local = rank if local is None else _int(local, names[2], 0)
    if rank >= size:
        raise DistributedError(f"{names[0]}={rank} is not below {names[1]}={size} ({source}): ranks are 0 .. "
                               f"{size - 1}; fix the launcher's environment or the rank=/world_size= arguments")
    port = env.get("MASTER_PORT")
    return World(rank, size, local, env.get("MASTER_ADDR") or None, None if port in (None, "") else _port(port), source)


def _port(value: str) -> int:
    """MASTER_PORT as a TCP port: past 65535 torch's TCPStore fails with a bare TypeError about its arguments."""
    port = _int(value, "MASTER_PORT", 1)
    if port > 65535:
        raise DistributedError(f"MASTER_PORT={value!r} is not a TCP port (1..65535); set it to a free port on rank "
                               "0's host, the same on every rank, e.g. MASTER_PORT=29500")
    return port


def resolve_world(rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                  environ: Mapping[str, str] | None = None) -> World:
    """This process's World from explicit arguments, else torchrun's or mpirun's environment, else a single rank."""
    env = os.environ if environ is None else environ
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise DistributedError(f"pass both rank= and world_size= (got rank={rank!r}, world_size={world_size!r}), "
                                   "or neither to take them from torchrun's / mpirun's environment")
        return _checked(rank, world_size, local_rank, ("rank", "world_size", "local_rank"), "explicit", env)
    found: list[tuple[World, str]] = []
    for source, rank_var, size_var, local_var in LAUNCHERS:
        present = [v for v in (rank_var, size_var) if env.get(v, "") != ""]
        if not present:
            continue
        if len(present) == 1:
            missing = size_var if present == [rank_var] else rank_var
            raise DistributedError(f"the environment sets {present[0]} but not {missing} (the {source} contract "
                                   f"needs both); start the ranks with {source.split()[-1]}, or set {missing}")
        local = (env.get(local_var) or None) if local_rank is None else local_rank
        world = _checked(env[rank_var], env[size_var], local, (rank_var, size_var, local_var), source, env)
        found.append((world, f"{rank_var}={env[rank_var]}, {size_var}={env[size_var]}"))
    if not found:
        return World(0, 1, 0 if local_rank is None else _int(local_rank, "local_rank", 0), source="single process")
    first, first_vars = found[0]
    for other, other_vars in found[1:]:
        if (other.rank, other.world_size) != (first.rank, first.world_size):
            raise DistributedError(f"{first.source} says {first} ({first_vars}) but {other.source} says {other} "
                                   f"({other_vars}): the environment mixes two launchers; unset one of them, or pass "
                                   "rank= and world_size=")
    return first


def dist_timeout(timeout_s: float | None = None, environ: Mapping[str, str] | None = None) -> float:
    """Seconds a rendezvous or collective may take: ``timeout_s``, else ``YIRAGE_DIST_TIMEOUT``, else the default."""
    env = os.environ if environ is None else environ
    raw: Any = timeout_s
    where = "timeout_s"
    if raw is None:
        raw, where = env.get("YIRAGE_DIST_TIMEOUT", "").strip() or DEFAULT_TIMEOUT_S, "YIRAGE_DIST_TIMEOUT"
    try:
        value = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise DistributedError(f"{where}={raw!r} is not a positive number of seconds; pass e.g. "
                               f"{DEFAULT_TIMEOUT_S:g} (how long a rank waits for the others before it gives up)")
    return value


def collective_name(backend: Any) -> str:
    """The torch.distributed backend a yirage Backend (or backend name) moves its tensors with."""
    from yirage.backend.base import Backend

    if isinstance(backend, str):
        from yirage.backend.selection import registry

        backend = registry().get(backend)
    if not isinstance(backend, Backend):
        raise DistributedError(f"init_world needs a yirage Backend or a backend name, got {type(backend).__name__}; "
                               "pass e.g. 'cpu'")
    name = backend.collective_backend()
    if name is None:
        raise DistributedError(f"backend {backend.name!r} cannot run multi-rank: its collective_backend() is None "
                               "(it names no torch.distributed backend for its device); use a backend that does "
                               "(the CPU backend uses gloo), or run with one rank")
    if not isinstance(name, str) or not name:
        raise DistributedError(f"backend {backend.name!r}: collective_backend() returned {name!r}, not a "
                               "torch.distributed backend name such as 'gloo' or 'nccl' (a bug in the plugin)")
    return name


def require_collective(name: str) -> None:
    """Raise, naming what to install, when torch.distributed cannot run the ``name`` backend here."""
    import torch.distributed as dist

    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed; install a standard torch wheel "
                               "(pip install torch)")
    if name in PROVIDERS and name not in dist.Backend.backend_list:
        try:
            importlib.import_module(PROVIDERS[name])  # the vendor package registers its backend on import
        except ImportError as exc:
            raise DistributedError(f"the collective backend {name!r} comes from the {PROVIDERS[name]!r} package, "
                                   f"which is not installed ({exc}); install the vendor's {PROVIDERS[name]} "
                                   "for this torch version") from exc
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
    if name in available:
        ok = available[name]()
    else:
        ok = name in dist.Backend.backend_list
    if not ok:
        need = BUILTIN_HINTS.get(name) or f"the package that registers {name!r} with torch.distributed"
        raise DistributedError(f"torch {_torch_version()} cannot run the collective backend {name!r} here; install "
                               f"{need}")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@dataclass
class _Group:
    world: World
    collective: str
    timeout_s: float
    store: Any  # the rendezvous store, kept for finding dead ranks after a failed collective
    calls: int = 0  # collectives issued so far: the same sequence on every rank
    broken: str = ""  # a collective abandoned while pending (Ctrl-C): the group cannot be used any more


_GROUP: _Group | None = None


def current_group() -> _Group:
    """The state init_world set up, or an error saying to call it."""
    if _GROUP is None:
        raise DistributedError("no process group: call yirage.distributed.init_world(backend) on every rank before "
                               "a collective")
    return _GROUP


def init_world(backend: Any, *, world: World | None = None, timeout_s: float | None = None,
               environ: Mapping[str, str] | None = None) -> World:
    """Join the process group (torch.distributed) of this run; returns this process's World.

    ``backend``: the yirage Backend (or its name) whose ``collective_backend()`` moves the tensors.
    ``world``: default ``resolve_world()`` (torchrun / mpirun environment). ``timeout_s``: bounds the
    rendezvous and every collective (default ``YIRAGE_DIST_TIMEOUT``, else 300 s).
    """
    global _GROUP
    from datetime import timedelta

    import torch.distributed as dist

    env = os.environ if environ is None else environ
    world = resolve_world(environ=env) if world is None else world
    collective = collective_name(backend)
    timeout = dist_timeout(timeout_s, env)
    if _GROUP is not None:
        if (_GROUP.world.rank, _GROUP.world.world_size, _GROUP.collective) == (world.rank, world.world_size,
                                                                                collective):
            return _GROUP.world
        raise DistributedError(f"init_world was already called as {_GROUP.world} on {_GROUP.collective}; now asked "
                               f"for {world} on {collective}: call shutdown_world() first")
    if dist.is_available() and dist.is_initialized():
        raise DistributedError("torch.distributed is already initialized outside yirage; let init_world create the "
                               "process group (call torch.distributed.destroy_process_group() first)")
    require_collective(collective)
    if world.world_size == 1:
        store = dist.HashStore()  # nothing to meet: a group of one still runs the same collectives
    else:
        if not world.master_addr or world.master_port is None:
            missing = "MASTER_ADDR" if not world.master_addr else "MASTER_PORT"
            raise DistributedError(f"{world} ({world.source}) needs {missing} to find its peers; set MASTER_ADDR to "
                                   "rank 0's host and MASTER_PORT to a free port on it, identical on every rank "
                                   "(torchrun sets both; with mpirun pass -x MASTER_ADDR=... -x MASTER_PORT=...)")
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent already serves the store
        try:
            store = dist.TCPStore(world.master_addr, world.master_port, world.world_size,
                                  is_master=world.rank == 0 and not agent, timeout=timedelta(seconds=timeout),
                                  wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise DistributedError(f"{world} could not reach the rendezvous store at {world.master_addr}:"
                                   f"{world.master_port} within {timeout:g} s ({type(exc).__name__}: {exc}); check "
                                   "that rank 0 runs, that the address is reachable and the port free (raise "
                                   "YIRAGE_DIST_TIMEOUT if ranks start far apart)") from exc
        if agent:  # as torch's env:// rendezvous does: keys of a restarted attempt must not meet the old ones
            store = dist.PrefixStore(f"/worker/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    try:
        dist.init_process_group(collective, store=store, rank=world.rank, world_size=world.world_size,
                                timeout=timedelta(seconds=timeout))
    except (RuntimeError, OSError, ValueError) as exc:
        raise DistributedError(f"{world} could not join the {collective} process group within {timeout:g} s "
                               f"({type(exc).__name__}: {exc}); every rank must start and call init_world (raise "
                               "YIRAGE_DIST_TIMEOUT if some ranks start late)") from exc
    _GROUP = _Group(world, collective, timeout, dist.PrefixStore("yirage", store))
    atexit.register(shutdown_world)  # a process group left to interpreter teardown can abort the process (gloo)
    return world


def shutdown_world() -> None:
    """Leave the process group (a no-op when init_world was not called)."""
    global _GROUP
    import torch.distributed as dist

    if _GROUP is not None and dist.is_initialized():
        # after a collective abandoned on Ctrl-C it is still pending: destroying the group would wait for it until
        # the timeout (measured: the full 60 s), and aborting a gloo group hangs the same way; the run is over,
        # so such a group is left to the process's exit
        if not _GROUP.broken:
            dist.destroy_process_group()
    _GROUP = None
    atexit.unregister(shutdown_world)
