"""The CPU backend: kernels generated as numba source, parallel over cores.

Only ``probe`` imports numba, so ``import yirage`` stays light.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yirage
from yirage.backend.host import host_device_info, host_memory_info
from yirage.backend.probes import distribution_version, module_installed
from yirage.backend.runtime_contract import PERSISTENT, PersistentRuntime

YIRAGE_PLUGIN_API = 1


class CPUBackend(yirage.Backend):
    name = "cpu"
    priority = 20
    vendor = "host"
    torch_device = "cpu"
    device_kind = "cpu"
    description = "numba-generated kernels (parallel=True, OpenMP threading layer) on the host CPU"

    def probe(self) -> yirage.Availability:
        if not module_installed("numba"):
            return yirage.Availability(
                False, "numba is not installed: pip install numba (or the yirage-backend-cpu distribution)"
            )
        try:
            numba = importlib.import_module("numba")
        except ImportError as exc:  # e.g. a numpy release numba does not support yet
            return yirage.Availability(False, f"numba is installed but does not import: {exc}")
        from yirage_backend_cpu.threads import prepare

        layer = prepare()
        info = host_device_info()
        return yirage.Availability(
            True, f"numba {numba.__version__} on {info.compute_units} cores of {info.name} (threading layer: {layer})"
        )

    def device_info(self, index: int = 0) -> yirage.DeviceInfo:
        import numba

        return host_device_info(
            numba=distribution_version("numba"),
            numba_threads=numba.config.NUMBA_NUM_THREADS,
            threading_layer_preference=numba.config.THREADING_LAYER,
        )

    def memory_info(self, index: int = 0) -> yirage.MemoryInfo:
        return host_memory_info()

    kernel_dtypes = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64"})
    persistent_weight_formats = frozenset({"float32", "bfloat16", "float16", "q8_0", "q4_0"})
    persistent_kind = PERSISTENT  # worker and scheduler threads (pk_runtime)

    def check_process(self) -> None:
        """A child forked after the parent ran OpenMP-parallel kernels (numba's and torch's threads) cannot run
        them again: ForkError with the fixes (threads.py), before torch's prefill would hang in the child."""
        from yirage_backend_cpu.threads import check_fork

        check_fork()

    def persistent_runtime(self, program: Any, config: Any) -> PersistentRuntime:
        from yirage_backend_cpu.pk_runtime import CPUPersistentRuntime

        self.require_available()
        return CPUPersistentRuntime(program, config)

    def persistent_task_bodies(self) -> Any:
        """pk_tasks' kinds: the runtime's own, the screened LM head included (a model then builds it)."""
        from yirage_backend_cpu.pk_tasks import TASKS

        return TASKS

    def prompt_linear(self) -> Any:
        """The prompt's projections over Q8_0 / Q4_0 blocks through the decode's group kernels (prompt_linear.py)."""
        from yirage_backend_cpu.prompt_linear import prompt_linear

        return prompt_linear()

    def prepare_decode(self, kv_dtype: Any = None) -> None:
        """On a cold numba cache, a child process starts compiling the decode loop, its task dispatcher and the
        attention now (pk_runtime.ahead), while the engine loads the model, builds its tokenizer and runs the
        prefill."""
        from yirage_backend_cpu.pk_runtime import compile_ahead_for

        compile_ahead_for(kv_dtype)

    def collective_backend(self) -> str | None:
        """Ranks of a tensor-parallel run exchange host memory: gloo (yirage.distributed)."""
        return "gloo"

    def default_config(self, device: yirage.DeviceInfo) -> dict[str, int]:
        """One thread per physical core; workers release tasks themselves on small machines; two tasks per
        projection and thread.

        A dedicated scheduler thread costs a core that would otherwise stream
        weights: on 2 cores it halves decode speed (benchmark/llm_decode.py
        prints the sweep), so dedicated schedulers start at 8 cores. Each task
        pays for its own normalization / activation of x and a cold start of
        its weight stream: on 2 cores, 16 tasks per projection measured 1.39x
        slower than 4 for Q4_0 on the 30-layer W6 model (4.54 against 3.27
        ms/token) and 1.07x for float32 (17.2 against 16.1); W4 ran best at 4-8.
        """
        cores = max(1, device.compute_units or 1)
        schedulers = cores // 8
        return {"num_workers": cores - schedulers, "num_local_schedulers": schedulers, "tasks_per_layer": 2 * cores}

    # -- compile stages (yirage_backend_cpu.compile), cached by the core's compile_cached --
    def compile(self, plan: Any, graph: Any) -> Any:
        from yirage_backend_cpu.compile import compile_plan
        from yirage_backend_cpu.threads import adaptive_threads

        self.require_available()
        return adaptive_threads(compile_plan(self, plan), self.applied_threads())

    def schedule_knobs(self, plan: Any) -> list[Any]:
        """The matmul strategies and parallel decisions a measured search may overturn (knobs.py)."""
        from yirage_backend_cpu.knobs import schedule_knobs

        return schedule_knobs(plan)

    def applied_threads(self) -> int | None:
        """The ``threads`` of the configuration ``yirage_backend_manager.py optimize --backend cpu --apply`` saved for
        this device (kernel graphs then run on that many numba threads); None: numba's default."""
        from yirage.autoconfig import saved_for
        from yirage.backend.base import checked_device_info

        saved = saved_for(self, checked_device_info(self, 0))
        setting = None if saved is None else saved.settings.get("threads")
        return None if setting is None or setting.value is None else int(setting.value)

    def render(self, plan: Any) -> str:
        from yirage_backend_cpu.compile import render

        return render(plan, self.fingerprint())

    def build(self, source: str, workdir: Path) -> Path:
        from yirage_backend_cpu.compile import build

        return build(source, workdir)

    def load(self, artifact: Any) -> Any:
        from yirage_backend_cpu.compile import load

        return load(artifact)

    def fingerprint(self) -> str:
        """The distribution's version and a hash of every source file of the backend."""
        from yirage_backend_cpu.sources import backend_fingerprint

        return f"{distribution_version('yirage-backend-cpu') or 'source'}+{backend_fingerprint()}"

    def target(self) -> str:
        """numba's thread count is baked into the generated source (chunking, prange sizes)."""
        from yirage_backend_cpu.codegen import threads

        return f"numba-threads={threads()}"


@yirage.hookimpl
def yirage_backends() -> list[type[yirage.Backend]]:
    return [CPUBackend]
