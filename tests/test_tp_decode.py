"""Tensor-parallel fused decode: PersistentKernel(world_size=2) on the CPU runtime, ranks on gloo.

Oracles: transformers' greedy decode and the single-rank PersistentKernel on the same weights (tokens equal),
ReferenceTP (the plain-torch tensor-parallel step: logits within tolerance at every step). Two ranks run as
subprocesses with torchrun's environment (tests/test_distributed.py's launcher), each under a hard timeout, so
a hang or a crash fails the test instead of killing the run. The tiny model: 4 query heads over 2 KV heads,
vocab 97 (odd: rank 1's vocabulary shard is short and padded in the all-gather). bf16 and Q4_0 weights, GGUF
files, seeded sampling, EOS stops and three ranks: tests/test_tp_coverage.py.
"""

from __future__ import annotations

import pytest
import torch

from yirage.distributed import DistributedError
from yirage.distributed.sharding import ShardError
from yirage.models.llama import LlamaModel

transformers = pytest.importorskip("transformers")
from llm_oracle import REL_TOL  # noqa: E402
from test_distributed import NEW_TOKENS, PROMPT, SEED, TINY, run_ranks, saved  # noqa: E402, F401 - saved: fixture

TP_DECODE = """
from yirage.distributed.tp_model import TPModel
out = sys.argv[2]
init_world("cpu", timeout_s=60)
ids = torch.load(sys.argv[3])
n = int(sys.argv[4])
b, t = ids.shape
result = {}
for dtype in (None, "q8_0"):
    shard = load_shard(sys.argv[1], 2, rank, dtype)
    model = TPModel(shard)
    model.reset_cache(b, t + n + 1)
    logits = model.forward(ids, torch.arange(t).expand(b, t), last_only=True)[:, -1]
    tokens = torch.zeros(b, t + n + 1, dtype=torch.int64)
    step = torch.zeros(b, dtype=torch.int64)
    tokens[:, :t] = ids
    tokens[:, t] = logits.argmax(-1)
    step.fill_(t)
    pk = model.build_decoder(step, tokens, backend="cpu", num_workers=1, num_local_schedulers=0)
    fused = [logits]
    for _ in range(n - 1):  # one step per call: the logits each token was picked from, gathered from both ranks
        assert pk(1) == 1
        fused.append(pk.read("logits"))
    ref_tokens, ref_logits = ReferenceTP(load_shard(sys.argv[1], 2, rank, dtype)).generate(ids, n)
    result[str(dtype)] = (tokens[:, t:t + n].clone(), torch.stack(fused, 1), ref_tokens, ref_logits,
                          pk.runtime.last_comm)
from yirage.engine import GenerationConfig, InferEngine
engine = InferEngine(sys.argv[1], backend="cpu", tp=2)  # the group joined above is reused
result["engine"] = engine.generate(ids, GenerationConfig(max_new_tokens=n, eos_token_id=())).tokens
if rank == 0:
    torch.save(result, out)
"""


def greedy_single_rank_pk(path, dtype, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The single-rank PersistentKernel's greedy tokens on the CPU backend (prefill in torch, then fused)."""
    model = LlamaModel.from_pretrained(path, dtype)
    b, t = ids.shape
    model.reset_cache(b, t + n + 1)
    logits = model.forward(ids, torch.arange(t).expand(b, t), last_only=True)[:, -1]
    tokens = torch.zeros(b, t + n + 1, dtype=torch.int64)
    tokens[:, :t], tokens[:, t] = ids, logits.argmax(-1)
    step = torch.full((b,), t, dtype=torch.int64)
    pk = model.build_decoder(step, tokens, backend="cpu", num_workers=1, num_local_schedulers=0)
    assert pk(n - 1) == n - 1
    return tokens[:, t:t + n]


def test_two_ranks_fused_decode_equals_transformers_single_rank_and_reference(saved, tmp_path) -> None:  # noqa: F811
    ids = torch.randint(0, TINY["vocab_size"], PROMPT, generator=torch.Generator().manual_seed(SEED))
    torch.save(ids, tmp_path / "ids.pt")
    runs = run_ranks(TP_DECODE, [str(saved["f32"]), str(tmp_path / "out.pt"), str(tmp_path / "ids.pt"),
                                 str(NEW_TOKENS)], timeout=240)
    for rank, (code, _, stderr) in enumerate(runs):
        assert code == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
    result = torch.load(tmp_path / "out.pt")
    oracle = transformers.LlamaForCausalLM.from_pretrained(saved["f32"]).eval()
    with torch.no_grad():
        want = oracle.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[:, PROMPT[1]:]
    assert len(set(want.flatten().tolist())) >= 6  # diverse output: equal tokens mean something
    for dtype in (None, "q8_0"):
        tokens, fused, ref_tokens, ref_logits, comm = result[str(dtype)]
        assert torch.equal(tokens, ref_tokens), dtype
        scale = (ref_logits.amax(-1) - ref_logits.amin(-1))[..., None]
        # every step, both shards of the row. Float weights: the same products as the reference, summed in another
        # order. Q8_0: the kernels scale each block's sum once (d * sum(q * x)) where the reference multiplies the
        # dequantized weights (sum((d * q) * x)): other roundings, within the decode tests' REL_TOL of transformers
        # (1.0e-4 of the range was seen on an Intel Emerald Rapids pair of cores, under 1e-4 on an AMD EPYC)
        tolerance = 1e-4 if dtype is None else REL_TOL
        assert ((fused - ref_logits).abs() / scale).max() < tolerance, dtype
        assert torch.equal(tokens, greedy_single_rank_pk(saved["f32"], dtype, ids, NEW_TOKENS)), dtype
        assert comm["calls"] == 2 * TINY["num_hidden_layers"] + 1  # per step: 2 all-reduces a layer, 1 gather
    assert torch.equal(result["None"][0], want)
    assert torch.equal(result["engine"], want)  # InferEngine(tp=2): prefill by ReferenceTP, then the fused decode


def test_a_multi_rank_kernel_needs_the_process_group_of_its_rank() -> None:
    import yirage as yr
    from yirage.errors import NotSupportedError
    from yirage.persistent.layers import LayerError

    meta = [torch.zeros(1, dtype=torch.int64), torch.zeros(1, 8, dtype=torch.int64)]
    with pytest.raises(LayerError, match=r"needs the process group: call yirage\.distributed\.init_world"):
        yr.PersistentKernel(world_size=2, mpi_rank=1, max_seq_length=8, meta_tensors=meta, backend="cpu")
    with pytest.raises(LayerError, match=r"mpi_rank=2\): ranks are 0 \.\. 1"):
        yr.PersistentKernel(world_size=2, mpi_rank=2, max_seq_length=8, meta_tensors=meta, backend="cpu")
    with pytest.raises(NotSupportedError, match="remote schedulers are not supported"):
        yr.PersistentKernel(num_remote_schedulers=1, max_seq_length=8, meta_tensors=meta, backend="cpu")
    pk = yr.PersistentKernel(max_seq_length=8, meta_tensors=meta, backend="cpu")
    x, y = pk.attach_input(torch.zeros(1, 4), "x"), pk.new_tensor((1, 4), name="y")
    with pytest.raises(LayerError, match="allreduce_layer: this kernel is rank 0 of 1, but there is no process "
                                         "group"):
        pk.allreduce_layer(x, y, label="layer 0 o_proj all-reduce")


def test_kv_heads_that_do_not_divide_are_refused_before_any_rendezvous(tmp_path, monkeypatch) -> None:
    from yirage.engine import InferEngine

    torch.manual_seed(SEED)
    cfg = {**TINY, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96, "intermediate_size": 192}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(tmp_path,
                                                                                   safe_serialization=True)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "9"}.items():  # nothing listens on port 9: a rendezvous would fail otherwise
        monkeypatch.setenv(key, value)
    with pytest.raises(ShardError, match=r"num_key_value_heads=3 is not a multiple of 2.*Valid world sizes for it: "
                                         r"1, 3"):
        InferEngine(tmp_path, backend="cpu", tp=2)
    with pytest.raises(DistributedError, match=r"tp=3, but this process is rank 0 of 2 \(torchrun\)"):
        InferEngine(tmp_path, backend="cpu", tp=3)


