"""Tensor-parallel foundations (yirage/distributed): world resolution, sharded loading, collectives, faults.

Oracles: transformers' greedy decode and the single-rank LlamaModel on the same
weights; ``torch.argmax`` on the full logits for the distributed argmax; the
single-rank LlamaModel's weights for the shards (concatenated back, byte for
byte); the model's dimensions for the bytes each rank holds. Two ranks run as
two subprocesses with torchrun's environment on gloo, each under a hard
timeout, so a hang or crash fails the test instead of killing the run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import yirage as yr
from yirage.backend.base import Backend
from yirage.distributed import DistributedError, World, init_world, resolve_world
from yirage.distributed.sharding import (
    ShardError,
    load_gguf_shard,
    load_shard,
    plan_shards,
    shard_state_dict,
    valid_world_sizes,
)
from yirage.models.config import LlamaConfig
from yirage.models.llama import LlamaModel
from yirage.models.weights import load_weights
from yirage.quant import QuantizedTensor

transformers = pytest.importorskip("transformers")
from llm_oracle import diverse_init  # noqa: E402 - needs transformers, checked just above

ROOT = Path(__file__).resolve().parents[1]
SEED = 14
PROMPT = (2, 5)
NEW_TOKENS = 8
RANK_TIMEOUT = 120  # hard limit per 2-rank run: a hang fails the test
# a tiny GQA Llama: 4 query heads over 2 KV heads; vocab 97 is odd, so the 2-way vocabulary split pads rank 1
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=97, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6)


# -- world resolution ---------------------------------------------------------------------------------------------
def test_world_from_torchrun_env() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert resolve_world(environ=env) == World(1, 2, 1, "10.0.0.1", 29500, "torchrun")


@pytest.mark.parametrize("rank_var,size_var,local_var", [
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
])
def test_world_from_mpirun_env(rank_var: str, size_var: str, local_var: str) -> None:
    env = {rank_var: "3", size_var: "4", local_var: "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    world = resolve_world(environ=env)
    assert (world.rank, world.world_size, world.local_rank, world.master_addr, world.master_port) == (3, 4, 1, "h0",
                                                                                                      1234)


def test_explicit_arguments_win_and_no_launcher_means_one_rank() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2"}
    assert resolve_world(rank=2, world_size=3, environ=env) == World(2, 3, 2, source="explicit")
    assert resolve_world(rank=0, world_size=2, local_rank=0, environ=env).local_rank == 0
    assert resolve_world(environ={}) == World(0, 1, 0)


@pytest.mark.parametrize("env,kwargs,words", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, {}, ["RANK=2", "WORLD_SIZE=2", "0 .. 1"]),
    ({"RANK": "0"}, {}, ["RANK", "WORLD_SIZE", "torchrun"]),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, {}, ["OMPI_COMM_WORLD_RANK"]),
    ({"RANK": "zero", "WORLD_SIZE": "2"}, {}, ["RANK='zero'", "not an integer"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "PMI_RANK": "1", "PMI_SIZE": "2"}, {}, ["torchrun says rank 0", "PMI", "rank 1"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, {}, ["MASTER_PORT='http'"]),
    ({}, {"rank": 1}, ["rank= and world_size="]),
    ({}, {"rank": -1, "world_size": 2}, ["rank=-1", ">= 0"]),
])
def test_inconsistent_env_is_named(env: dict, kwargs: dict, words: list[str]) -> None:
    with pytest.raises(DistributedError) as err:
        resolve_world(environ=env, **kwargs)
    for word in words:
        assert word in str(err.value)


class GlooBackend(Backend):
    name = "gloo-test"

    def collective_backend(self) -> str | None:
        return "gloo"


class NcclBackend(Backend):
    name = "nccl-test"

    def collective_backend(self) -> str | None:
        return "nccl"


class HcclBackend(Backend):
    name = "hccl-test"

    def collective_backend(self) -> str | None:
        return "hccl"


def test_init_world_refuses_bad_setups_before_joining() -> None:
    import torch.distributed as dist

    two = World(0, 2, 0, None, 29500, "torchrun")
    with pytest.raises(DistributedError, match="needs MASTER_ADDR"):
        init_world(GlooBackend(), world=two, environ={})
    with pytest.raises(DistributedError, match=r"cannot run multi-rank: its collective_backend\(\) is None"):
        init_world(type("Plain", (Backend,), {"name": "plain"})(), world=two, environ={})
    assert Backend().collective_backend() is None  # the default: no multi-rank
    if yr.is_backend_available("cpu"):
        from yirage.backend.selection import resolve

        assert resolve("cpu", "test").collective_backend() == "gloo"
    with pytest.raises(DistributedError, match="YIRAGE_DIST_TIMEOUT='soon'"):
        init_world(GlooBackend(), world=two, environ={"YIRAGE_DIST_TIMEOUT": "soon"})
    with pytest.raises(DistributedError, match="timeout_s=-1"):
        init_world(GlooBackend(), world=two, timeout_s=-1, environ={})
    if not dist.is_nccl_available():
        with pytest.raises(DistributedError, match="'nccl'.*CUDA build of torch"):
            init_world(NcclBackend(), world=two, environ={})
    if "hccl" not in dist.Backend.backend_list:
        with pytest.raises(DistributedError, match="torch_npu"):
            init_world(HcclBackend(), world=two, environ={})
    assert not dist.is_initialized()


DECLARED = {"cpu": "gloo", "cuda": "nccl", "ascend": "hccl", "cambricon": "cncl", "moore": "mccl", "hygon": "nccl",
            "metax": "nccl", "iluvatar": "nccl", "opencl": None, "mps": None, "reference": None}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_every_backend_names_its_collective_and_one_missing_here_is_refused_with_its_reason(name: str) -> None:
    """The issue's list (gloo on CPU, NCCL on CUDA, HCCL on Ascend, CNCL on Cambricon, MCCL on Moore Threads; the
    CUDA-compatible stacks serve theirs as nccl); a backend without device collectives keeps None. On this machine
    the accelerators' collectives are absent, and init_world says what to install instead of joining."""
    import torch.distributed as dist

    from yirage.backend.selection import registry

    try:
        backend = registry().get(name)
    except yr.YirageError:
        pytest.skip(f"the {name!r} plugin is not installed here")
    assert backend.collective_backend() == DECLARED[name]
    two = World(0, 2, 0, "127.0.0.1", 29500, "torchrun")
    if DECLARED[name] is None:
        with pytest.raises(DistributedError, match="cannot run multi-rank"):
            init_world(backend, world=two, environ={})
    elif DECLARED[name] not in dist.Backend.backend_list or (DECLARED[name] == "nccl" and not dist.is_nccl_available()):
        with pytest.raises(DistributedError, match=f"'{DECLARED[name]}'.*(CUDA build of torch|torch_npu|torch_mlu|"
                                                   "torch_musa)"):
            init_world(backend, world=two, environ={})
    assert not dist.is_initialized()



