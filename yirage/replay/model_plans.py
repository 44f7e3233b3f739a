"""Replay plans for Llama-family models: one KV cache per batch bucket, the decode step as a PersistentKernel.

fusion  a decode step (one token per row): the model's PersistentKernel decode step (LlamaModel.build_decoder)
        compiled for the bucket's batch size, replayed from persistent ``step``/``tokens`` buffers
eager   LlamaModel.forward in torch: with fusion off, after a fused build failed, and for multi-token calls
        (prefill), for which yirage has no fused plan (InferEngine.generate prefills in torch as well)

Every plan of one bucket reads and writes that bucket's KV cache, so a prefill
followed by decode steps (fused or eager, in any mix) continues one sequence
batch; row i of a call is row i of the cache. A smaller batch padded up to
its bucket runs its padding rows at position 0 with token 0, and only the
real rows are returned.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from yirage.backend.base import Backend
from yirage.models.llama import LlamaModel
from yirage.replay.signature import ReplayError, Signature, bucket_for, check_plain_tensor, dtype_name

INDEX_DTYPES = ("int32", "int64")


class Session:
    """One batch bucket: a shallow copy of the model that owns this bucket's KV cache, and the decode buffers.

    The copy shares the weights and keeps the wrapped model's (or InferEngine's) own caches untouched.
    """

    def __init__(self, model: LlamaModel, bucket: int, cache_len: int) -> None:
        import torch

        self.model = copy.copy(model)
        self.model.reset_cache(bucket, cache_len)  # new cache lists on the copy only
        self.tokens = torch.zeros(bucket, cache_len, dtype=torch.int64, device=model.device)
        self.step = torch.zeros(bucket, dtype=torch.int64, device=model.device)
        self.decoder: Any = None  # the PersistentKernel, built by the first fused decode entry


@dataclass
class ModelCall:
    input_ids: Any  # (batch, T) int64 on the CPU
    positions: Any  # (batch, T) int64
    batch: int
    session: Session
    signature: Signature


class ModelTarget:
    """Checks calls against the model, keeps one Session per bucket and records plans."""

    def __init__(self, model: LlamaModel, backend: Backend, buckets: tuple[int, ...] | None, max_seq_len: int,
                 decoder_options: dict[str, Any]) -> None:
        self.model, self.backend, self.buckets = model, backend, buckets
        self.max_seq_len = max_seq_len
        self.decoder_options = decoder_options
        self.sessions: dict[int, Session] = {}

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ModelCall:
        import torch

        input_ids, positions = _arguments(args, kwargs)
        check_plain_tensor(input_ids, "input_ids", "cpu")
        vocab = self.model.config.vocab
        if input_ids.dim() != 2 or dtype_name(input_ids.dtype) not in INDEX_DTYPES:
            hint = " (one row: input_ids.unsqueeze(0))" if input_ids.dim() == 1 else ""
            raise ReplayError(f"input_ids must be a (batch, len) int32/int64 tensor of token ids, got "
                              f"{list(input_ids.shape)} {dtype_name(input_ids.dtype)}{hint}")
        batch, length = input_ids.shape
        if batch < 1 or length < 1:
            raise ReplayError(f"input_ids {list(input_ids.shape)} is empty; pass at least one token per row")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ReplayError(f"input_ids must lie in [0, vocab_size={vocab}), got values in "
                              f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        if positions is None:
            positions = torch.arange(length).expand(batch, length)
        check_plain_tensor(positions, "positions", "cpu")
        if tuple(positions.shape) != (batch, length) or dtype_name(positions.dtype) not in INDEX_DTYPES:
            raise ReplayError(f"positions must be a {[batch, length]} int32/int64 tensor (one position per token), "
                              f"got {list(positions.shape)} {dtype_name(positions.dtype)}")
        if int(positions.min()) < 0 or int(positions.max()) >= self.max_seq_len:
            raise ReplayError(f"positions must lie in [0, max_seq_len={self.max_seq_len}), got values in "
                              f"[{int(positions.min())}, {int(positions.max())}]; make the engine with a larger "
                              "max_seq_len")
        bucket = bucket_for(batch, self.buckets)
        sig = Signature((("input_ids", (bucket, length), dtype_name(input_ids.dtype)),
                         ("positions", (bucket, length), dtype_name(positions.dtype))), "cpu", self.backend.name)
        session = self.sessions.get(bucket)
        if session is None:
            session = self.sessions[bucket] = Session(self.model, bucket, self.max_seq_len + 1)
        return ModelCall(input_ids.to(torch.int64), positions.to(torch.int64), batch, session, sig)

    def recording(self, call: ModelCall) -> ModelRecording:
        return ModelRecording(self, call)

    def clear(self) -> None:
        """Drop every bucket's KV cache and decoder (a sequence in flight must be prefilled again)."""
        self.sessions.clear()


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(input_ids, positions) from forward(input_ids, positions) or keywords (``pos=`` as in InfiniLM)."""
    names = ("input_ids", "positions")
    if len(args) > len(names):
        raise ReplayError(f"forward takes input_ids and positions, got {len(args)} positional arguments")
    values = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        name = "positions" if key == "pos" else key
        if name not in names:
            raise ReplayError(f"forward got an unexpected keyword {key!r}; it takes input_ids and positions "
                              "(or pos=)")
        if name in values:
            raise ReplayError(f"forward got {name} twice (positionally and as {key}=); pass it once")
        values[name] = value
    if "input_ids" not in values:
        raise ReplayError("forward needs input_ids, a (batch, len) int tensor of token ids")
    return values["input_ids"], values.get("positions")


class ModelRecording:
    """The plans one model call's signature can have."""

    def __init__(self, target: ModelTarget, call: ModelCall) -> None:
        self.target, self.session = target, call.session
        length = call.input_ids.shape[1]
        self.fused_reason = None if length == 1 else (
            f"a {length}-token call (prefill) has no fused plan: the PersistentKernel decodes one token per row, "
            "so it runs LlamaModel.forward in torch")

    def fused(self) -> DecodePlan:
        s, t = self.session, self.target
        if s.decoder is None:
            s.decoder = s.model.build_decoder(s.step, s.tokens, backend=t.backend.name, eos_token_id=[],
                                              **t.decoder_options)
        return DecodePlan(s.decoder)

    def fallback(self) -> EagerModelPlan:
        return EagerModelPlan()

    def eager(self) -> EagerModelPlan:
        return EagerModelPlan()


class DecodePlan:
    """One PersistentKernel step: the call's tokens and positions are copied into the kernel's step/tokens."""

    mode = "fusion"
    recorded = True

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def run(self, call: ModelCall) -> Any:
        import torch

        s, b = call.session, call.batch
        s.step[b:] = 0  # padding rows: token 0 at position 0 of their own cache rows
        s.tokens[b:, 0] = 0
        positions = call.positions[:, 0].to(s.step.device)
        s.step[:b] = positions
        s.tokens[torch.arange(b, device=s.tokens.device), positions] = call.input_ids[:, 0].to(s.tokens.device)
        steps = self.decoder(1)
        if steps != 1:
            raise ReplayError(f"the decode step ran {steps} steps instead of 1 (positions {positions.tolist()}, "
                              f"cache length {s.tokens.shape[1]}); this is a bug in the replay engine: report it")
        return self.decoder.read("logits")[:b].unsqueeze(1)  # a copy: (batch, 1, vocab) like LlamaModel.forward


class EagerModelPlan:
    """LlamaModel.forward on the bucket's cache, for the real rows only (fresh logits every call)."""

    mode = "eager"
    recorded = False

    def run(self, call: ModelCall) -> Any:
        return call.session.model.forward(call.input_ids, call.positions)
