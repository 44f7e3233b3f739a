"""InferEngine and generation (names as in the InfiniLM examples).

``generate`` prefills the prompt in one batched pass, picks the first token,
then hands the rest of the decode loop to a compiled PersistentKernel.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import math
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yirage.config import eager_start as config_eager_start
from yirage.locks import ForkSafeRLock
from yirage.log import working
from yirage.models.config import ModelError, resolve_dtype, resolve_kv_dtype
from yirage.models.head_screen import screen_enabled
from yirage.models.llama import LlamaModel
from yirage.models.placement import Placement
from yirage.models.prefill import check_prompt_dtype, resolve_prompt_dtype, rounded_linear
from yirage.persistent.guard import refuse_dispatch_modes
from yirage.persistent.kernel import EOS_LIMIT, TEMPERATURE_FLOOR

SEED_LIMIT = 2**32  # sampling seeds mix with positions in int64 arithmetic on every runtime
#: the most new tokens one generate asks for. Why: positions and step counts are int64 on every runtime, and a
#: number past int64 failed deep in the compiled decode (a numba TypingError); 2**31 - 1 positions is far beyond
#: any model's context, and the KV cache check refuses much less (prompt + max_new_tokens must fit the memory).
MAX_NEW_TOKENS = 2**31 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate; every field is validated here, so a bad value fails before any work."""

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    eos_token_id: int | tuple[int, ...] | None = None  # None: the model's; () : never stop early
    seed: int = 0
    output_logits: bool = False  # keep every step's logits in GenerationResult.logits (decodes step by step)

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be an int >= 1 and <= 2**31 - 1, got {self.max_new_tokens!r}; the "
                             "model's context (max_position_embeddings) and the free memory bound it further")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if 0 < self.temperature < TEMPERATURE_FLOOR:
            raise ValueError(f"temperature={self.temperature!r} is below the floor {TEMPERATURE_FLOOR:g}: so low a "
                             "temperature is greedy in effect, and further down the logits divided by it overflow "
                             "float32 and the backends disagree; use temperature=0 for greedy decoding, or a "
                             f"temperature >= {TEMPERATURE_FLOOR:g}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: no top-k filter), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1: no nucleus filter), got {self.top_p!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}; reduce it, e.g. seed % 2**32")
        if not isinstance(self.output_logits, bool):
            raise ValueError(f"output_logits must be True or False, got {self.output_logits!r}")
        eos = self.eos_token_id
        if eos is not None:
            ids = (eos,) if _is_int(eos) else tuple(eos) if isinstance(eos, (tuple, list)) else None
            if ids is None or not all(_is_int(e) and 0 <= e < EOS_LIMIT for e in ids):
                raise ValueError(f"eos_token_id must be None (the model's), an int id in [0, 2**63) (int64 token ids), "
                                 f"or a tuple of them (() never stops early); got {eos!r}")
            object.__setattr__(self, "eos_token_id", eos if _is_int(eos) else ids)


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
    logits: Any = None  # (B, n, vocab) float32 with output_logits: the scores each token was picked from


