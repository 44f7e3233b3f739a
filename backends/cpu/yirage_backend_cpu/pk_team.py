"""One thread team for a whole generation: the steps are separated by a barrier of this runtime's own.

A ``prange`` per step (the first design) ends and starts an OpenMP region
every step, and between regions the OpenMP threads wait the runtime
library's way: on a quiet machine entered from a second host thread, libgomp
let them sleep and every step paid ~250 us to wake them (W4 Q4_0: 0.75
against 0.42 ms per step); entered from the main thread, they spun, and
beside one CPU-bound process the decode slowed 8-19x (llama.cpp: 2-4x). So
the threads enter one region per ``decode`` call and meet between steps at a
barrier that waits like every other wait here (spin, then yield, then sleep:
backoff.py): the last thread to arrive runs the serial section (commit the
picked tokens, advance ``step``, reset the queues) and opens the next step.

A barrier needs every thread of the team running at once. OpenMP gives each
of the ``total`` iterations its own thread, but another threading layer (or
a thread limit) could run two iterations one after the other on one thread,
and the first would wait forever for the second. So the threads first
gather: whoever sees all ``total`` arrive decides "go", whoever waits longer
than GATHER_CYCLES decides "abort" (one compare-and-swap settles it), and on
abort every iteration returns at once and ``decode`` runs the steps with a
region each, as before.
"""

from __future__ import annotations

from numba import njit

from yirage.persistent.control import Ctl
from yirage_backend_cpu.atomics import atomic_add, atomic_cas, atomic_load, cycle_counter
from yirage_backend_cpu.backoff import SLEEP_US, SPIN_CYCLES, YIELD_CYCLES, cpu_relax, os_yield, sleep_us
from yirage_backend_cpu.pk_tasks import OPTS, STOP
from yirage_backend_cpu.sources import tie_caches_to_sources

# flags slots (the control header's spares): how often idle threads yielded / slept in a run
YIELDS, SLEEPS = int(Ctl.SPARE_0), int(Ctl.SPARE_1)
# sync slots: barrier generation, threads arrived, threads entered, the gather's decision, steps done, done flag
GEN, ARRIVED, ENTERED, STATE, STEPS, DONE = range(6)
GATHERING, GO, ABORT = 0, 1, 2
GATHER_CYCLES = 60_000_000  # ~20 ms: far past a thread's start, even on a loaded machine


@njit(inline="always", **OPTS)
def pause(since):  # type: ignore[no-untyped-def]
    """One round of an idle wait that began at cycle ``since`` (0: it begins now): (its start, 0 if this round
    spun, YIELDS if it yielded, SLEEPS if it slept). Scalars only: an array passed in a wait loop costs two
    atomic reference-count updates a round, on a cache line the working threads use too."""
    now = cycle_counter()
    if since == 0:
        return now, 0
    if now - since < SPIN_CYCLES:
        cpu_relax()
        return since, 0
    if now - since < YIELD_CYCLES:
        os_yield()
        return since, YIELDS
    sleep_us(SLEEP_US)
    return since, SLEEPS


@njit(**OPTS)
def begin_step(waits, task_q, ev_q, pending, counts, ctl, eos, max_seq, batch, tokens, tok_cols, step,
               active):  # type: ignore[no-untyped-def]
    """The serial section before a step: which rows still decode (none: 0), and the step's queues reset."""
    alive = 0
    for b in range(batch):
        ok = step[b] + 1 < max_seq
        tok = tokens[b * tok_cols + step[b]]
        for e in eos:
            if tok == e:
                ok = False
        active[b] = ok
        alive += ok
    if alive == 0:
        return 0
    task_q[:] = -1
    ev_q[:] = -1
    counts[:] = 0
    ctl[:] = 0
    for t in range(waits.shape[0]):
        pending[t] = waits[t]
        if waits[t] == 0:
            task_q[ctl[1]] = t
            ctl[1] += 1
    return 1


@njit(**OPTS)
def end_step(sync, flags, batch, tokens, tok_cols, step, picked, active, steps_run):  # type: ignore[no-untyped-def]
    """The serial section after a step: commit each active row's picked token, unless the run was stopped (a
    stopped step is not committed); 1 if it was committed."""
    if atomic_load(flags, STOP) != 0:
        return 0
    for b in range(batch):
        if active[b]:
            tokens[b * tok_cols + step[b] + 1] = picked[b]
            step[b] += 1
    sync[STEPS] += 1
    steps_run[0] += 1
    return 1


@njit(**OPTS)
def gather(sync, total, flags):  # type: ignore[no-untyped-def]
    """Wait until all ``total`` threads of the team run (GO) or give up after GATHER_CYCLES (ABORT)."""
    atomic_add(sync, ENTERED, 1)
    start = cycle_counter()
    since = 0
    while True:
        state = atomic_load(sync, STATE)
        if state != GATHERING:
            return state
        if atomic_load(sync, ENTERED) == total:
            atomic_cas(sync, STATE, GATHERING, GO)
        elif cycle_counter() - start > GATHER_CYCLES:
            atomic_cas(sync, STATE, GATHERING, ABORT)
        else:
            since, counter = pause(since)
            if counter:
                atomic_add(flags, counter, 1)


@njit(**OPTS)
def wait_for_next(sync, gen, flags):  # type: ignore[no-untyped-def]
    """Wait at the barrier until the last thread opened step ``gen + 1`` (or ended the run)."""
    since = 0
    while atomic_load(sync, GEN) == gen:
        since, counter = pause(since)
        if counter:
            atomic_add(flags, counter, 1)


tie_caches_to_sources(globals())  # after every cached function above is defined
