"""The cpu backend's measured choice between its prompt tiles and torch's projection (prompt_rows.py): the faster
side wins on a fake clock, once per (kind, shape, threads, row bucket); choices are kept across processes, a
damaged file is timed again, a timing under load is not kept; YIRAGE_CPU_PROMPT_TILES's modes; PromptLinear obeys
the choice; and an engine's prefill in the default (measured) mode still matches transformers."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import pytest
import torch

import yirage as yr
from yirage.quant import quantize

pytest.importorskip("numba")
if not yr.is_backend_available("cpu"):
    pytest.skip("the cpu backend is not available", allow_module_level=True)

from yirage_backend_cpu import bf16_dot  # noqa: E402
from yirage_backend_cpu import prompt_linear as pl  # noqa: E402
from yirage_backend_cpu import prompt_rows as pr  # noqa: E402

SEED = 20261201


class Stopwatch:
    """A fake clock and two sides whose calls take the seconds given (per call, cycled), counted."""

    def __init__(self, ours: list[float], theirs: list[float]) -> None:
        self.now, self.calls, self.rows = 0.0, {"ours": 0, "theirs": 0}, []
        self.costs = {"ours": ours, "theirs": theirs}

    def clock(self) -> float:
        return self.now

    def side(self, name: str) -> Any:
        def run(x: torch.Tensor) -> None:
            self.rows.append((x.shape, x.dtype))
            costs = self.costs[name]
            self.now += costs[self.calls[name] % len(costs)]
            self.calls[name] += 1
        return run

    def ask(self, measured: pr.Measured, m: int, kind: str = "q8_0", n: int = 64, k: int = 96,
            dtype: torch.dtype = torch.float32) -> bool:
        return measured.tiles(kind, n, k, m, self.side("ours"), self.side("theirs"), dtype)


@pytest.mark.parametrize(("m", "rows"), [(1, 4), (4, 4), (5, 8), (16, 16), (17, 32), (512, 512), (513, 1024)])
def test_prompts_are_timed_at_the_next_power_of_two(m: int, rows: int) -> None:
    assert pr.bucket(m) == rows


@pytest.mark.parametrize(("ours", "theirs", "tiles"), [(1.0, 2.0, True), (2.0, 1.0, False)])
def test_the_faster_side_wins_and_is_timed_once_per_bucket(tmp_path, ours: float, theirs: float,
                                                           tiles: bool) -> None:
    watch = Stopwatch([ours], [theirs])
    measured = pr.Measured(tmp_path / "rows.json", clock=watch.clock, rounds=3)
    assert watch.ask(measured, 5) is tiles
    assert watch.calls == {"ours": 4, "theirs": 4}  # one untimed call each, then 3 rounds
    assert set(watch.rows) == {(torch.Size([8, 96]), torch.float32)}  # rows of the bucket, the caller's K
    assert watch.ask(measured, 8) is tiles and watch.calls["ours"] == 4  # the same bucket: no timing
    watch.ask(measured, 9)
    assert watch.calls["ours"] == 8  # the next bucket is timed apart
    watch.ask(measured, 8, n=72)
    assert watch.calls["ours"] == 12  # so is another shape


def test_the_best_round_counts_not_a_round_slowed_by_another_process(tmp_path) -> None:
    """Tiles 1 s, but 9 s in two of three rounds (a competitor took the core); torch 1.5 s every round: the
    tiles win (their median would lose)."""
    watch = Stopwatch([1.0, 1.0, 9.0, 9.0], [1.5])
    assert watch.ask(pr.Measured(tmp_path / "rows.json", clock=watch.clock, rounds=3), 16) is True


def test_choices_are_kept_for_the_next_process_and_per_thread_count(tmp_path) -> None:
    path = tmp_path / "rows.json"
    first = Stopwatch([2.0], [1.0])
    assert first.ask(pr.Measured(path, clock=first.clock, rounds=3), 64, kind="bf16") is False
    doc = json.loads(path.read_text())
    assert doc["version"] == pr.VERSION and len(doc["choices"]) == 1
    (key, record), = doc["choices"].items()
    assert key.startswith("bf16 64x96 rows<=64 threads=") and record["tiles"] is False
    assert record["tiles_ms"] == 2000.0 and record["torch_ms"] == 1000.0
    assert path.stat().st_mode & 0o077 == 0  # private, as the compile cache

    second = Stopwatch([1.0], [2.0])  # would choose the tiles if it timed anything
    measured = pr.Measured(path, clock=second.clock, rounds=3)
    assert second.ask(measured, 64, kind="bf16") is False and second.calls["ours"] == 0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # the tiles split W's rows over torch's threads: timed again
        assert second.ask(measured, 64, kind="bf16") is True and second.calls["ours"] == 4
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads(path.read_text())["choices"]) == 2  # added to, not replaced


@pytest.mark.parametrize("text", ["{not json", '{"version": 1, "choices": {"q8_0 64x96": {"tiles": "yes"}}}',
                                  '{"version": 999, "choices": {}}', "[]"])
def test_a_damaged_file_is_reported_and_timed_again(tmp_path, caplog, text: str) -> None:
    path = tmp_path / "rows.json"
    path.write_text(text)
    path.chmod(0o600)
    watch = Stopwatch([1.0], [2.0])
    with caplog.at_level(logging.WARNING, logger="yirage.cpu"):
        assert watch.ask(pr.Measured(path, clock=watch.clock, rounds=3), 16) is True
    assert watch.calls["ours"] == 4
    assert any("damaged" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["version"] == pr.VERSION  # rewritten whole


def test_a_timing_under_load_is_used_but_not_kept(tmp_path) -> None:
    path = tmp_path / "rows.json"
    watch = Stopwatch([1.0, 1.0, 3.0, 3.0], [4.0])  # untimed, then rounds 1, 3, 3 s: a competitor came and stayed
    measured = pr.Measured(path, clock=watch.clock, rounds=3)
    assert watch.ask(measured, 16) is True and not path.exists()
    assert watch.ask(measured, 16) is True and watch.calls["ours"] == 4  # this process keeps it


def test_nothing_is_timed_above_the_tiles_cap(tmp_path) -> None:
    watch = Stopwatch([1.0], [2.0])
    assert watch.ask(pr.Measured(tmp_path / "rows.json", clock=watch.clock), pr.CAPS["f32"] + 1, kind="f32") is False
    assert watch.calls == {"ours": 0, "theirs": 0}


def test_the_environment_names_the_policy(monkeypatch) -> None:
    for mode, want in (("fixed", pr.FIXED["q8_0"]), ("always", pr.CAPS["q8_0"]), ("never", 0)):
        monkeypatch.setenv(pr.ENV, mode)
        policy = pr.choice()
        assert isinstance(policy, pr.Fixed)
        assert not policy.tiles("q8_0", 8, 32, want + 1, print, print, None)  # print: never called
        assert want == 0 or policy.tiles("q8_0", 8, 32, want, print, print, None)
    monkeypatch.delenv(pr.ENV)
    assert isinstance(pr.choice(), pr.Measured)  # the default
    monkeypatch.setenv(pr.ENV, "fastest")
    with pytest.raises(pr.PromptRowsError, match="measure, fixed, always, never"):
        pr.choice()


#: kind -> (key prefix, x's dtype, the tiles' tolerance, torch's side's: a bf16 x's product is bf16, 2^-8 relative)
CASES = {"q4_0": ("q4_0 64x96", torch.float32, 1e-3, 1e-5), "bf16 x": ("bf16 x 64x96", torch.bfloat16, 1e-4, 2 ** -8)}


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("kind", list(CASES))
def test_prompt_linear_follows_the_choice_and_times_both_real_sides(tmp_path, kind: str, tiles: bool) -> None:
    """The measured sides are the tiles and torch's projection of the same matrix, on rows of the caller's dtype
    (a Q4_0 matrix under float32 x; a bf16 one under bf16 x, prompt_dtype): each side's real result on the timed
    rows is checked here; the call returns the tiles' product or None (torch's) as the clock decides."""
    name, x_dtype, tol, torch_tol = CASES[kind]
    if x_dtype == torch.bfloat16 and not bf16_dot.native():
        pytest.skip("this CPU has no AVX512-BF16 dot products: no tiles for bf16 x")
    gen = torch.Generator().manual_seed(SEED)
    w = quantize(torch.randn(64, 96, generator=gen), "q4_0") if kind == "q4_0" else \
        torch.randn(64, 96, generator=gen).bfloat16()
    dense = w.dequantize().double() if kind == "q4_0" else w.double()
    x = torch.randn(6, 96, generator=gen).to(x_dtype)
    seen: dict[str, Any] = {}

    class Rigged(pr.Measured):
        def _time(self, key, rows, k, ours, theirs, dtype):  # type: ignore[no-untyped-def]
            probe = torch.randn(rows, k, generator=gen).to(dtype)
            seen.update(key=key, ours=ours(probe), theirs=theirs(probe), probe=probe)
            return {"tiles": tiles, "tiles_ms": 1.0, "torch_ms": 1.0, "spread": 1.0}

    got = pl.PromptLinear(Rigged(tmp_path / "rows.json"))(x, w)
    assert seen["key"].startswith(f"{name} rows<=8 threads=") and seen["probe"].dtype == x_dtype
    want = seen["probe"].double() @ dense.t()
    assert torch.allclose(seen["theirs"].double(), want, rtol=torch_tol, atol=1e-3)  # torch's side
    assert torch.allclose(seen["ours"].double(), want, rtol=tol, atol=tol)  # the tiles (q4_0: x rounded to int16)
    if tiles:
        assert got is not None and got.shape == (6, 64)
        assert torch.allclose(got.double(), x.double() @ dense.t(), rtol=tol, atol=tol)
    else:
        assert got is None


def test_a_prefill_in_the_measured_mode_matches_transformers(tmp_path, monkeypatch) -> None:
    """The default mode end to end: an engine's prefill times each of its projections' shapes (a fresh cache
    here) and its logits match transformers' on the same weights whichever side won."""
    transformers = pytest.importorskip("transformers")
    from yirage.engine import InferEngine

    monkeypatch.delenv(pr.ENV)
    monkeypatch.setenv("YIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pr, "_MEASURED", pr.Measured())  # resolves its file in this test's cache
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "model")
    engine = InferEngine(tmp_path / "model", backend="cpu", dtype=torch.bfloat16)
    for p in hf.parameters():  # transformers on the bf16-rounded weights, float32 compute
        p.data = p.data.bfloat16().float()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(SEED))
    engine.reset_cache(1, 16)
    ours = engine.forward(ids)
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    timed = pr._MEASURED._choices or {}  # this process's (the file keeps those timed without interference)
    assert {key.split(" rows")[0] for key in timed} == {"bf16 128x64", "bf16 64x64", "bf16 256x64", "bf16 64x128"}