def test_a_one_rank_group_runs_the_same_collectives_and_checks_their_inputs() -> None:
    """World size 1 (a HashStore, no network): the collectives are identities, argmax is torch.argmax's."""
    from yirage.distributed import shutdown_world
    from yirage.distributed.collectives import all_gather_rows, all_reduce_, argmax_shards

    init_world(GlooBackend(), world=World(0, 1, 0), environ={})
    try:
        x = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(all_reduce_(x.clone(), "one-rank all-reduce"), x)
        assert torch.equal(all_gather_rows(x, "one-rank all-gather", dim=1), x)
        logits = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 2.0, float("nan")], [float("-inf")] * 3])
        value, index = argmax_shards(logits, 0, "one-rank argmax")
        assert torch.equal(index, torch.argmax(logits, -1)) and index.tolist() == [1, 0, 0]
        with pytest.raises(DistributedError, match="not contiguous.*tensor.contiguous"):
            all_reduce_(x.t(), "layer 3 o_proj all-reduce")
        with pytest.raises(DistributedError, match="label=''"):
            all_reduce_(x, "")
        with pytest.raises(DistributedError, match="float tensor"):
            all_reduce_(torch.ones(3, dtype=torch.int64), "int all-reduce")
        with pytest.raises(DistributedError, match="already called as rank 0 of 1"):
            init_world(GlooBackend(), world=World(0, 2, 0, "127.0.0.1", 1), environ={})
    finally:
        shutdown_world()
    with pytest.raises(DistributedError, match="call yirage.distributed.init_world"):
        all_reduce_(x, "after shutdown")