class InferEngine:
    """A Llama-family model from a Hugging Face directory or a GGUF file, decoding on a yirage backend.

    Thread-safe: ``generate``, ``forward`` and ``reset_cache`` hold one lock
    per engine (the KV caches and decoders are shared), so concurrent callers
    get correct results, one generation at a time. Use one engine per thread
    to decode in parallel.
    """

    def __init__(self, model_path: str | Path, backend: Any = None, dtype: Any = None,
                 num_workers: int | None = None, num_local_schedulers: int | None = None,
                 tasks_per_layer: int | None = None, tp: int | None = None, kv_cache_dtype: Any = None,
                 prompt_dtype: Any = None, eager_start: bool | None = None) -> None:
        """``kv_cache_dtype``: the KV caches' dtype, float32 (None) or bfloat16/float16: a 16-bit cache halves the
        bytes each decode step reads at long contexts (2048 positions of SmolLM2: 94 MB of float32 per token)
        and the cache's memory; keys and values are rounded to it, as transformers' cache of a 16-bit model.

        ``prompt_dtype``: None keeps the prompt's activations float32, the decode's own precision; "bfloat16"
        (bf16 matrices only) rounds each projection's input to bfloat16 and multiplies in bf16, as transformers
        and llama.cpp run a bf16 model's prompt (prefill.rounded_linear): the cpu backend's native bf16 dot
        products where the CPU has them (2-3.5x its float32 projections' rate), else torch's bf16 matmul. The
        LM head's logits and the decode stay float32 (bf16 logits tie, and a tie flipped a greedy pick).

        ``tasks_per_layer``: how many tasks each projection is split into (the LM head gets twice as many;
        default: the backend's proposal, see LlamaModel.build_decoder). Fewer, larger tasks cost less per task;
        more balance better across many workers.

        ``eager_start``: a greedy generate whose decode kernel is still compiling (a cold compile cache) decodes
        its steps in torch meanwhile (PersistentKernel's ``eager_start``) and hands over to the kernel once it is
        compiled, so the first answer does not wait for the compile; ``GenerationResult.timings["eager_steps"]``
        counts them. A generate that samples, or reads every step's logits, waits. Default: on, unless
        ``YIRAGE_EAGER_START=0``. ``wait_compiled()`` waits for the compile (before timing a decode).

        ``tp``: tensor-parallel ranks (default 1). With ``tp=N > 1`` this process is one of N ranks started by
        torchrun (or mpirun with the same environment): it loads only its slices of the weights, joins the
        process group (the backend's collective, e.g. gloo) and decodes its part; every rank must make the same
        calls with the same prompts (docs/distributed.md). Default workers then: this machine's cores / its ranks.
        """
        from yirage.backend.selection import current_backend, resolve

        if tasks_per_layer is not None and (isinstance(tasks_per_layer, bool) or not isinstance(tasks_per_layer, int)
                                            or tasks_per_layer < 1):
            raise ValueError(f"tasks_per_layer must be a positive int, got {tasks_per_layer!r}; pass e.g. 4, or "
                             "None for the backend's default")
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ValueError(f"tp must be a positive int (tensor-parallel ranks), got {tp!r}; pass e.g. 2 under "
                             "torchrun --nproc-per-node 2, or None for one rank")
        _check_counts(num_workers, num_local_schedulers)
        if eager_start is not None and not isinstance(eager_start, bool):
            raise ValueError(f"eager_start must be True, False or None (YIRAGE_EAGER_START), got {eager_start!r}")
        self.eager_start = config_eager_start() if eager_start is None else eager_start
        kv_dtype = resolve_kv_dtype(kv_cache_dtype)  # before loading: a wrong name fails fast
        prompt_dtype = resolve_prompt_dtype(prompt_dtype)
        self.tp = tp or 1
        self.tasks_per_layer = tasks_per_layer
        self._lock = ForkSafeRLock()  # a child forked while another thread generates gets a fresh lock
        self.backend = (current_backend(need="persistent") if backend is None
                        else resolve(backend, "InferEngine(backend=...)", need="persistent"))
        if self.tp == 1:  # a JIT backend starts compiling the decode now, beside the load, tokenizer and prefill
            self.backend.prepare_decode(kv_dtype)
        if self.tp > 1:
            from yirage.distributed.tp_model import open_tp_model

            self.model, self.world = open_tp_model(model_path, self.tp, self.backend, dtype)
            if num_workers is None:  # the ranks of one machine share its cores
                local = int(os.environ.get("LOCAL_WORLD_SIZE") or self.tp)
                num_workers = max(1, (os.cpu_count() or 1) // max(1, local))
            num_local_schedulers = 0 if num_local_schedulers is None else num_local_schedulers
        else:
            _check_weight_format(self.backend, dtype)
            self.model, self.world = load_model(model_path, dtype, Placement.of_backend(self.backend)), None
        self.model.kv_dtype = kv_dtype
        check_prompt_dtype(prompt_dtype, getattr(self.model.lm_head, "dtype", None))
        self.prompt_dtype = prompt_dtype
        self._model_path = model_path
        self._tokenizer: Any = _UNSET  # built on first use (a GGUF file's takes seconds), then kept
        self._tokenizer_error: str | None = None
        self.num_workers, self.num_local_schedulers = num_workers, num_local_schedulers
        self._decoders: dict[tuple[Any, ...], Any] = {}
        self._tokens = self._step = None

    def wait_compiled(self) -> None:
        """Wait until the decode kernels this engine has built are compiled (PersistentKernel.wait_compiled): the
        next generate of the same shape then decodes on them from its first step. Before timing a decode."""
        with self._lock:
            for decoder in self._decoders.values():
                decoder.wait_compiled()

    @property
    def config(self) -> Any:
        return self.model.config

    def _prompt_linear(self) -> Any:
        """The prefill's projections: bf16-rounded ones first when asked (prompt_dtype), then the backend's
        where they beat torch's float32 (Backend.prompt_linear), else torch's."""
        linear = self.backend.prompt_linear()
        return linear if self.prompt_dtype is None else rounded_linear(self.prompt_dtype, linear)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (from the directory's files or the GGUF metadata), or None when it has none."""
        with self._lock:
            if self._tokenizer is _UNSET:
                if self.model.gguf is not None:
                    self._tokenizer, self._tokenizer_error = _gguf_tokenizer(self.model.gguf)
                else:
                    self._tokenizer = _local_tokenizer(self._model_path)
            return self._tokenizer

    def _require_tokenizer(self, what: str) -> Any:
        tokenizer = self.tokenizer
        if tokenizer is None:
            cause = self._tokenizer_error or "this model has no tokenizer (no tokenizer files in the directory, " \
                                             "no tokenizer.ggml.* metadata in the GGUF file)"
            raise ModelError(f"{what} needs the model's tokenizer, but {cause}; pass token ids instead (a "
                             "(batch, len) int tensor)")
        return tokenizer

    def apply_chat_template(self, messages: Any) -> Any:
        """Token ids (B, P) for one conversation (a list of {"role", "content"} dicts) or a list of them.

        Uses the model's chat template with the assistant's turn opened
        (add_generation_prompt=True), as transformers' apply_chat_template does.
        """
        import torch

        tokenizer = self._require_tokenizer("messages=[...]")
        _template_source(tokenizer)  # a clear error first when the model has no template
        chats = [messages] if isinstance(messages, (list, tuple)) and messages and all(
            isinstance(m, dict) for m in messages) else messages
        if not isinstance(chats, (list, tuple)) or not chats or not all(
                isinstance(c, (list, tuple)) and c and all(_is_message(m) for m in c) for c in chats):
            raise ModelError('messages must be a conversation, a non-empty list of {"role": str, "content": str} '
                             'dicts such as [{"role": "user", "content": "Hi"}], or a list of such conversations '
                             f"(a batch); got {messages!r:.200}")
        # the template has the specials; rendered in a sandbox, within limits (render_chat_template)
        texts = render_chat_template(tokenizer, chats)
        rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        if len({len(r) for r in rows}) != 1:
            raise ModelError("conversations of different token lengths are not supported yet in one batch; "
                             "generate them one at a time")
        return torch.tensor(rows, dtype=torch.int64)

    def reset_cache(self, batch_size: int, max_len: int) -> None:
        import torch

        if not (_is_int(batch_size) and _is_int(max_len)) or batch_size < 1 or max_len < 2:
            raise ValueError(f"need ints batch_size >= 1 and max_len >= 2, got {batch_size!r}, {max_len!r}")
        with self._lock:
            if self._tokens is not None and tuple(self._tokens.shape) == (batch_size, max_len):
                return  # same shapes: keep the caches (positions are rewritten before they are read) and decoders
            self.model.check_cache_fits(batch_size, max_len)  # before dropping anything
            self._decoders.clear()  # they address the old caches: drop them first
            self.model.reset_cache(batch_size, max_len)
            self._tokens = torch.zeros(batch_size, max_len, dtype=torch.int64, device=self.model.device)
            self._step = torch.zeros(batch_size, dtype=torch.int64, device=self.model.device)

    def forward(self, input_ids: Any, positions: Any = None) -> Any:
        """Logits (B, T, vocab) at ``positions`` (default 0..T-1), writing the KV cache made by reset_cache."""
        import torch

        with self._lock:
            if positions is None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
                positions = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], input_ids.shape[1])
            return self.model.forward(input_ids, positions, linear=self._prompt_linear())

    def encode(self, prompts: str | list[str]) -> Any:
        """Token ids (B, P) for text prompts (left-padded to one length), with the model's tokenizer."""
        import torch

        tokenizer = self._require_tokenizer("a text prompt")
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        rows = [tokenizer(t)["input_ids"] for t in texts]
        if len({len(r) for r in rows}) != 1:
            raise ModelError("text prompts of different token lengths are not supported yet; batch equal lengths")
        return torch.tensor(rows, dtype=torch.int64)

    def _prompt_ids(self, input_ids: Any) -> Any:
        """A (batch, prompt_len) int64 CPU tensor from text, token-id lists or a tensor on any device (a prompt is
        small: it is checked on the CPU, then placed where the model is); refuses the rest."""
        import torch

        if isinstance(input_ids, str) or (isinstance(input_ids, (list, tuple)) and input_ids
                                          and all(isinstance(p, str) for p in input_ids)):
            input_ids = self.encode(list(input_ids) if isinstance(input_ids, tuple) else input_ids)
        elif isinstance(input_ids, (list, tuple)):
            rows = list(input_ids)
            if rows and all(_is_int(t) for t in rows):
                rows = [rows]  # one prompt of token ids
            if (not rows or not all(isinstance(r, (list, tuple)) and all(_is_int(t) for t in r) for r in rows)
                    or len({len(r) for r in rows}) != 1):
                raise ModelError("a list prompt must be text (str or a list of str), token ids ([1, 2, 3]) or "
                                 "equal-length rows of token ids ([[1, 2, 3], [4, 5, 6]])")
            input_ids = torch.tensor(rows, dtype=torch.int64)
        if not isinstance(input_ids, torch.Tensor):
            raise ModelError(f"input_ids must be text, token-id lists or a (batch, prompt_len) int tensor, got "
                             f"{type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            hint = " (one prompt: input_ids.unsqueeze(0))" if input_ids.dim() == 1 else ""
            raise ModelError(f"input_ids must be a (batch, prompt_len) int tensor, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}{hint}")
        if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise ModelError(f"the prompt is empty (input_ids shape {tuple(input_ids.shape)}); pass at least one "
                             "token per row, e.g. the tokenizer's BOS id")
        if input_ids.device.type == "meta" or input_ids.is_sparse:
            raise ModelError(f"input_ids must hold token ids (a dense tensor with data), got a {input_ids.layout} "
                             f"tensor on {input_ids.device}")
        input_ids = input_ids.cpu()
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab:
            raise ModelError(f"input_ids must lie in [0, vocab_size={self.config.vocab}), got values in "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        return input_ids.to(torch.int64)

    def generate(self, input_ids: Any = None, config: GenerationConfig | None = None, *,
                 messages: Any = None) -> GenerationResult:
        """Generate for a prompt: text, token-id lists, a (batch, prompt_len) int tensor, or chat ``messages``.

        ``messages=[{"role": "user", "content": "..."}]`` goes through the
        model's chat template (see apply_chat_template). Calls on one engine are
        serialized (see the class docstring). Ctrl-C stops a long decode within
        a step or so and raises KeyboardInterrupt; the engine stays usable.
        """
        refuse_dispatch_modes("InferEngine.generate() was called")
        if (input_ids is None) == (messages is None):
            raise ModelError("pass exactly one prompt: input_ids (text or token ids) or messages=[{\"role\": "
                             "\"user\", \"content\": ...}]")
        with self._lock:
            if messages is not None:
                input_ids = self.apply_chat_template(messages)
            return self._generate(input_ids, config)

    def _generate(self, input_ids: Any, config: GenerationConfig | None) -> GenerationResult:
        import torch

        config = config or GenerationConfig()
        if not isinstance(config, GenerationConfig):
            raise ModelError(f"config must be a GenerationConfig, got {type(config).__name__}")
        self.backend.check_process()  # a forked child whose runtime cannot run: an error, before the prefill hangs
        input_ids = self._prompt_ids(input_ids)
        batch, prompt = input_ids.shape
        eos = self.config.eos_token_id if config.eos_token_id is None else config.eos_token_id
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos)
        if config.eos_token_id is not None:
            _check_eos_in_vocab(eos_ids, self.config.vocab)
        max_len = prompt + config.max_new_tokens + 1
        if self._tokens is None or tuple(self._tokens.shape) != (batch, max_len):
            self.model.check_cache_fits(batch, max_len)  # a clear error before any warning or allocation
        window = self.config.sliding_window
        if window is not None and max_len > window:
            raise ModelError(f"prompt + new tokens ({max_len}) exceed the model's sliding window ({window}); "
                             "sliding-window attention is not supported yet")
        limit = self.config.max_positions
        if limit is not None and prompt + config.max_new_tokens > limit:
            # the RoPE tables are built for every cache position, so nothing is read out of bounds; the model
            # was only trained up to max_position_embeddings, though
            warnings.warn(f"prompt ({prompt}) + max_new_tokens ({config.max_new_tokens}) exceeds the model's "
                          f"max_position_embeddings ({limit}); positions past it were never trained, so the output "
                          "usually degrades. Shorten the prompt or lower max_new_tokens", stacklevel=3)
        self.reset_cache(batch, max_len)
        self._tokens.zero_()
        self._tokens[:, :prompt] = input_ids
        self._step.fill_(prompt - 1)  # the first token is picked at the prompt's last position
        sampling = None if config.temperature == 0 else {
            "temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p, "seed": config.seed}
        compile_start = time.perf_counter()
        # greedy without output_logits: the LM head in two passes where the backend can (the same tokens, fewer bytes)
        screen = sampling is None and not config.output_logits and screen_enabled()
        key = (tuple(eos_ids), tuple(sorted((sampling or {}).items())), screen)
        decoder = self._decoders.get(key)
        if decoder is None:
            with working(f"compiling the {self.backend.name} decode kernel (first generate of this shape and "
                         "sampling; later processes load it from the compile cache)"):
                decoder = self.model.build_decoder(self._step, self._tokens, backend=self.backend,
                                                   num_workers=self.num_workers,
                                                   num_local_schedulers=self.num_local_schedulers,
                                                   eos_token_id=list(eos_ids), sampling=sampling, screen=screen,
                                                   **({"tasks": self.tasks_per_layer} if self.tasks_per_layer else {}))
            self._decoders[key] = decoder
        compile_s = time.perf_counter() - compile_start
        start = time.perf_counter()
        positions = torch.arange(prompt).expand(batch, prompt)  # host-known: the prefill moves what it indexes
        with self._lock:
            linear = self._prompt_linear()  # the backend's projections where they beat torch's
            logits = self.model.forward(input_ids, positions, last_only=True, linear=linear)[:, -1]
        # the decode kernel's own picker: a seeded generation draws every token from the runtime's one sampler
        eager = self.eager_start and sampling is None and not config.output_logits
        eager_before = decoder.eager_steps
        first = decoder.pick(logits, eager_start=eager)
        self._tokens[:, prompt] = first
        self._step.fill_(prompt)
        first.cpu()  # the first token is known on the host now (on a GPU: the prefill and the pick have run)
        ttft = time.perf_counter() - start
        decode_start = time.perf_counter()
        if config.output_logits:  # one step per call, reading the logits each step was picked from
            scores = [logits.float()]
            steps = 0
            while steps < config.max_new_tokens - 1 and decoder(1):
                steps += 1
                scores.append(decoder.read("logits").float())
            all_logits = torch.stack(scores, dim=1).cpu()
        else:
            steps, all_logits = decoder(config.max_new_tokens - 1, eager_start=eager), None
        decode_s = time.perf_counter() - decode_start
        # the one copy to the host of a generation (a copy also on the CPU: the next generate reuses the buffer)
        generated = self._tokens[:, prompt:prompt + 1 + steps].to("cpu", copy=True)
        pad = eos_ids[0] if eos_ids else 0
        lengths = []
        for row in generated:
            hits = [i for i, t in enumerate(row.tolist()) if t in eos_ids]
            end = hits[0] + 1 if hits else len(row)
            row[end:] = pad  # a finished row is not written after its EOS
            lengths.append(end)
        text, tokenizer = None, self.tokenizer
        if tokenizer is not None:
            text = [tokenizer.decode(row[:n].tolist()) for row, n in zip(generated, lengths, strict=True)]
        per_token = decode_s / steps if steps else None
        return GenerationResult(
            tokens=generated, lengths=lengths, text=text, ttft_ms=ttft * 1e3,
            ms_per_token=per_token * 1e3 if per_token else None,
            tokens_per_s=batch / per_token if per_token else None, backend=self.backend.name,
            timings={"compile_s": compile_s, "decode_s": decode_s, "steps": steps,
                     "eager_steps": decoder.eager_steps - eager_before}, logits=all_logits,
        )


_UNSET = object()
_tokenizer_lock = threading.Lock()
_gguf_tokenizers: dict[tuple[str, int, int], Any] = {}  # (path, size, mtime) -> a tokenizer to copy from


def _check_counts(num_workers: Any, num_local_schedulers: Any) -> None:
    """Refuse bad worker counts before the model loads (the PersistentKernel would, after loading it)."""
    from yirage.autoconfig import check_count

    for key, value in (("num_workers", num_workers), ("num_local_schedulers", num_local_schedulers)):
        if value is not None:
            check_count(key, value, "InferEngine", ValueError, "pass a count, or None for the device's configuration")


def _check_eos_in_vocab(eos_ids: tuple[int, ...], vocab: int) -> None:
    """An id >= vocab is never picked, so it never stops a row: refuse it rather than silently ignore it."""
    outside = [e for e in eos_ids if e >= vocab]
    if outside:
        raise ModelError(f"eos_token_id {outside} not below vocab_size={vocab}: the model never emits such an id, so "
                         f"it would never stop generation; pass ids in [0, {vocab}), or eos_token_id=() to never stop "
                         "early")


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _check_weight_format(backend: Any, dtype: Any) -> None:
    """Refuse, before reading any weight, a quantized dtype the backend's PersistentKernel runtime cannot read."""
    fmt = resolve_dtype(dtype)
    if isinstance(fmt, str) and fmt not in backend.persistent_weight_formats:
        from yirage.backend.selection import registry

        readers = [n for n in registry().names() if fmt in registry().get(n).persistent_weight_formats
                   and registry().get(n).availability().ok]
        raise ModelError(f"dtype={fmt!r}: backend {backend.name!r}'s PersistentKernel runtime does not read {fmt} "
                         f"blocks (it reads {', '.join(sorted(backend.persistent_weight_formats))}); use a backend "
                         f"that does ({', '.join(readers) or 'none available here'}), or a float dtype such as "
                         "'bfloat16' on this one")


def load_model(model_path: str | Path, dtype: Any = None, placement: Placement | None = None) -> LlamaModel:
    """A LlamaModel from a GGUF file or a Hugging Face directory (told apart by the file's magic bytes), with every
    tensor on ``placement``'s device (default: the CPU)."""
    from yirage.models.gguf import is_gguf_file

    try:
        path = Path(model_path)
    except TypeError:
        path = None  # from_pretrained names the wrong type
    if path is not None and (is_gguf_file(path) or (path.suffix.lower() == ".gguf" and not path.is_dir())):
        return LlamaModel.from_gguf(path, dtype, placement)  # a .gguf that is not one gets from_gguf's clear error
    return LlamaModel.from_pretrained(model_path, dtype, placement)


def _gguf_tokenizer(info: Any) -> tuple[Any, str | None]:
    """The tokenizer transformers builds from a GGUF file's metadata (None and why, when it cannot).

    Building it parses the whole vocabulary (0.3 s for 50k tokens), so one
    copy per file is kept per process and each engine gets its own deep copy.
    """
    if not info.has_tokenizer:
        return None, f"the GGUF file {str(info.path)!r} has no tokenizer.ggml.* metadata"
    stat = os.stat(info.path)
    key = (str(Path(info.path).resolve()), stat.st_size, stat.st_mtime_ns)
    with _tokenizer_lock:
        if key not in _gguf_tokenizers:
            try:
                _gguf_tokenizers[key] = _tokenizer_class().from_pretrained(str(Path(info.path).parent),
                                                                           gguf_file=Path(info.path).name)
            except (ValueError, KeyError, NotImplementedError, OSError) as exc:
                why = (f"transformers could not build a tokenizer from {str(info.path)!r} ({type(exc).__name__}: "
                       f"{exc})")
                warnings.warn(f"{why}; text prompts and decoded text are unavailable", UserWarning, stacklevel=4)
                return None, why
        return copy.deepcopy(_gguf_tokenizers[key]), None


def _tokenizer_class() -> Any:
    """What builds a GGUF file's tokenizer: transformers 5's fast tokenizer class itself, the class AutoTokenizer
    picks there too, without AutoTokenizer's detour through AutoConfig, which parses the whole file again with
    gguf.GGUFReader (3.9 s against 0.3 s for SmolLM2's 49152 tokens); before 5, AutoTokenizer, which picks a
    model-specific class."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return transformers.PreTrainedTokenizerFast
    return transformers.AutoTokenizer


def _local_tokenizer(model_path: str | Path) -> Any:
    """The model directory's tokenizer (local files only), or None when it has none."""
    path = Path(model_path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# -- chat templates: rendered in jinja2's sandbox, within limits -------------------------------------------------
#: Limits on rendering a chat template, which is code from the model file run on every messages=[...] call. Why:
#: jinja2's sandbox stops attribute tricks, not work: its range() allows 100000 items per call, so two nested
#: loops run 10**10 iterations (a hang), and "x" * 10**9, 10 ** 10**8 or "%999999999d" take gigabytes or minutes
#: in one expression. Real templates loop over the messages: far below these.
TEMPLATE_STEPS = 1_000_000  # items all range() calls of one rendering yield together
TEMPLATE_SECONDS = 10.0  # wall time of one rendering
TEMPLATE_CHARS = 1 << 20  # characters one rendering may produce, plus 4 x the characters of its messages
TEMPLATE_WIDTH = 4096  # the widest field a format string ("%5d", "{:>5}") may ask for


class ChatTemplateError(ModelError):
    """A chat template that cannot be rendered (malformed, refusing the messages, or past the TEMPLATE_* limits);
    the message names the problem and the fixes: fix the template, or pass the prompt without it."""


_TEMPLATE_FIX = ("fix the model's chat template (tokenizer.chat_template in a GGUF file, chat_template in "
                 "tokenizer_config.json or chat_template.jinja), or pass the prompt without the chat template: as "
                 "text or token ids instead of messages=[...]")
_WIDE_FIELD = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?|\{[^{}]*:[^{}\d]*(\d+)?(?:\.(\d+))?[^{}]*\}")


class _RenderBudget:
    """What one rendering may still spend: range() items, output characters and time."""

    def __init__(self, chars: int) -> None:
        self.steps, self.chars, self.deadline = TEMPLATE_STEPS, chars, time.monotonic() + TEMPLATE_SECONDS
        self.cap = chars  # the most one value may hold, too

    def spend(self, steps: int = 0, chars: int = 0) -> None:
        self.steps -= steps
        self.chars -= chars
        if self.steps < 0:
            raise ChatTemplateError(f"the chat template loops without bound: its range() loops passed "
                                    f"{TEMPLATE_STEPS} iterations in one rendering; {_TEMPLATE_FIX}")
        if self.chars < 0:
            raise ChatTemplateError(f"the chat template's output grows without bound (past the limit of "
                                    f"{TEMPLATE_CHARS} characters plus 4 x the messages'); {_TEMPLATE_FIX}")
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"rendering the chat template took over {TEMPLATE_SECONDS:g} s; {_TEMPLATE_FIX}")


_budget: contextvars.ContextVar[_RenderBudget] = contextvars.ContextVar("yirage_template_budget")


class _BoundedRange:
    """range() for templates: the same numbers, each item drawn from the rendering's budget."""

    def __init__(self, numbers: range) -> None:
        self._numbers = numbers

    def __len__(self) -> int:
        return len(self._numbers)

    def __contains__(self, item: Any) -> bool:
        return item in self._numbers

    def __getitem__(self, index: Any) -> Any:
        item = self._numbers[index]
        return _BoundedRange(item) if isinstance(item, range) else item

    def __iter__(self) -> Any:
        return self._draw(iter(self._numbers))

    def __reversed__(self) -> Any:
        return self._draw(reversed(self._numbers))

    @staticmethod
    def _draw(numbers: Any) -> Any:
        budget = _budget.get()
        for n in numbers:
            budget.spend(steps=1)
            yield n


def _check_widths(fmt: Any) -> None:
    """Refuse a format string asking for a field wider than TEMPLATE_WIDTH (it would be allocated at once)."""
    if isinstance(fmt, str) and any(int(g) > TEMPLATE_WIDTH for m in _WIDE_FIELD.finditer(fmt)
                                    for g in m.groups() if g):
        raise ChatTemplateError(f"the chat template formats a field wider than {TEMPLATE_WIDTH} characters "
                                f"({fmt[:80]!r}); {_TEMPLATE_FIX}")


@functools.lru_cache(maxsize=1)
def _template_environment() -> Any:
    """jinja2's ImmutableSandboxedEnvironment set up as transformers sets it up for chat templates (trim_blocks,
    lstrip_blocks, loop controls, tojson, raise_exception, strftime_now, namespace, {% generation %}), with a
    bounded range(), checked ``*``, ``**`` and ``%``, checked format widths, and no lipsum()."""
    import datetime
    import json

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' {% generation %} blocks mark assistant text: rendered as is
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):  # as transformers': no underscore names stored
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot store the underscore name {name!r}")

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value: Any) -> Any:
            _check_widths(getattr(value, "__self__", None))
            return super().wrap_str_format(value)

    def raise_exception(message: Any) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        _check_widths(f"%{indent}d" if isinstance(indent, int) else None)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def format_filter(value: Any, *args: Any, **kwargs: Any) -> str:
        _check_widths(value)
        return jinja2.filters.do_format(value, *args, **kwargs)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.globals.pop("lipsum", None)
    env.globals.update(range=lambda *args: _BoundedRange(range(*args)), raise_exception=raise_exception,
                       namespace=Namespace, dict=lambda *args, **kwargs: dict(*args, **kwargs),
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    env.filters.update(tojson=tojson, format=format_filter)
    return env


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``seq * n`` past the output budget, ``a ** b`` with a huge result and wide ``%`` fields."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _is_int(n) and len(seq) * n > _budget.get().cap:
                raise ChatTemplateError(f"the chat template repeats a {type(seq).__name__} (length {len(seq)}) "
                                        f"{n} times, past the output limit; {_TEMPLATE_FIX}")
    elif operator == "**" and _is_int(left) and _is_int(right) and abs(left) > 1 \
            and right * left.bit_length() > 1 << 16:
        raise ChatTemplateError(f"the chat template computes {left} ** {right}, a number of over 65536 bits; "
                                f"{_TEMPLATE_FIX}")
    elif operator == "%":
        _check_widths(left)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    import jinja2

    try:
        return _template_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template is malformed: {exc.message} (line {exc.lineno}); "
                                f"{_TEMPLATE_FIX}") from exc


