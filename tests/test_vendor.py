"""CUDA-compatible stacks (MetaX, Iluvatar, Hygon) are not mistaken for NVIDIA.

torch.cuda is faked: device names and torch.version.cuda / .hip as each
vendor's torch build reports them.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

import yirage as yr
from yirage.backend.registry import Registry

CUDA_LIKE = ["cuda", "metax", "iluvatar", "hygon"]


@pytest.fixture
def fake_cuda(monkeypatch):
    import yirage_backend_cuda

    def install(names: list[str], cuda: str | None = "12.4", hip: str | None = None,
                nvidia_driver: bool = False) -> Registry:
        monkeypatch.setattr(yirage_backend_cuda, "nvidia_driver_loaded", lambda: nvidia_driver)
        props = [
            SimpleNamespace(name=n, total_memory=(16 + i) << 30, multi_processor_count=80 + i, major=8, minor=0)
            for i, n in enumerate(names)
        ]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(names))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (props[i].total_memory // 4, props[i].total_memory))
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.version, "hip", hip)
        return Registry(environ={})

    return install


def available(reg: Registry) -> set[str]:
    return {n for n in CUDA_LIKE if reg.get(n).availability().ok}


@pytest.mark.parametrize(
    ("names", "cuda", "hip", "expected"),
    [
        (["NVIDIA A100-SXM4-80GB"], "12.4", None, {"cuda"}),
        (["Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090"], "12.4", None, {"cuda"}),
        (["MetaX C500"], "11.6", None, {"metax"}),
        (["Iluvatar BI-V150"], "10.2", None, {"iluvatar"}),
        (["DCU K100_AI"], None, "5.7.24", {"hygon"}),
        (["AMD Instinct MI250X"], None, "6.2", set()),
        (["Mystery Accelerator 9000"], "12.0", None, set()),
        (["DCU K100_AI"], "12.0", None, set()),  # a DCU name without a HIP build is not Hygon's stack
    ],
)
def test_each_cuda_api_device_goes_to_its_vendor(fake_cuda, names, cuda, hip, expected) -> None:
    assert available(fake_cuda(names, cuda=cuda, hip=hip)) == expected


def test_cuda_explains_a_foreign_device(fake_cuda) -> None:
    reg = fake_cuda(["MetaX C500"], cuda="11.6")
    reason = reg.get("cuda").availability().reason
    assert "MetaX C500" in reason and "not recognisably NVIDIA" in reason


@pytest.mark.parametrize("name", ["A100-SXM4-40GB", "H100 PCIe", "GRID A100D-40C"])
def test_unbranded_names_are_nvidia_when_the_nvidia_driver_is_loaded(fake_cuda, name) -> None:
    assert available(fake_cuda([name], nvidia_driver=True)) == {"cuda"}
    without = fake_cuda([name], nvidia_driver=False)
    assert available(without) == set()
    assert "no NVIDIA driver is loaded" in without.get("cuda").availability().reason


def test_cuda_explains_a_rocm_build(fake_cuda) -> None:
    reason = fake_cuda(["DCU K100_AI"], cuda=None, hip="5.7").get("cuda").availability().reason
    assert "ROCm/HIP" in reason


def test_auto_picks_metax_not_cuda_on_a_metax_machine(fake_cuda, isolated_selection) -> None:
    isolated_selection(fake_cuda(["MetaX C500", "MetaX C500"], cuda="11.6"))
    assert yr.set_backend("auto") == "metax"
    info = yr.get_backend_info()
    assert info["vendor"] == "MetaX" and info["device"]["name"] == "MetaX C500"
    assert info["device_count"] == 2 and info["device"]["compute_units"] == 80
    assert info["memory"] == {"total": 16 << 30, "used": 12 << 30, "free": 4 << 30, "source": "torch.cuda.mem_get_info"}
    with pytest.raises(yr.BackendUnavailableError, match="not recognisably NVIDIA"):
        yr.set_backend("cuda")


def test_auto_prefers_nvidia_cuda_when_it_is_there(fake_cuda, isolated_selection) -> None:
    isolated_selection(fake_cuda(["NVIDIA H100 80GB HBM3"]))
    assert yr.set_backend("auto") == "cuda"
    assert yr.get_backend_info()["device"]["compute_units"] == 80


def test_mixed_machine_keeps_each_vendor_to_its_own_devices(fake_cuda) -> None:
    reg = fake_cuda(["Iluvatar BI-V150", "NVIDIA A10"])
    assert available(reg) == {"cuda", "iluvatar"}
    assert reg.get("cuda").device_count() == 1
    assert reg.get("cuda").device_info(0).extra["torch_index"] == 1


def test_torch_adapter_backends_use_their_registered_device_module(monkeypatch) -> None:
    """A faked torch_npu registers torch.npu, as the real adapter does."""
    fake_npu = SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 8,
        get_device_name=lambda i: "Ascend910B",
        get_device_properties=lambda i: SimpleNamespace(name="Ascend910B", total_memory=64 << 30, cube_core_num=24),
        mem_get_info=lambda i: (60 << 30, 64 << 30),
    )
    adapter = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", adapter)
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    reg = Registry(environ={})
    ascend = reg.get("ascend")
    assert ascend.availability().ok and "Ascend910B" in ascend.availability().reason
    assert "; kernels: " in ascend.availability().reason  # which compiler path: tests/test_domestic_paths.py
    assert ascend.kernel_path().path in ("triton", "torch") and ascend.kernel_path().settled
    assert ascend.device_count() == 8
    assert ascend.device_info().compute_units == 24
    assert ascend.memory_info().free == 60 << 30
    assert not reg.get("cambricon").availability().ok


def test_adapter_backends_name_the_missing_package() -> None:
    reg = Registry(environ={})
    for name, package in (("ascend", "torch_npu"), ("cambricon", "torch_mlu"), ("moore", "torch_musa")):
        avail = reg.get(name).availability()
        if avail.ok:
            continue
        assert package in avail.reason
