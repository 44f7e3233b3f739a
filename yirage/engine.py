"""InferEngine and generation (names as in the InfiniLM examples).

``generate`` prefills the prompt in one batched pass, picks the first token,
then hands the rest of the decode loop to a compiled PersistentKernel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yirage.models.llama import LlamaModel, ModelError


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    eos_token_id: int | tuple[int, ...] | None = None  # None: the model's; () : never stop early
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {self}")


@dataclass
class GenerationResult:
    tokens: Any  # (B, n) int64: the generated tokens, prompt excluded; after a row's EOS: the pad id
    lengths: list[int]  # per row: generated tokens up to and including its EOS
    ttft_ms: float
    ms_per_token: float | None  # None when only one token was generated (no decode step)
    tokens_per_s: float | None
    backend: str
    timings: dict[str, float] = field(default_factory=dict)
    text: list[str] | None = None  # decoded with the model's tokenizer, when it has one


class InferEngine:
    """A Llama-family model from a Hugging Face directory, decoding on a yirage backend."""

    def __init__(self, model_path: str | Path, backend: Any = None, dtype: Any = None,
                 num_workers: int | None = None, num_local_schedulers: int | None = None) -> None:
        from yirage.backend.selection import current_backend, resolve

        self.backend = current_backend() if backend is None else resolve(backend, "InferEngine(backend=...)")
        self.model = LlamaModel.from_pretrained(model_path, dtype)
        self.tokenizer = _local_tokenizer(model_path)
        self.num_workers, self.num_local_schedulers = num_workers, num_local_schedulers
        self._decoders: dict[tuple[Any, ...], Any] = {}
        self._tokens = self._step = None

    @property
    def config(self) -> Any:
        return self.model.config

    def reset_cache(self, batch_size: int, max_len: int) -> None:
        import torch

        if batch_size < 1 or max_len < 2:
            raise ValueError(f"need batch_size >= 1 and max_len >= 2, got {batch_size}, {max_len}")
        if self._tokens is not None and tuple(self._tokens.shape) == (batch_size, max_len):
            return  # same shapes: keep the caches (positions are rewritten before they are read) and decoders
        self.model.reset_cache(batch_size, max_len)
        self._tokens = torch.zeros(batch_size, max_len, dtype=torch.int64)
        self._step = torch.zeros(batch_size, dtype=torch.int64)
        self._decoders.clear()

    def forward(self, input_ids: Any, positions: Any) -> Any:
        return self.model.forward(input_ids, positions)

    def _pick(self, logits: Any, config: GenerationConfig) -> Any:
        import torch

        if config.temperature == 0:
            return torch.argmax(logits, dim=-1)
        scores = logits / config.temperature
        if config.top_k:
            kth = torch.topk(scores, min(config.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, -1)
        if config.top_p < 1:
            sorted_probs, idx = torch.sort(probs, descending=True, dim=-1)
            keep = torch.cumsum(sorted_probs, -1) - sorted_probs < config.top_p
            probs = torch.zeros_like(probs).scatter(-1, idx, sorted_probs * keep)
        gen = torch.Generator().manual_seed(config.seed)
        return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen)[:, 0]

    def encode(self, prompts: str | list[str]) -> Any:
        """Token ids (B, P) for text prompts (left-padded to one length), with the model's tokenizer."""
        import torch

        if self.tokenizer is None:
            raise ModelError("this model directory has no tokenizer; pass token ids (a (batch, len) int tensor)")
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        rows = [self.tokenizer(t)["input_ids"] for t in texts]
        if len({len(r) for r in rows}) != 1:
            raise ModelError("text prompts of different token lengths are not supported yet; batch equal lengths")
        return torch.tensor(rows, dtype=torch.int64)

    def generate(self, input_ids: Any, config: GenerationConfig | None = None) -> GenerationResult:
        import torch

        config = config or GenerationConfig()
        if isinstance(input_ids, (str, list)):
            input_ids = self.encode(input_ids)
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ModelError(f"input_ids must be a (batch, prompt_len) int tensor, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        batch, prompt = input_ids.shape
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab:
            raise ModelError(f"input_ids must lie in [0, {self.config.vocab})")
        eos = self.config.eos_token_id if config.eos_token_id is None else config.eos_token_id
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos)
        max_len = prompt + config.max_new_tokens + 1
        window = self.config.sliding_window
        if window is not None and max_len > window:
            raise ModelError(f"prompt + new tokens ({max_len}) exceed the model's sliding window ({window}); "
                             "sliding-window attention is not supported yet")
        self.reset_cache(batch, max_len)
        self._tokens.zero_()
        start = time.perf_counter()
        positions = torch.arange(prompt).expand(batch, prompt)
        logits = self.forward(input_ids.to(torch.int64), positions)[:, -1]
        first = self._pick(logits, config)
        ttft = time.perf_counter() - start
        self._tokens[:, :prompt] = input_ids
        self._tokens[:, prompt] = first
        self._step.fill_(prompt)
        sampling = None if config.temperature == 0 else {
            "temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p, "seed": config.seed}
        compile_start = time.perf_counter()
        key = (tuple(eos_ids), tuple(sorted((sampling or {}).items())))
        decoder = self._decoders.get(key)
        if decoder is None:
            decoder = self.model.build_decoder(self._step, self._tokens, backend=self.backend,
                                               num_workers=self.num_workers,
                                               num_local_schedulers=self.num_local_schedulers,
                                               eos_token_id=list(eos_ids), sampling=sampling)
            self._decoders[key] = decoder
        compile_s = time.perf_counter() - compile_start
        decode_start = time.perf_counter()
        steps = decoder(config.max_new_tokens - 1)
        decode_s = time.perf_counter() - decode_start
        generated = self._tokens[:, prompt:prompt + 1 + steps].clone()
        pad = eos_ids[0] if eos_ids else 0
        lengths = []
        for row in generated:
            hits = [i for i, t in enumerate(row.tolist()) if t in eos_ids]
            end = hits[0] + 1 if hits else len(row)
            row[end:] = pad  # a finished row is not written after its EOS
            lengths.append(end)
        text = None
        if self.tokenizer is not None:
            text = [self.tokenizer.decode(row[:n].tolist()) for row, n in zip(generated, lengths, strict=True)]
        per_token = decode_s / steps if steps else None
        return GenerationResult(
            tokens=generated, lengths=lengths, text=text, ttft_ms=ttft * 1e3,
            ms_per_token=per_token * 1e3 if per_token else None,
            tokens_per_s=batch / per_token if per_token else None, backend=self.backend.name,
            timings={"compile_s": compile_s, "decode_s": decode_s, "steps": steps},
        )


def _local_tokenizer(model_path: str | Path) -> Any:
    """The model directory's tokenizer (local files only), or None when it has none."""
    path = Path(model_path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
