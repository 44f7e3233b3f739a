"""Tensor-parallel fused decode of a Qwen2-style model: q/k/v biases and a tied LM head, two ranks on gloo.

Oracle: transformers' greedy decode of llm_oracle's ``qwen2-bias-tied`` zoo model (diverse_init: biases of std 0.5,
so a dropped bias moves the logits far outside the tolerance). Each rank prefills with ReferenceTP, then runs its
fused PersistentKernel one step per call; the logits every token was picked from are compared per step and row with
``assert_decode_matches``. Ranks are subprocesses with torchrun's environment (test_distributed.run_ranks), each
under a hard timeout.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from llm_oracle import assert_decode_matches, distinct_per_row, zoo_factory  # noqa: E402 - needs transformers
from test_distributed import run_ranks  # noqa: E402

NEW_TOKENS = 12  # steps compared (the zoo's reference holds 32; the first 12 keep the 2-rank run short)

TP_QWEN2 = """
from yirage.distributed.tp_model import TPModel
init_world("cpu", timeout_s=60)
ids = torch.load(sys.argv[3])
n = int(sys.argv[4])
b, t = ids.shape
shard = load_shard(sys.argv[1], 2, rank)
assert any("qkv_bias" in blk for blk in shard.blocks), "the shard carries no q/k/v bias"
model = TPModel(shard)
model.reset_cache(b, t + n + 1)
logits = model.forward(ids, torch.arange(t).expand(b, t), last_only=True)[:, -1]
tokens = torch.zeros(b, t + n + 1, dtype=torch.int64)
tokens[:, :t], tokens[:, t] = ids, logits.argmax(-1)
step = torch.full((b,), t, dtype=torch.int64)
pk = model.build_decoder(step, tokens, backend="cpu", num_workers=1, num_local_schedulers=0)
fused = [logits]
for _ in range(n - 1):
    assert pk(1) == 1
    fused.append(pk.read("logits").clone())
if rank == 0:
    torch.save((tokens[:, t:t + n].clone(), torch.stack(fused, 1)), sys.argv[2])
"""


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_factory(tmp_path_factory)


def test_two_ranks_fused_decode_of_a_biased_tied_qwen2_matches_transformers(zoo, tmp_path) -> None:
    """Both ranks' fused decode (each with its half of the q/k/v biases and its half of the tied vocabulary) gives
    transformers' logits at every step within 1e-3 of the logit range, and its greedy tokens. Dropping the qkv bias
    in the tensor-parallel decoder (decoder_blocks with ``reduce``) fails here from step 1 on."""
    model = zoo("qwen2-bias-tied")
    cfg = model.oracle.config
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads % 2 == 0
    assert float(model.oracle.model.layers[0].self_attn.q_proj.bias.detach().abs().max()) > 0.5  # biases that matter
    ids = model.reference.ids
    torch.save(ids, tmp_path / "ids.pt")
    runs = run_ranks(TP_QWEN2, [str(model.path), str(tmp_path / "out.pt"), str(tmp_path / "ids.pt"),
                                str(NEW_TOKENS)], timeout=240)
    for rank, (code, _, stderr) in enumerate(runs):
        assert code == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
    tokens, logits = torch.load(tmp_path / "out.pt")
    ref = model.reference
    head = type(ref)(ref.ids, ref.tokens[:, :NEW_TOKENS], ref.logits[:, :NEW_TOKENS])
    assert min(distinct_per_row(head.tokens)) >= 4  # diverse output: equal tokens mean something
    assert_decode_matches(head, tokens, logits, label=f"TP=2 fused, {model.label}")
