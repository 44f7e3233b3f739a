"""The built-in backends probe and describe this machine truthfully.

Oracles: pyopencl and psutil asked directly, and the platform itself. Tests that need an
OpenCL device skip with the reason when there is none (no PoCL or GPU driver), and the
not-available messages are checked only where the platform says the device is missing.
"""

from __future__ import annotations

import platform

import psutil
import pytest

from yirage import system
from yirage.backend.registry import Registry
from yirage.errors import BackendUnavailableError


@pytest.fixture(scope="module")
def reg() -> Registry:
    return Registry(environ={})


def test_reference_is_always_available(reg) -> None:
    assert reg.get("reference").availability().ok


def test_cpu_backend_matches_numba_and_the_host(reg) -> None:
    numba = pytest.importorskip("numba")
    avail = reg.get("cpu").availability()
    assert avail.ok and numba.__version__ in avail.reason
    info = reg.get("cpu").device_info()
    assert info.kind == "cpu" and info.compute_units == psutil.cpu_count(logical=False)
    assert info.extra["numba"] == numba.__version__
    assert info.caches == system.cpu_caches()


def test_simd_width_follows_the_cpu_flags() -> None:
    flags = system.cpu_flags()
    expected = 512 if "avx512f" in flags else 256 if "avx2" in flags else None
    if expected is None:
        pytest.skip("no x86 AVX flags on this CPU")
    assert system.simd_bits() == expected


def test_cpu_caches_are_read_from_sysfs() -> None:
    caches = system.cpu_caches()
    if platform.system() != "Linux":
        pytest.skip("sysfs caches are Linux-only")
    from pathlib import Path

    l1d = Path("/sys/devices/system/cpu/cpu0/cache/index0/size").read_text().strip()
    assert caches["L1d"] == int(l1d.rstrip("K")) * 1024


def _opencl_devices():
    """pyopencl and every device it reports, or skip: without an ICD (PoCL, a GPU driver) there is nothing to check."""
    cl = pytest.importorskip("pyopencl", reason="pyopencl is not installed")
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        pytest.skip(f"no OpenCL platform (install PoCL: pip install pocl-binary-distribution): {exc}")
    devices = []
    for p in platforms:
        try:
            devices.extend(p.get_devices())
        except cl.Error:
            continue  # a platform without devices, as the backend treats it
    if not devices:
        pytest.skip(f"OpenCL platforms ({', '.join(p.name for p in platforms)}) expose no device")
    return cl, devices


def test_opencl_describes_the_device_pyopencl_reports(reg) -> None:
    cl, devices = _opencl_devices()
    backend = reg.get("opencl")
    assert backend.availability().ok
    assert backend.device_count() == len(devices)
    info = backend.device_info(0)
    match = next(d for d in devices if d.name.strip() == info.name)
    assert info.compute_units == match.max_compute_units
    assert info.memory_bytes == match.global_mem_size
    assert info.extra["fp16"] == ("cl_khr_fp16" in match.extensions)
    with pytest.raises(IndexError, match="out of range"):
        backend.device_info(len(devices))


def test_opencl_on_host_cpu_only_is_not_chosen_by_auto(reg) -> None:
    cl, devices = _opencl_devices()
    only_cpu = all(d.type & cl.device_type.CPU for d in devices)
    avail = reg.get("opencl").availability()
    assert avail.auto is (not only_cpu)
    if only_cpu:
        assert "host-CPU" in avail.reason and reg.get("opencl").device_kind == "cpu"


def test_mps_says_why_off_apple_silicon(reg) -> None:
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        pytest.skip("this is Apple silicon")
    avail = reg.get("mps").availability()
    assert not avail.ok and "macOS on Apple silicon" in avail.reason and platform.system() in avail.reason


def test_cuda_says_why_with_a_cpu_only_torch(reg) -> None:
    import torch

    if torch.version.cuda:
        pytest.skip("torch is a CUDA build here")
    avail = reg.get("cuda").availability()
    assert not avail.ok and "CPU-only build" in avail.reason and torch.__version__ in avail.reason


def test_every_backend_answers_with_a_sentence(reg) -> None:
    for backend in reg.backends():
        avail = backend.availability()
        assert len(avail.reason) > 10, backend.name
        if not avail.ok:
            with pytest.raises(BackendUnavailableError, match=f"backend {backend.name!r} is unavailable"):
                backend.require_available()


def test_opencl_memory_adds_up(reg) -> None:
    _opencl_devices()
    mem = reg.get("opencl").memory_info()
    if mem.free is not None:
        assert mem.used + mem.free == mem.total and 0 <= mem.free <= mem.total


def test_reset_reprobes_opencl(reg, monkeypatch) -> None:
    import yirage_backend_opencl as ocl

    _opencl_devices()
    backend = reg.get("opencl")
    assert backend.availability().ok
    monkeypatch.setattr(ocl, "_devices", _fake_devices([]))
    backend.forget_probe()
    assert not backend.availability().ok
    monkeypatch.undo()
    backend.forget_probe()
    assert backend.availability().ok


class _FakeDevice:
    def __init__(self, cl, kind: str, name: str) -> None:
        self.type = getattr(cl.device_type, kind)
        self.name = name
        self.vendor = "Fake GPUs Inc"
        self.platform = type("P", (), {"name": "Fake platform"})()
        self.max_compute_units = 96
        self.global_mem_size = 24 << 30
        self.local_mem_size = 64 << 10
        self.global_mem_cache_size = 4 << 20
        self.preferred_vector_width_float = 1
        self.version = "OpenCL 3.0"
        self.driver_version = "1.0"
        self.max_work_group_size = 1024
        self.extensions = "cl_khr_fp16"


def _fake_devices(devices):
    def fake():
        return devices, "" if devices else "no OpenCL platform (faked)"

    fake.cache_clear = lambda: None
    return fake


def test_opencl_gpu_is_eligible_for_auto(reg, monkeypatch) -> None:
    import yirage_backend_opencl as ocl

    cl = pytest.importorskip("pyopencl", reason="pyopencl is not installed")  # the devices are faked: no ICD needed
    gpu = _FakeDevice(cl, "GPU", "Fake RX 9000")
    monkeypatch.setattr(ocl, "_devices", _fake_devices([gpu, _FakeDevice(cl, "CPU", "host")]))
    backend = ocl.OpenCLBackend()
    avail = backend.availability()
    assert avail.ok and avail.auto and "Fake RX 9000" in avail.reason
    assert backend.device_kind == "gpu"
    info = backend.device_info(0)
    assert info.kind == "gpu" and info.compute_units == 96 and info.extra["fp16"] is True
    assert backend.memory_info(0).free is None  # core OpenCL cannot tell free GPU memory