FAULT = """
import signal, threading
import yirage.distributed.collectives as collectives
from yirage.distributed.tp_model import TPModel
mode = sys.argv[2]
init_world("cpu", timeout_s=float(sys.argv[3]))
real = collectives.all_reduce_
calls = 0
def all_reduce_(tensor, label, timeout_s=None, stop=None):
    global calls
    if label == "layer 1 o_proj all-reduce":
        calls += 1
    if rank == 1 and calls == 2:  # the second decode step, inside the fused decode
        if mode == "die":
            os._exit(3)
        print("stalling", flush=True)
        time.sleep(60)
    return real(tensor, label, timeout_s, stop)
collectives.all_reduce_ = all_reduce_  # pk_comm looks it up when the decoder is built
model = TPModel(load_shard(sys.argv[1], 2, rank))
ids = torch.tensor([[1, 2, 3]])
model.reset_cache(1, 12)
model.forward(ids, torch.arange(3)[None])
tokens = torch.zeros(1, 12, dtype=torch.int64)
tokens[:, :3] = ids
step = torch.full((1,), 3, dtype=torch.int64)
pk = model.build_decoder(step, tokens, backend="cpu", num_workers=1, num_local_schedulers=0)
if rank == 0 and mode == "stall":  # Ctrl-C while this rank waits for rank 1 in a collective
    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
started = time.monotonic()
try:
    pk(6)
except DistributedError as exc:
    print(f"ERROR after {time.monotonic() - started:.1f} s: {exc}")
    sys.exit(1)
except KeyboardInterrupt:
    print(f"INTERRUPTED after {time.monotonic() - started:.1f} s, steps {int(step[0]) - 3}")
    sys.exit(2)
print("no error")
"""


def test_a_rank_killed_mid_decode_ends_the_other_with_the_error_naming_rank_and_layer(saved) -> None:  # noqa: F811
    runs = run_ranks(FAULT, [str(saved["f32"]), "die", "3"], timeout=120, until=0)
    code, stdout, stderr = runs[0]
    assert code == 1, f"rank 0 did not fail cleanly:\n{stdout}\n{stderr[-3000:]}"
    message = stdout.split("ERROR after", 1)[1]
    assert "rank 0 of 2: layer 1 o_proj all-reduce failed" in message and "rank 1 did not answer" in message
    assert float(message.split(" s:", 1)[0]) < 20  # a 3 s timeout plus the grace period, not a hang
    assert runs[1][0] == 3


def test_ctrl_c_stops_a_rank_waiting_on_a_collective_within_a_slice(saved) -> None:  # noqa: F811
    """Rank 1 stalls before the collective; rank 0, waiting for it (timeout 60 s), gets SIGINT after 3 s."""
    runs = run_ranks(FAULT, [str(saved["f32"]), "stall", "60"], timeout=120, until=0)
    code, stdout, stderr = runs[0]
    assert code == 2, f"rank 0 was not interrupted:\n{stdout}\n{stderr[-3000:]}"
    seconds, steps = stdout.split("INTERRUPTED after", 1)[1].split(" s, steps ")
    assert float(seconds) < 10 and int(steps) == 1  # stopped long before the timeout; step 2 not committed
