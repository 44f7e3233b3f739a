"""benchmark/grid_barrier.py: its CUDA source compiles (NVRTC + ptxas, no GPU needed) and it says so where there is
no GPU; the timing itself runs in make gpu-check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import grid_barrier  # noqa: E402


def test_the_barrier_kernels_compile_for_sm80_and_sm90() -> None:
    cuda = pytest.importorskip("yirage_backend_cuda")
    try:
        cuda.nvrtc.toolchain()
    except cuda.ToolchainError as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    report = cuda.compile_check({"grid_barrier": grid_barrier.source()}, ("sm_80", "sm_90"),
                                options=cuda.BUILD_OPTIONS)
    assert report.ok and report.compiled == 2, report.summary() + "".join(
        f"\n{f.arch}: {f.message[:2000]}" for f in report.failures)


def test_without_a_gpu_it_times_nothing_and_says_why(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: make gpu-check times it")
    assert grid_barrier.main([]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out
