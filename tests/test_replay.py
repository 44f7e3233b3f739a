"""FusedInferEngine (yirage/replay): recorded plans replayed per signature, counted exactly, checked against torch.

Kernel graphs are checked against torch in float64, the tiny Llama's logits
against transformers (tests/llm_oracle.py) position by position. Fused
failures are forced by making the backend's own compile (or build_decoder)
raise, as a real compile error would.
"""

from __future__ import annotations

import logging

import pytest
import torch

import yirage as yr
from yirage.errors import NotSupportedError, UnknownBackendError
from yirage.replay import FusedInferEngine, ReplayError

transformers = pytest.importorskip("transformers")

from llm_oracle import zoo_factory  # noqa: E402 - needs transformers, checked just above

REL_TOL = 1e-3  # as llm_oracle: max |ours - transformers| per row, as a fraction of the row's logit range


@pytest.fixture(autouse=True)
def need_cpu() -> None:
    if not yr.is_backend_available("cpu"):
        pytest.skip("the cpu backend is not available here")


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


@pytest.fixture(scope="module")
def llama(zoo):
    from yirage.engine import load_model

    z = zoo("llama-gqa")
    return z, load_model(z.path)


# -- kernel graphs ---------------------------------------------------------------------------------------------------
class Builder:
    """relu(x @ w) + b for any shapes; counts how often the engine asks for a graph."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> yr.KernelGraph:
        self.calls += 1
        g = yr.new_kernel_graph()
        dt = {torch.float32: yr.float32, torch.float64: yr.float64}[x.dtype]
        xs, ws, bs = (g.new_input(tuple(t.shape), dtype=dt) for t in (x, w, b))
        g.mark_output(g.relu(g.matmul(xs, ws)) + bs)
        return g


def oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.double() @ w.double()) + b.double()


def inputs(rows: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=dtype) for shape in ((rows, 8), (8, 6), (rows, 6)))


def close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> bool:
    return ours.shape == ref.shape and float((ours.double() - ref.double()).abs().max()) <= tol


def counters(stats: dict) -> dict:
    names = ("enabled", "cache_size", "cache_hits", "cache_misses", "recordings", "fusion_attempts",
             "fusion_successes", "fusion_fallbacks")
    return {k: stats[k] for k in names}


class Clock:
    """A fake ``time.perf_counter`` for the replay engine: each read ticks 1 s; ``advance`` adds more."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_graph_stats_match_a_sequence_of_shapes_and_fusion_toggles(monkeypatch) -> None:
    """Hits, misses, recordings and fusion counters of a known call sequence, exactly; the times too, on a fake
    clock: each graph build (a miss's recording) takes 100 s, each clock read ticks 1 s, so planning_seconds is
    101 s per miss and compute_seconds 1 s per call (swapped, overwritten or unit-scaled times fail)."""
    clock = Clock()
    monkeypatch.setattr("yirage.replay.engine.time", clock)

    class TimedBuilder(Builder):
        def __call__(self, *args: torch.Tensor) -> yr.KernelGraph:
            clock.advance(100.0)
            return super().__call__(*args)

    builder = TimedBuilder()
    engine = FusedInferEngine(builder, backend="cpu", warmup_iterations=2)
    small, big, wide = inputs(2, 0), inputs(4, 1), inputs(2, 2, torch.float64)
    calls = [small, small, big]  # miss (records), hit, miss (records)
    for args in calls:
        assert close(engine(*args)[0], oracle(*args))
    engine.set_fusion_enabled(False)
    for args in (small, small):  # a new key (fusion off): miss, then hit; eager, nothing recorded
        assert close(engine(*args)[0], oracle(*args))
    engine.set_fusion_enabled(True)
    for args in (big, wide):  # the fused big entry is still there (hit); float64 is a new signature (miss)
        assert close(engine(*args)[0], oracle(*args))
    stats = engine.get_stats()
    assert counters(stats) == {"enabled": True, "cache_size": 4, "cache_hits": 3, "cache_misses": 4,
                               "recordings": 3, "fusion_attempts": 3, "fusion_successes": 3, "fusion_fallbacks": 0}
    assert builder.calls == 4  # once per miss, never on a hit
    modes = stats["fusion_modes"]
    assert stats["cached_shapes"] == list(modes)
    shapes = [(key.split()[0], key.endswith("fusion on"), mode) for key, mode in modes.items()]
    assert shapes == [("in0[2,8]:float32", True, "fusion"), ("in0[4,8]:float32", True, "fusion"),
                      ("in0[2,8]:float32", False, "eager"), ("in0[2,8]:float64", True, "fusion")]
    assert all("(cpu)" in key for key in modes)  # the backend is part of the key
    assert stats["planning_seconds"] == 4 * 101.0 and stats["compute_seconds"] == 7 * 1.0
    assert stats["fallback_reasons"] == {}