# -- sharding -----------------------------------------------------------------------------------------------------
def tiny_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(SEED)
    kind = overrides.pop("kind", "llama")
    conf_cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    model_cls = transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM
    return diverse_init(model_cls(conf_cls(**{**TINY, **overrides})).eval(), seed=SEED)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """The tiny model saved as safetensors (float32 and bfloat16) and a tied Qwen2 one (q/k/v biases)."""
    root = tmp_path_factory.mktemp("tp")
    out = {}
    model = tiny_model()
    model.save_pretrained(root / "f32", safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(root / "bf16", safe_serialization=True)
    tiny_model(kind="qwen2", tie_word_embeddings=True).save_pretrained(root / "qwen2", safe_serialization=True)
    for name in ("f32", "bf16", "qwen2"):
        out[name] = root / name
    return out


def raw(t):
    return t.blocks if isinstance(t, QuantizedTensor) else t


def assert_shards_rebuild(full: LlamaModel, shards: list) -> None:
    """Concatenated shards equal the single-rank model's weights exactly (blocks byte for byte)."""
    c = full.config
    cat = lambda ts, dim=0: torch.cat([raw(t) for t in ts], dim)  # noqa: E731
    assert torch.equal(cat([s.lm_head for s in shards]), raw(full.lm_head))
    for s in shards:
        assert torch.equal(raw(s.embed), raw(full.embed)) and torch.equal(s.norm, full.norm)
    for i, blk in enumerate(full.blocks):
        parts = [s.blocks[i] for s in shards]
        assert torch.equal(cat([p["qkv"] for p in parts]), raw(blk["qkv"]))  # per-KV-group order is contiguous
        assert torch.equal(cat([p["o"] for p in parts], 1), raw(blk["o"]))
        assert torch.equal(cat([p["down"] for p in parts], 1), raw(blk["down"]))
        ff = c.intermediate // len(shards)
        gate = cat([p["gate_up"] for p in parts])  # per rank [gate_r | up_r]: regroup to [gate | up]
        regrouped = torch.cat([gate.view(len(shards), 2, ff, -1)[:, j].reshape(c.intermediate, -1) for j in (0, 1)])
        assert torch.equal(regrouped, raw(blk["gate_up"]))
        for key in ("ln1", "ln2"):
            assert all(torch.equal(p[key], blk[key]) for p in parts)
        if "qkv_bias" in blk:
            assert torch.equal(cat([p["qkv_bias"] for p in parts]), blk["qkv_bias"])


@pytest.mark.parametrize("source,dtype", [("f32", None), ("bf16", None), ("f32", "q8_0"), ("f32", "q4_0"),
                                          ("qwen2", None)])
def test_safetensors_shards_concatenate_to_the_full_weights(saved, source: str, dtype) -> None:
    full = LlamaModel.from_pretrained(saved[source], dtype)
    shards = [load_shard(saved[source], 2, r, dtype) for r in range(2)]
    assert_shards_rebuild(full, shards)
    weights = load_weights(saved[source])  # the in-memory path: a state dict already loaded
    assert_shards_rebuild(full, [shard_state_dict(full.config, weights, 2, r, dtype) for r in range(2)])
    assert shards[1].vocab_range == (49, 97)  # P = ceil(97 / 2) = 49: rank 1's shard is one row short


@pytest.mark.parametrize("file_type,dtype", [("F32", None), ("Q8_0", "q8_0"), ("Q4_0", "q4_0"), ("Q8_0", None)])
def test_gguf_shards_concatenate_to_the_full_weights(tmp_path, file_type: str, dtype) -> None:
    from yirage.models.gguf_export import export_gguf

    model = tiny_model()
    path = export_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), file_type)
    full = LlamaModel.from_gguf(path, dtype)
    assert_shards_rebuild(full, [load_gguf_shard(path, 2, r, dtype) for r in range(2)])


