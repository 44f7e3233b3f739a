"""benchmark/multi_backend_benchmark.py: a fast smoke run of main() on the cpu backend with tiny sizes (JSON schema,
finite figures, ratios = peer median / yirage median, a valid PNG), its workloads against torch formulas written
here in float64, and its clear errors for bad input. No wall-clock figure is asserted."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import yirage as yr

BENCHMARK_DIR = Path(__file__).resolve().parents[1] / "benchmark"
sys.path.insert(0, str(BENCHMARK_DIR))
import multi_backend_benchmark as mbb  # noqa: E402 - lives in benchmark/, a scripts folder, not a package

SHAPE = mbb.Shape(2, 8, 128)  # two heads for attention, a batch of two; one shape, so the kernels compile once
TINY = ["--backends", "cpu", "--iterations", "2", "--batch-sizes", "2", "--seq-lengths", "8", "--hidden-sizes", "128"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_main(tmp_path: Path):
    """main(argv) with torch's thread count and RNG restored afterwards; returns the JSON it wrote."""
    def run(*extra: str) -> dict:
        out = tmp_path / "r.json"
        threads = torch.get_num_threads()
        try:
            with torch.random.fork_rng():
                assert mbb.main([*TINY, "--output", str(out), *extra]) == 0
        finally:
            torch.set_num_threads(threads)
        return json.loads(out.read_text())
    return run


def check_ratios(doc: dict, peers: dict[str, str]) -> None:
    """Every yirage figure is finite and its ratios are the peer's median over its own, case by case."""
    for r in doc["results"]:
        assert r["error"] is None, r  # each impl passed its check against torch before it was timed
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("median_us", "p10_us", "p90_us")), r
        assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
        if r["backend"] is None:
            continue
        for key, peer in peers.items():
            (p,) = [x for x in doc["results"] if x["workload"] == r["workload"] and x["case"] == r["case"]
                    and x["impl"] == peer]
            assert r[key] == pytest.approx(p["median_us"] / r["median_us"], rel=1e-9)


def test_a_tiny_run_writes_the_json_schema_and_a_png(run_main, tmp_path: Path) -> None:
    png = tmp_path / "r.png"
    doc = run_main("--no-compile", "--plot", str(png))
    assert doc["schema"] == 1 and doc["tie_below"] == 1.15
    assert doc["backends"]["run"] == ["cpu"]
    skipped = doc["backends"]["skipped"]
    for name in (b.value for b in yr.BackendType if not yr.is_backend_available(b.value)):
        assert skipped[name] == yr.get_backend_info(name)["reason"]
    assert {r["workload"] for r in doc["results"]} == set(mbb.WORKLOADS)
    assert {r["impl"] for r in doc["results"]} == {"yirage[cpu]", "torch eager"}
    assert {(r["batch"], r["seq"], r["hidden"], r["case"]) for r in doc["results"]} == {(2, 8, 128, "B=2 S=8 H=128")}
    check_ratios(doc, {"vs_eager": "torch eager"})
    assert all(r["vs_compile"] is None for r in doc["results"])
    for workload, per_backend in doc["summary"].items():
        (row,) = [r for r in doc["results"] if r["workload"] == workload and r["backend"] == "cpu"]
        assert per_backend["cpu"]["vs_eager"] == pytest.approx(row["vs_eager"])  # a geometric mean of one
    assert doc["config"]["iterations"] == 2 and doc["config"]["dtype"] == "float32"
    loads = [doc["config"]["other_cpu_cores"], *(r["other_cpu_cores"] for r in doc["results"])]
    assert all(x is None or x >= 0 for x in loads)
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_torch_compile_is_the_second_peer(run_main) -> None:
    doc = run_main("--workloads", "matmul")  # torch.compile of a lone matmul compiles in a fraction of a second
    assert {r["impl"] for r in doc["results"]} == {"yirage[cpu]", "torch eager", "torch.compile"}
    check_ratios(doc, {"vs_eager": "torch eager", "vs_compile": "torch.compile"})


def gelu64(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def oracle(workload: str, ins: list[torch.Tensor]) -> torch.Tensor:
    """Each workload written out in float64 from its definition in the script's docstring."""
    x = [t.double() for t in ins]
    if workload == "matmul":
        return x[0] @ x[1]
    if workload == "rmsnorm_linear":
        h, gain, w = x
        return h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6) * gain @ w
    if workload == "gated_mlp":
        h, wg, wu, wd = x
        gate = h @ wg
        return (gate / (1 + torch.exp(-gate)) * (h @ wu)) @ wd
    if workload == "attention":
        q, k_t, v = x[:3]
        scores = q @ k_t / math.sqrt(q.shape[-1])
        seq = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), -math.inf)
        return torch.softmax(scores, -1) @ v
    a, bias, b, r = x
    return gelu64(a + bias) * b + r


@pytest.mark.parametrize("workload", list(mbb.WORKLOADS))
def test_each_workload_is_what_it_says_in_yirage_and_in_torch(workload: str) -> None:
    torch.manual_seed(1)
    spec = mbb.WORKLOADS[workload]
    ins = spec.inputs(SHAPE)
    want = oracle(workload, ins)
    g = yr.new_kernel_graph(backend="cpu")
    spec.build(g, SHAPE, yr.float32)
    (got,) = g(inputs=ins)
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(spec.torch_fn(*ins).double(), want, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize(("argv", "words"), [
    (["--backends", "nosuch"], ["--backends nosuch", "no such backend", "registered ones", "cpu"]),
    (["--iterations", "0"], ["--iterations", "0 is not positive", ">= 1"]),
    (["--iterations", "-3"], ["--iterations", "-3 is not positive", ">= 1"]),
    (["--batch-sizes", "two"], ["--batch-sizes", "'two' is not a whole number"]),
    (["--hidden-sizes", "100"], ["--hidden-sizes 100", "multiple of 64", "e.g. 128"]),
    (["--seq-lengths", "100000", "--hidden-sizes", "64"], ["elements", "choose smaller sizes"]),
    (["--dtype", "float8"], ["--dtype", "invalid choice", "float16"]),
    (["--output", "/nonexistent-dir/r.json"], ["--output", "does not exist", "create it first"]),
    (["--plot", "chart.txt"], ["--plot chart.txt", "must end with .png"]),
])
def test_bad_input_is_an_argparse_error_naming_cause_and_fix(argv: list[str], words: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        mbb.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def test_an_unavailable_backend_alone_says_why_and_what_can_run(capsys) -> None:
    missing = next((b.value for b in yr.BackendType if not yr.is_backend_available(b.value)), None)
    if missing is None:
        pytest.skip("every registered backend is available here")
    with pytest.raises(SystemExit):
        mbb.parse_args(["--backends", missing])
    err = capsys.readouterr().err
    assert yr.get_backend_info(missing)["reason"] in err and "choose among: " in err and "cpu" in err


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit):
        mbb.parse_args(["--plot", "r.png"])
    assert "pip install matplotlib" in capsys.readouterr().err