def test_replayed_outputs_belong_to_the_caller_and_any_layout_is_copied_in() -> None:
    engine = FusedInferEngine(Builder(), backend="cpu")
    x, w, b = inputs(2, 3)
    first = engine(x, w, b)[0]
    expected_first = oracle(x, w, b)
    x2 = torch.randn(8, 2, generator=torch.Generator().manual_seed(4)).t()  # same signature, not contiguous
    second = engine([x2, w, b])[0]  # a list works too
    assert close(second, oracle(x2, w, b))
    assert close(first, expected_first)  # the second call did not overwrite what the first returned
    x.zero_()  # the caller's tensors are copied in, not kept
    assert close(first, expected_first)
    assert engine.get_stats()["cache_hits"] == 1


def test_a_failing_fused_compile_falls_back_counted_logged_and_correct(monkeypatch, caplog) -> None:
    from yirage.backend.selection import registry

    def broken(plan, graph):
        raise NotSupportedError("deliberately broken fused compile (test)")

    monkeypatch.setattr(registry().get("cpu"), "compile", broken)
    engine = FusedInferEngine(Builder(), backend="cpu", warmup_iterations=0)
    args = inputs(3, 5)
    with caplog.at_level(logging.WARNING, logger="yirage.replay"):
        out = engine(*args)[0]
        again = engine(*args)[0]
    assert close(out, oracle(*args)) and close(again, oracle(*args))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "yirage.replay"]
    assert len(warnings) == 1  # logged once, when the entry was recorded
    assert "deliberately broken fused compile" in warnings[0].getMessage()
    assert "graph_replay" in warnings[0].getMessage()
    stats = engine.get_stats()
    assert counters(stats) == {"enabled": True, "cache_size": 1, "cache_hits": 1, "cache_misses": 1,
                               "recordings": 1, "fusion_attempts": 1, "fusion_successes": 0, "fusion_fallbacks": 1}
    assert list(stats["fusion_modes"].values()) == ["graph_replay"]
    assert "deliberately broken" in next(iter(stats["fallback_reasons"].values()))
    strict = FusedInferEngine(Builder(), backend="cpu", fallback=False)
    with pytest.raises(NotSupportedError, match="deliberately broken"):
        strict(*args)


class StandInDeviceGraphs:
    """A backend's ``capture`` as a device graph behaves: replay re-runs the recorded call on the captured input
    tensors (whatever they hold now) and writes the same output tensors; no call of the executable in between."""

    def __init__(self, fail: Exception | None = None, bad_status: list | None = None) -> None:
        self.captures, self.replays, self.checks, self.fail = 0, 0, 0, fail
        self.bad_status = bad_status if bad_status is not None else []

    def __call__(self, executable, inputs):
        if self.fail is not None:
            raise self.fail
        self.captures += 1
        recorded = list(inputs)
        outputs = [o.clone() for o in executable(recorded)]  # capture: one uncaptured run, outputs kept

        outer = self

        class Graph:
            def replay(self):
                outer.replays += 1
                for kept, new in zip(outputs, executable(recorded), strict=True):
                    kept.copy_(new)
                return outputs

            def check_status(self):
                outer.checks += 1
                if outer.bad_status:
                    raise outer.bad_status.pop()

        return Graph()