def test_a_copying_torch_side_is_not_timed_at_a_few_rows(tmp_path) -> None:
    """Up to 4 rows torch's side of a quantized or 16-bit W widens all of W first: the tiles, untimed; a float32 W
    (read as it is by torch's GEMM) is timed even there."""
    watch = Stopwatch([2.0], [1.0])
    measured = pr.Measured(tmp_path / "rows.json", clock=watch.clock, rounds=3)
    assert all(watch.ask(measured, 4, kind=kind) for kind in pr.COPIES) and watch.calls["ours"] == 0
    assert watch.ask(measured, 5, kind="q4_0") is False and watch.calls["ours"] == 4
    assert watch.ask(measured, 4, kind="f32") is False and watch.calls["ours"] == 8


@pytest.mark.parametrize(("seconds", "rounds"), [(1e-4, pr.ROUNDS[1]), (0.01, 5), (0.2, pr.ROUNDS[0])])
def test_short_calls_get_more_rounds(tmp_path, seconds: float, rounds: int) -> None:
    watch = Stopwatch([seconds], [seconds])
    watch.ask(pr.Measured(tmp_path / "rows.json", clock=watch.clock), 16)
    assert watch.calls == {"ours": 1 + rounds, "theirs": 1 + rounds}


@pytest.mark.parametrize("where", ["unwritable", "shared"])
def test_without_a_usable_cache_choices_stay_in_the_process(tmp_path, monkeypatch, caplog, where: str) -> None:
    """A cache file that cannot be written, or a compile cache others can write (refused by the cache's rules):
    one warning naming the fix, the prompt still runs, and its choices hold for this process."""
    path = tmp_path / "missing" / "rows.json"  # its directory does not exist
    if where == "shared":
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        monkeypatch.setenv("YIRAGE_CACHE_DIR", str(shared))
        path = None
    watch = Stopwatch([1.0], [2.0])
    measured = pr.Measured(path, clock=watch.clock, rounds=3)
    with caplog.at_level(logging.WARNING, logger="yirage.cpu"):
        assert watch.ask(measured, 16) is True and watch.ask(measured, 32) is True
        assert watch.ask(measured, 16) is True and watch.calls["ours"] == 8
    warnings = [r.getMessage() for r in caplog.records if "cannot keep" in r.getMessage()]
    assert len(warnings) == 1 and "YIRAGE_CACHE_DIR" in warnings[0]
    assert not any(tmp_path.rglob("*.json"))


def test_two_threads_asking_at_once_time_a_shape_once(tmp_path) -> None:
    """Two prompts of one shape in two threads: one times it, the other waits for that choice (the lock), and a
    choice already known is answered without timing again."""
    watch = Stopwatch([1.0], [2.0])
    measured = pr.Measured(tmp_path / "rows.json", clock=watch.clock, rounds=3)
    start = threading.Barrier(2)
    answers: list[bool] = []

    def ask() -> None:
        start.wait()
        answers.append(watch.ask(measured, 16))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert answers == [True, True] and watch.calls == {"ours": 4, "theirs": 4}