def _plain(value: Any) -> Any:
    """``value`` rebuilt from JSON types only (what a template may see); anything else becomes ``<TypeName>``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (tokenizer_config.json): the default one
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ModelError("messages=[...] needs a chat template, but this model's tokenizer has none (no "
                         "tokenizer.chat_template in the GGUF file / tokenizer_config.json, or no default one); pass "
                         "the prompt as text or token ids instead")
    return template


def render_chat_template(tokenizer: Any, chats: Any) -> list[str]:
    """Each conversation as the text the model's chat template makes of it, with the assistant's turn opened (what
    transformers' apply_chat_template(add_generation_prompt=True, tokenize=False) renders).

    Rendered here, not by transformers, to bound it: in jinja2's immutable sandbox within the TEMPLATE_* limits
    (see _template_environment). Every template problem, from a syntax error to raise_exception() in the
    template, is a ChatTemplateError naming it and the fix.
    """
    import jinja2

    template = _compile_template(_template_source(tokenizer))
    special = _plain(dict(getattr(tokenizer, "special_tokens_map", {}) or {}))
    texts = []
    for chat in chats:
        messages = _plain([{k: v for k, v in m.items() if v is not None} for m in chat])  # as transformers does
        budget = _RenderBudget(TEMPLATE_CHARS + 4 * sum(len(str(m.get("content", ""))) for m in messages))
        token = _budget.set(budget)
        try:
            parts = []
            for part in template.generate(**special, messages=messages, tools=None, documents=None,
                                          add_generation_prompt=True):
                budget.spend(chars=len(part))
                parts.append(part)
            texts.append("".join(parts))
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused these messages or failed on them "
                                    f"({type(exc).__name__}: {exc}); {_TEMPLATE_FIX}") from exc
        except RecursionError as exc:
            raise ChatTemplateError(f"the chat template recurses without bound; {_TEMPLATE_FIX}") from exc
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template fails on these messages ({type(exc).__name__}: {exc}); "
                                    f"{_TEMPLATE_FIX}") from exc
        finally:
            _budget.reset(token)
    return texts