def test_device_graphs_are_captured_once_per_signature_and_replayed_on_hits(monkeypatch, caplog) -> None:
    from yirage.backend.selection import registry

    graphs = StandInDeviceGraphs()
    monkeypatch.setattr(registry().get("cpu"), "capture", graphs)
    engine = FusedInferEngine(Builder(), backend="cpu", warmup_iterations=0)
    results = []
    for rows, seed in ((2, 1), (2, 2), (3, 3), (2, 4)):
        args = inputs(rows, seed)
        results.append((engine(*args)[0], oracle(*args)))
    for ours, ref in results:  # every call's data, replayed from the buffers; earlier results not overwritten
        assert close(ours, ref)
    assert (graphs.captures, graphs.replays, graphs.checks) == (2, 4, 4)
    stats = engine.get_stats()
    assert stats["device_graphs"] == stats["cached_shapes"] and len(stats["device_graphs"]) == 2
    assert set(stats["fusion_modes"].values()) == {"fusion"} and stats["capture_fallbacks"] == 0
    graphs.bad_status.append(IndexError("stand-in: an id out of range at flat position 1"))
    with pytest.raises(IndexError, match="position 1"):  # a replay's recorded bad input raises from that call
        engine(*inputs(2, 5))
    assert close(engine(*inputs(2, 6))[0], oracle(*inputs(2, 6)))
    off = FusedInferEngine(Builder(), backend="cpu", device_graphs=False)
    assert close(off(*inputs(2, 7))[0], oracle(*inputs(2, 7)))
    assert graphs.captures == 2 and off.get_stats()["device_graphs"] == []


