"""The cuda megakernel's scheduling protocol, run on the CPU: its grid barrier (or event counters) and step loop,
verbatim, for each ``YIRAGE_CUDA_GRID_SYNC``.

The resident kernel (backends/cuda/yirage_backend_cuda/megakernel.py) is task bodies plus a protocol: a grid-wide
barrier (``y_grid_sync``) after every layer, a step loop every block must leave at the same step, and the host's
stop request copied into the control buffer. A bug in the protocol would only show on a GPU, as a hang or a layer
reading what another block has not written yet. So the protocol's text, exactly as rendered, is compiled here as
C++ with one OS thread per thread block (``threadIdx.x`` 0: the barrier's work is thread 0's), the CUDA atomics and
fences as C++ ones, and every task function replaced by a stub that sleeps a random while and asserts that every
virtual block of the previous layer has completed before it starts. ``begin`` and ``commit`` stubs keep the
control buffer's ALIVE and STEPS slots as the real ones would. The host is x86 (total store order), so this checks
the protocol's logic (counts, generations, resets, who leaves when), not the GPU's weak memory ordering; the
``__threadfence`` on both sides of the barrier is what orders memory there (cooperative groups' pattern).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("yirage_backend_cuda")

from test_cuda_pk_runtime import _program  # noqa: E402
from yirage_backend_cuda import megakernel  # noqa: E402

from yirage.persistent.control import Ctl  # noqa: E402

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++ or clang++) to run the protocol")

EMULATION = r"""
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sched.h>
#include <thread>
#include <tuple>
#include <vector>
struct Dim { unsigned x; };
thread_local Dim blockIdx;
Dim gridDim;
const Dim threadIdx = {0};
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(n)
typedef unsigned short __nv_bfloat16;
typedef unsigned short __half;
static inline void __syncthreads() {}
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline void __nanosleep(unsigned) { sched_yield(); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }

static long long* g_ctl;
static volatile int* g_stop;
static long long g_eos_after, g_stop_at;
static std::atomic<long long> g_done[EPOCHS];
static std::atomic<int> g_bad{0};
thread_local long long t_epoch = 0;
thread_local std::mt19937 t_rng;

static void task(const char* name, long long vg) {
    if (t_epoch >= EPOCHS) { g_bad = 1; return; }
    if (t_epoch > 0 && g_done[t_epoch - 1].load() != EXPECTED[t_epoch - 1]) {
        std::fprintf(stderr, "ORDER: %s (virtual block %lld) of barrier interval %lld started with %lld of %lld "
                     "tasks of the interval before it done\n", name, vg, t_epoch, g_done[t_epoch - 1].load(),
                     EXPECTED[t_epoch - 1]);
        g_bad = 1;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(t_rng() % 50));
    if (vg == 0 && name[2] == 'b' && name[3] == 'e') {  // y_begin: which rows still decode
        g_ctl[ALIVE] = g_ctl[STEPS] < g_eos_after ? 1 : 0;
    }
    if (vg == 0 && name[2] == 'c' && name[3] == 'o') {  // y_commit
        g_ctl[STEPS] += 1;
        if (g_ctl[STEPS] == g_stop_at) *g_stop = 1;  // the host asks to stop during this step
    }
    g_done[t_epoch] += 1;
}
"""


def _protocol_source(mega: megakernel.MegaRendered, expected: list[int], sync: str) -> str:
    """The rendered synchronization and kernel, verbatim, with stub tasks and a driver that runs it on threads.
    Each block's interval advances at each barrier (``flat``, ``tree``), or each time it publishes a phase
    (``events``: ``y_done``, which every block calls once per phase, with work or without)."""
    source = mega.source
    function, text, _ = megakernel.GRID_SYNCS[sync]
    assert text in source, "the synchronization is rendered verbatim"
    kernel = source[source.index('extern "C" __global__'):]
    names = sorted(set(re.findall(r"\b(y_(?:\w+?)_\d+)\(", kernel)) - {"y_grid_sync"})
    hook = function or "y_done"
    signature = "unsigned int* bar" if function else "unsigned int* bar, int n"
    call_ = "bar" if function else "bar, n"
    stubs = "".join(f"template <class... A> void {n}(A... a) {{ auto t = std::make_tuple(a...); "
                    f"task(\"{n}\", (long long)std::get<sizeof...(A) - 2>(t)); }}\n" for n in names)
    params = re.search(r"y_megakernel\((.*?)\) \{", kernel).group(1).split(", ")
    args = []
    for p in params:
        name = p.split()[-1]
        args.append({"ctl": "ctl", "y_bar": "bar", "y_stop": "&stop", "y_limit": "limit"}.get(name, "nullptr"))
    return "\n".join([
        f"#define EPOCHS {len(expected)}", f"#define ALIVE {int(Ctl.ALIVE)}", f"#define STEPS {int(Ctl.STEPS)}",
        f"static const long long EXPECTED[EPOCHS] = {{{', '.join(map(str, expected))}}};",
        EMULATION,
        f"#define {hook} y_rendered_sync", text, f"#undef {hook}",
        f"static void {hook}({signature}) {{ y_rendered_sync({call_}); t_epoch += 1; }}",
        stubs, kernel,
        "int main(int argc, char** argv) {",
        "    unsigned grid = atoi(argv[1]); long long limit = atoll(argv[2]);",
        "    g_eos_after = atoll(argv[3]); g_stop_at = atoll(argv[4]);",
        f"    static long long ctl[64] = {{0}}; static unsigned bar[{mega.bar_words}] = {{0}};",
        "    static volatile int stop = 0;",
        "    stop = atoi(argv[5]); g_ctl = ctl; g_stop = &stop; gridDim.x = grid;",
        "    std::vector<std::thread> blocks; std::vector<long long> epochs(grid);",
        "    for (unsigned b = 0; b < grid; b++) blocks.emplace_back([&, b] {",
        "        blockIdx.x = b; t_rng.seed(b * 7919 + 1);",
        f"        y_megakernel({', '.join(args)});",
        "        epochs[b] = t_epoch; });",
        "    for (auto& t : blocks) t.join();",
        "    for (unsigned b = 1; b < grid; b++) if (epochs[b] != epochs[0]) { std::printf(\"EPOCHS DIFFER\\n\"); "
        "return 3; }",
        "    std::printf(\"steps %lld stop %lld barriers %lld\\n\", ctl[STEPS], ctl[5], epochs[0]);",
        "    return g_bad ? 2 : 0;",
        "}", ""])


def _expected(mega_tasks: list[tuple[int, str]], steps: int) -> list[int]:
    """Tasks (virtual blocks) per barrier interval: the first begin, then each step's phases."""
    first, *step = mega_tasks
    return [first[0]] + [groups for _ in range(steps + 1) for groups, _ in step]