def test_a_split_that_does_not_divide_is_refused_with_the_valid_sizes(tmp_path) -> None:
    cfg = LlamaConfig.from_dict(tiny_model().config.to_dict())
    with pytest.raises(ShardError) as err:
        plan_shards(cfg, 4)
    assert "num_key_value_heads=2 is not a multiple of 4" in str(err.value) and "Valid world sizes for it: 1, 2" \
        in str(err.value)
    odd = LlamaConfig.from_dict(tiny_model(intermediate_size=96).config.to_dict())  # 48 per rank: not whole blocks
    assert valid_world_sizes(odd) == [1, 2] and valid_world_sizes(odd, "q8_0") == [1]
    with pytest.raises(ShardError, match=r"down_proj's input columns per rank \(intermediate/N\) = 48 .*q8_0.*: 1$"):
        plan_shards(odd, 2, "q8_0")
    from yirage.models.gguf_export import export_gguf

    model = tiny_model(intermediate_size=96)  # a Q8_0 file read into float: its column slice would split blocks
    path = export_gguf(tmp_path / "odd.gguf", model.config, model.state_dict(), "Q8_0")
    with pytest.raises(ShardError, match="ffn_down.*columns 48..96 do not fall on block boundaries"):
        load_gguf_shard(path, 2, 1)
    with pytest.raises(ShardError, match=r"rank=2 must be an int in \[0, 2\)"):
        load_shard_of(tmp_path, model, 2)


def load_shard_of(tmp_path: Path, model, rank: int):
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return load_shard(tmp_path / "hf", 2, rank)