def test_a_failing_capture_runs_the_fused_plan_uncaptured_logged_and_counted(monkeypatch, caplog) -> None:
    from yirage.backend.selection import registry
    from yirage.errors import PluginError

    cpu = registry().get("cpu")
    monkeypatch.setattr(cpu, "capture", StandInDeviceGraphs(fail=RuntimeError("stand-in capture error")))
    engine = FusedInferEngine(Builder(), backend="cpu")
    args = inputs(2, 8)
    with caplog.at_level(logging.WARNING, logger="yirage.replay"):
        assert close(engine(*args)[0], oracle(*args)) and close(engine(*args)[0], oracle(*args))
    warnings = [r.getMessage() for r in caplog.records if r.name == "yirage.replay" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stand-in capture error" in warnings[0] and "uncaptured" in warnings[0]
    stats = engine.get_stats()
    assert (stats["capture_fallbacks"], stats["fusion_fallbacks"], stats["fusion_successes"]) == (1, 0, 1)
    assert list(stats["fusion_modes"].values()) == ["fusion"] and stats["device_graphs"] == []
    assert "stand-in capture error" in next(iter(stats["fallback_reasons"].values()))
    with pytest.raises(RuntimeError, match="stand-in capture error"):
        FusedInferEngine(Builder(), backend="cpu", fallback=False)(*args)
    monkeypatch.setattr(cpu, "capture", lambda executable, inputs: object())  # a plugin bug: no replay()
    with pytest.raises(PluginError, match=r"capture\(\) returned object without replay\(\) and check_status"):
        FusedInferEngine(Builder(), backend="cpu", fallback=False)(*args)
    with pytest.raises(ReplayError, match="device_graphs applies to a kernel-graph target"):
        FusedInferEngine("no/such/model", device_graphs=True)


def test_clear_cache_drops_entries_and_resets_the_stats() -> None:
    builder = Builder()
    engine = FusedInferEngine(builder, backend="cpu")
    args = inputs(2, 6)
    engine(*args)
    engine(*args)
    engine.clear_cache()
    stats = engine.get_stats()
    assert counters(stats) == {"enabled": True, "cache_size": 0, "cache_hits": 0, "cache_misses": 0,
                               "recordings": 0, "fusion_attempts": 0, "fusion_successes": 0, "fusion_fallbacks": 0}
    assert stats["cached_shapes"] == [] and stats["planning_seconds"] == 0 and stats["compute_seconds"] == 0
    assert close(engine(*args)[0], oracle(*args))  # recorded again
    assert builder.calls == 2 and engine.get_stats()["cache_misses"] == 1


# -- a tiny Llama --------------------------------------------------------------------------------------------------
def hf_logits(z, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return z.oracle(ids).logits.float()


def assert_logits(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    for row in range(ref.shape[0]):
        for t in range(ref.shape[1]):
            r = ref[row, t].double()
            err = float((ours[row, t].double() - r).abs().max())
            assert err <= REL_TOL * float(r.max() - r.min()), f"{what}: row {row} position {t}: max |err| {err:.3g}"


def prompt(rows: int, length: int, vocab: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_model_prefill_and_decode_steps_match_transformers_with_exact_stats(llama) -> None:
    z, model = llama
    engine = FusedInferEngine(model, backend="cpu", max_seq_len=32)
    ids = prompt(2, 5, model.config.vocab)
    assert_logits(engine.forward(ids), hf_logits(z, ids), "prefill")
    seq = ids
    fusion_plan = []
    for step in range(5):  # fused, fused, eager (fusion off), fused again: one sequence through one KV cache
        if step == 3:
            engine.set_fusion_enabled(False)
        if step == 4:
            engine.set_fusion_enabled(True)
        nxt = hf_logits(z, seq)[:, -1].argmax(-1, keepdim=True)
        pos = torch.full((2, 1), seq.shape[1])
        out = engine.forward(input_ids=nxt, pos=pos)
        seq = torch.cat([seq, nxt], dim=1)
        assert_logits(out, hf_logits(z, seq)[:, -1:], f"decode step {step}")
        fusion_plan.append(engine.fusion_enabled)
    stats = engine.get_stats()
    assert counters(stats) == {"enabled": True, "cache_size": 3, "cache_hits": 3, "cache_misses": 3,
                               "recordings": 1, "fusion_attempts": 1, "fusion_successes": 1, "fusion_fallbacks": 0}
    assert list(stats["fusion_modes"].values()) == ["eager", "fusion", "eager"]  # prefill, decode, decode (off)
    assert [k.split(" on ")[0] for k in stats["cached_shapes"]] == [
        "input_ids[2,5]:int64 positions[2,5]:int64", "input_ids[2,1]:int64 positions[2,1]:int64",
        "input_ids[2,1]:int64 positions[2,1]:int64"]
    assert model.k_cache == []  # the wrapped model's own caches are untouched: each bucket has its own


def test_batch_buckets_bound_the_compiled_entries_and_return_the_real_rows(llama) -> None:
    z, model = llama
    engine = FusedInferEngine(model, backend="cpu", batch_buckets=(2, 4), max_seq_len=16, warmup_iterations=0)
    ids = prompt(4, 6, model.config.vocab, seed=8)
    ref = hf_logits(z, ids)
    nxt = ref[:, -1].argmax(-1, keepdim=True)
    ref_step = hf_logits(z, torch.cat([ids, nxt], dim=1))[:, -1:]
    for rows in (1, 2, 3, 4):
        assert_logits(engine.forward(ids[:rows]), ref[:rows], f"prefill of {rows} rows")
        out = engine.forward(nxt[:rows], torch.full((rows, 1), ids.shape[1], dtype=torch.int32))
        assert_logits(out, ref_step[:rows], f"decode of {rows} rows")
    stats = engine.get_stats()
    assert stats["cache_size"] == 4 and stats["recordings"] == 2 and stats["cache_hits"] == 4
    assert sorted(k.split()[0] for k, m in stats["fusion_modes"].items() if m == "fusion") == [
        "input_ids[2,1]:int64", "input_ids[4,1]:int64"]
    with pytest.raises(ReplayError, match="larger than the largest of batch_buckets"):
        engine.forward(prompt(5, 1, model.config.vocab))


def test_a_failing_decoder_build_falls_back_to_torch_logged_and_correct(llama, monkeypatch, caplog) -> None:
    from yirage.models.llama import LlamaModel

    def broken(self, *args, **kwargs):
        raise NotSupportedError("deliberately broken decoder build (test)")

    monkeypatch.setattr(LlamaModel, "build_decoder", broken)
    z, model = llama
    engine = FusedInferEngine(model, backend="cpu", max_seq_len=16)
    ids = prompt(1, 4, model.config.vocab, seed=9)
    engine.forward(ids)
    nxt = hf_logits(z, ids)[:, -1].argmax(-1, keepdim=True)
    with caplog.at_level(logging.WARNING, logger="yirage.replay"):
        out = engine.forward(nxt, torch.tensor([[4]]))
    assert_logits(out, hf_logits(z, torch.cat([ids, nxt], 1))[:, -1:], "fallback decode")
    assert any("deliberately broken decoder build" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
    stats = engine.get_stats()
    assert (stats["fusion_attempts"], stats["fusion_successes"], stats["fusion_fallbacks"], stats["recordings"]) \
        == (1, 0, 1, 0)
    assert list(stats["fusion_modes"].values()) == ["eager", "eager"]


def test_an_infer_engine_is_wrapped_with_its_backend_and_left_untouched(llama) -> None:
    from yirage.engine import InferEngine

    z, _ = llama
    infer = InferEngine(z.path, backend="cpu")
    engine = FusedInferEngine(infer, max_seq_len=8, enable_fusion=False)
    assert engine.backend.name == "cpu" and not engine.fusion_enabled
    ids = prompt(1, 3, infer.config.vocab)
    assert_logits(engine(ids), hf_logits(z, ids), "prefill through a wrapped InferEngine")
    assert infer.model.k_cache == []


# -- bad input -------------------------------------------------------------------------------------------------------
def test_bad_settings_are_refused_with_the_cause() -> None:
    with pytest.raises(ReplayError, match="warmup_iterations must be an int >= 0"):
        FusedInferEngine(Builder(), backend="cpu", warmup_iterations=-1)
    with pytest.raises(ReplayError, match="enable_fusion must be True or False"):
        FusedInferEngine(Builder(), backend="cpu", enable_fusion="yes")
    with pytest.raises(UnknownBackendError, match="no_such_backend"):
        FusedInferEngine(Builder(), backend="no_such_backend")
    with pytest.raises(ReplayError, match="batch_buckets only apply to a model target"):
        FusedInferEngine(Builder(), backend="cpu", batch_buckets=(1, 2))
    with pytest.raises(ReplayError, match="wraps an InferEngine"):
        FusedInferEngine(42)
    engine = FusedInferEngine(Builder(), backend="cpu")
    with pytest.raises(ReplayError, match="set_fusion_enabled"):
        engine.set_fusion_enabled(1)


def test_bad_graph_calls_are_refused_before_anything_is_recorded() -> None:
    g = Builder()(*inputs(2, 0))
    engine = FusedInferEngine(g, backend="cpu")
    x, w, b = inputs(2, 0)
    with pytest.raises(ReplayError, match=r"input 0 is \[2, 8\] float64, but the wrapped KernelGraph declares"):
        engine(x.double(), w, b)
    with pytest.raises(ReplayError, match=r"input 0 is \[3, 8\] float32.*wrap a graph builder"):
        engine(torch.randn(3, 8), w, b)
    with pytest.raises(ReplayError, match="2 tensor"):
        engine(x, w)
    with pytest.raises(ReplayError, match="meta tensor"):
        engine(x.to("meta"), w, b)
    with pytest.raises(ReplayError, match="must be a torch.Tensor"):
        engine(x.tolist(), w, b)
    assert engine.get_stats()["cache_misses"] == 0
    bad_builder = FusedInferEngine(lambda *t: "not a graph", backend="cpu")
    with pytest.raises(ReplayError, match="not a KernelGraph"):
        bad_builder(x, w, b)


def test_bad_model_calls_are_refused_with_the_cause(llama) -> None:
    _, model = llama
    with pytest.raises(ReplayError, match="strictly increasing"):
        FusedInferEngine(model, backend="cpu", batch_buckets=(4, 2))
    with pytest.raises(ReplayError, match="num_workers must be an int >= 1"):  # not a "failed fused build"
        FusedInferEngine(model, backend="cpu", num_workers=0)
    with pytest.raises(ReplayError, match="max_seq_len must be an int >= 1"):
        FusedInferEngine(model, backend="cpu", max_seq_len=0)
    with pytest.raises(ReplayError, match="dtype= applies when the engine loads a model path"):
        FusedInferEngine(model, backend="cpu", dtype="float16")
    engine = FusedInferEngine(model, backend="cpu", max_seq_len=8)
    vocab = model.config.vocab
    with pytest.raises(ReplayError, match="int32/int64 tensor of token ids"):
        engine.forward(torch.zeros(1, 2))
    with pytest.raises(ReplayError, match=r"unsqueeze\(0\)"):
        engine.forward(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ReplayError, match="vocab_size"):
        engine.forward(torch.full((1, 2), vocab))
    with pytest.raises(ReplayError, match="max_seq_len=8"):
        engine.forward(torch.zeros(1, 1, dtype=torch.int64), torch.tensor([[8]]))
    with pytest.raises(ReplayError, match="positions must be a"):
        engine.forward(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0, 1]))
    with pytest.raises(ReplayError, match="twice"):
        engine.forward(torch.zeros(1, 1, dtype=torch.int64), torch.tensor([[0]]), pos=torch.tensor([[0]]))
    assert engine.get_stats()["cache_misses"] == 0