@pytest.fixture(scope="module", params=sorted(megakernel.GRID_SYNCS))
def protocol(tmp_path_factory, request):
    program = _program(sampling=False, dtype="float32")
    mega = megakernel.render_megakernel(program, grid_sync=request.param)
    body = mega.source[mega.source.index("y_megakernel("):]
    phases = [(int(m.group(1)), m.group(2)) for m in
              re.finditer(r"y_vg < (\d+); y_vg \+= gridDim\.x\) \{ (?:if \(threadIdx\.x < \d+\) )?(y_\w+?)\(", body)]
    source = _protocol_source(mega, _expected(phases, 12), request.param)
    exe = tmp_path_factory.mktemp("megakernel-protocol") / "protocol"
    src = exe.with_suffix(".cpp")
    src.write_text(source)
    built = subprocess.run([CXX, "-std=c++17", "-O1", "-pthread", "-w", "-o", str(exe), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    return exe


def _run(exe: Path, grid: int, limit: int, eos_after: int = 1000, stop_at: int = -1, stop: int = 0):
    run = subprocess.run([str(exe), str(grid), str(limit), str(eos_after), str(stop_at), str(stop)],
                         capture_output=True, text=True, timeout=60)
    return run.returncode, run.stdout + run.stderr


@pytest.mark.parametrize("grid", [1, 3, 8])
def test_every_block_meets_every_barrier_and_no_task_starts_before_the_layer_before_it_ends(protocol, grid) -> None:
    code, out = _run(protocol, grid, limit=6)
    assert code == 0 and "steps 6 stop 0" in out, out


def test_the_loop_ends_for_every_block_when_no_row_decodes_or_the_host_asks(protocol) -> None:
    code, out = _run(protocol, 4, limit=10, eos_after=3)
    assert code == 0 and "steps 3 " in out, out  # ALIVE fell to 0 after the third step's begin
    code, out = _run(protocol, 4, limit=10, stop_at=4)
    assert code == 0 and "steps 4 stop 1" in out, out  # the step in flight committed, then every block left
    code, out = _run(protocol, 4, limit=10, stop=1)
    assert code == 0 and "steps 0 stop 1" in out, out  # a request before the launch: no step runs
    code, out = _run(protocol, 4, limit=0)
    assert code == 0 and "steps 0 stop 0" in out, out