def expected_bytes(cfg: LlamaConfig, n: int, rank: int, value_bytes: int) -> int:
    """What rank ``rank`` of ``n`` must hold: the replicated embedding and norms, 1/n of every projection, its
    vocabulary rows of the lm_head (from the model's dimensions, not from the code under test)."""
    h, d = cfg.hidden, cfg.head_dim
    per_layer = (cfg.heads + 2 * cfg.kv_heads) * d * h + h * cfg.heads * d + 3 * cfg.intermediate * h
    vocab_rows = min(cfg.vocab, (rank + 1) * -(-cfg.vocab // n)) - rank * -(-cfg.vocab // n)
    replicated = cfg.vocab * h + (2 * cfg.layers + 1) * h
    return value_bytes * (replicated + cfg.layers * per_layer // n + vocab_rows * h)


def test_each_rank_holds_only_its_slices(saved, tmp_path) -> None:
    from yirage.models.gguf_export import export_gguf

    cfg = LlamaConfig.from_dict(tiny_model().config.to_dict())
    path = export_gguf(tmp_path / "m.gguf", tiny_model().config, tiny_model().state_dict(), "F32")
    full = expected_bytes(cfg, 1, 0, 4)
    for rank in range(2):
        for shard, value_bytes in ((load_shard(saved["f32"], 2, rank), 4), (load_shard(saved["bf16"], 2, rank), 2),
                                   (load_gguf_shard(path, 2, rank), 4)):
            assert shard.nbytes_held() == expected_bytes(cfg, 2, rank, value_bytes)
            for t in shard.tensors():  # no slice is a view into a whole tensor read behind it
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert expected_bytes(cfg, 2, 0, 4) < 0.75 * full  # the test model's projections dominate: ~half per rank


RSS_PROBE = """
import gc, sys, psutil, torch
from yirage.distributed.sharding import load_shard
from safetensors import safe_open  # what loading imports and initialises, before the first reading
import yirage.models.llama, yirage.quant
torch.cat([torch.zeros(4, 4)] * 2)[torch.tensor([1, 0])].clone(memory_format=torch.contiguous_format)
proc = psutil.Process()
gc.collect()
before = proc.memory_info().rss
shard = load_shard(sys.argv[1], int(sys.argv[2]), 0)
gc.collect()
print(proc.memory_info().rss - before, shard.nbytes_held())
"""


def test_resident_memory_per_rank_is_about_half(tmp_path) -> None:
    """RSS grown by loading rank 0 of 2 vs of 1, in fresh processes, against the model's dimensions (a 40 MB
    float32 model, so allocator noise of a few MB does not matter)."""
    big = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=2048)
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **big}))
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = LlamaConfig.from_dict(model.config.to_dict())
    del model
    # a fixed mmap threshold: glibc returns freed transients (the slices' copies) instead of keeping them in its heap
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    procs = {n: subprocess.Popen([sys.executable, "-c", RSS_PROBE, str(tmp_path), str(n)], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (1, 2)}
    grown = {}
    for n, p in procs.items():
        stdout, stderr = p.communicate(timeout=RANK_TIMEOUT)
        assert p.returncode == 0, stderr[-3000:]
        rss, held = map(int, stdout.split())
        assert held == expected_bytes(cfg, n, 0, 4)
        assert abs(rss - held) < 0.15 * held, (n, rss, held)  # what the process really holds is the shard
        grown[n] = rss
    assert grown[2] < 0.6 * grown[1]


# -- two ranks on gloo --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_PRELUDE = """
import os, sys, time, torch
import yirage as yr
from yirage.backend.base import Backend
from yirage.distributed import DistributedError, init_world
from yirage.distributed.sharding import load_shard
from yirage.distributed.reference_tp import ReferenceTP
import yirage.distributed.reference_tp as reference_tp
class Gloo(Backend):
    name = "gloo-test"
    def collective_backend(self):
        return "gloo"
rank = int(os.environ["RANK"])
"""


def run_ranks(code: str, args: list[str], n: int = 2, timeout: float = RANK_TIMEOUT,
              until: int | None = None) -> list[tuple[int | None, str, str]]:
    """Run ``code`` as ``n`` ranks with torchrun's environment; (returncode, stdout, stderr) per rank.

    A rank still running at the deadline, or once rank ``until`` has exited, is killed (returncode None).
    """
    port = free_port()
    procs = []
    for rank in range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "MV2_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_PRELUDE + textwrap.dedent(code), *args], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    deadline = time.monotonic() + timeout
    if until is not None:
        try:
            procs[until].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic()  # the rest get no more time
    for p in procs:  # a rank still running at the deadline is killed: returncode None
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, stdout, stderr))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            out.append((None, stdout, stderr))
    return out


DECODE = """
out = sys.argv[2]
init_world(Gloo(), timeout_s=60)
ids = torch.load(sys.argv[3])
result = {}
for dtype in (None, "q8_0"):
    tokens, logits = ReferenceTP(load_shard(sys.argv[1], 2, rank, dtype)).generate(ids, int(sys.argv[4]))
    result[str(dtype)] = (tokens, logits)
# the distributed argmax against torch.argmax on the full (97-wide) logits: ties across the shard boundary, NaNs,
# -inf rows, and a row whose maximum sits in the padded rank
from yirage.distributed.collectives import all_gather_rows, argmax_shards
gen = torch.Generator().manual_seed(5)
full = torch.randint(-3, 3, (6, 97), generator=gen).float()
full[1, 60] = full[1, 10] = 9.0
full[2, 70] = float("nan")
full[3, 20] = float("nan")
full[3, 80] = float("nan")
full[4] = float("-inf")
full[5, 96] = 99.0
start, stop = (0, 49) if rank == 0 else (49, 97)
local = torch.full((6, 49), float("-inf"))
local[:, :stop - start] = full[:, start:stop]
value, index = argmax_shards(local.contiguous(), start, "test argmax", valid=stop - start)
expect = torch.argmax(full, dim=-1)
result["argmax_ok"] = bool(torch.equal(index, expect))
want = full.double().gather(1, expect[:, None])[:, 0]
result["argmax_values_ok"] = bool(torch.allclose(value, want, rtol=0, atol=0, equal_nan=True))
gathered = all_gather_rows(torch.full((2, 3), float(rank)), "test all-gather", dim=1)
result["gather_ok"] = bool(torch.equal(gathered, torch.tensor([[0.0] * 3 + [1.0] * 3] * 2)))
if rank == 0:
    torch.save(result, out)
"""


def greedy_single_rank(model: LlamaModel, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The single-rank LlamaModel's greedy tokens (its torch forward, step by step over the KV cache)."""
    b, t = ids.shape
    model.reset_cache(b, t + n)
    logits = model.forward(ids, torch.arange(t).expand(b, t), last_only=True)
    tokens = []
    for step in range(n):
        tokens.append(torch.argmax(logits[:, -1], -1))
        logits = model.forward(tokens[-1][:, None], torch.full((b, 1), t + step))
    return torch.stack(tokens, 1)


def test_two_ranks_decode_like_transformers_and_one_rank(saved, tmp_path) -> None:
    ids = torch.randint(0, TINY["vocab_size"], PROMPT, generator=torch.Generator().manual_seed(SEED))
    torch.save(ids, tmp_path / "ids.pt")
    runs = run_ranks(DECODE, [str(saved["f32"]), str(tmp_path / "out.pt"), str(tmp_path / "ids.pt"), str(NEW_TOKENS)])
    for rank, (code, _, stderr) in enumerate(runs):
        assert code == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
    result = torch.load(tmp_path / "out.pt")
    assert result["argmax_ok"] and result["argmax_values_ok"] and result["gather_ok"]
    oracle = transformers.LlamaForCausalLM.from_pretrained(saved["f32"]).eval()
    with torch.no_grad():
        ref = oracle.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    want, want_logits = ref.sequences[:, PROMPT[1]:], torch.stack(ref.logits, 1)
    tokens, logits = result["None"]
    assert len(set(want.flatten().tolist())) >= 6  # diverse output: equal tokens mean something
    assert torch.equal(tokens, want)
    assert torch.equal(tokens, greedy_single_rank(LlamaModel.from_pretrained(saved["f32"]), ids, NEW_TOKENS))
    scale = (want_logits.amax(-1) - want_logits.amin(-1))[..., None]
    assert ((logits - want_logits).abs() / scale).max() < 1e-4
    q_tokens, _ = result["q8_0"]
    assert torch.equal(q_tokens, greedy_single_rank(LlamaModel.from_pretrained(saved["f32"], "q8_0"), ids, NEW_TOKENS))


FAULT = """
mode = sys.argv[2]
init_world(Gloo(), timeout_s=3)
real = reference_tp.all_reduce_
def all_reduce_(tensor, label, timeout_s=None):
    if label == "layer 1 o_proj all-reduce" and rank == int(sys.argv[3]):
        if mode == "die":
            os._exit(3)
        time.sleep(60)  # stuck: never reaches the collective
    return real(tensor, label, timeout_s)
reference_tp.all_reduce_ = all_reduce_
started = time.monotonic()
try:
    ReferenceTP(load_shard(sys.argv[1], 2, rank)).generate(torch.tensor([[1, 2, 3]]), 4)
except DistributedError as exc:
    print(f"ERROR after {time.monotonic() - started:.1f} s: {exc}")
    sys.exit(1)
print("no error")
"""


@pytest.mark.parametrize("mode,victim", [("die", 1), ("stall", 1), ("die", 0)])
def test_a_dead_or_stuck_rank_ends_the_other_with_a_clear_error(saved, mode: str, victim: int) -> None:
    runs = run_ranks(FAULT, [str(saved["f32"]), mode, str(victim)], timeout=60, until=1 - victim)
    print(runs[1 - victim][1])
    code, stdout, stderr = runs[1 - victim]
    assert code == 1, f"the surviving rank did not fail cleanly:\n{stdout}\n{stderr[-3000:]}"
    message = stdout.split("ERROR after", 1)[1]
    assert f"rank {1 - victim} of 2: layer 1 o_proj all-reduce" in message
    if victim == 1:
        assert "rank 1 did not answer" in message
        assert ("timed out after 3 s" in message) == (mode == "stall")
    else:  # rank 0 served the rendezvous store: the survivor says so
        assert "rendezvous store" in message and "rank 0" in message
    assert float(message.split(" s:", 1)[0]) < 40  # bounded by the 3 s timeout plus grace, not a hang (60 s)
    if mode == "die":
        assert runs[victim][0] == 3
