"""Llama-family models (Llama, Qwen2 with qkv bias, Mistral GQA) from a Hugging Face directory or a GGUF file.

``LlamaModel`` puts the pieces together, each in a module of its own:
``config`` (config.json parsed and checked), ``weights`` (the checkpoint in
decode layout, optionally quantized), ``placement`` (the device every tensor
lives on: the backend's), ``prefill`` (the prompt in one batched torch pass,
filling the KV caches) and ``decoder`` (the decode step as a
PersistentKernel). GGUF files are read by yirage/models/gguf.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from yirage.locks import ForkSafeRLock
from yirage.models import prefill
from yirage.models.config import LlamaConfig, ModelError, load_config, resolve_dtype, resolve_kv_dtype
from yirage.models.decoder import DecoderParts, build_decoder
from yirage.models.head_screen import bf16_screen
from yirage.models.placement import Placement
from yirage.models.weights import checkpoint_reader, decode_weights, load_weights


class LlamaModel:
    """Weights in decode layout, KV caches and RoPE tables on ``placement.device``; prefill in torch, decode as a
    PersistentKernel.

    ``placement`` (default: the CPU) is where every tensor of the model is made: pass
    ``Placement.of_backend(backend)`` for a model a GPU backend decodes (InferEngine does).
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, Any], dtype: Any = None,
                 placement: Placement | None = None) -> None:
        self.config = config
        self.placement = placement or Placement.host()
        read, has_lm_head = checkpoint_reader(config, weights)
        w = decode_weights(config, read, dtype, has_lm_head=has_lm_head, device=self.placement.device)
        self.embed, self.norm, self.lm_head, self.blocks = w.embed, w.norm, w.lm_head, w.blocks
        self.k_cache: list[Any] = []
        self.v_cache: list[Any] = []
        self.kv_dtype = resolve_kv_dtype(None)  # of the caches reset_cache makes (InferEngine's kv_cache_dtype)
        self.cos = self.sin = None
        self.gguf: Any = None  # a GGUFInfo when loaded with from_gguf
        self._screen: tuple[Any, Any] | None = None  # (the LM head's (address, version), head_screen's tensors)
        self._screen_lock = ForkSafeRLock()

    @property
    def device(self) -> Any:
        """The torch device of every tensor of this model."""
        return self.placement.device

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: Any = None,
                        placement: Placement | None = None) -> LlamaModel:
        dtype = resolve_dtype(dtype)  # before reading gigabytes of weights
        return cls(load_config(model_dir), load_weights(model_dir), dtype, placement)

    @classmethod
    def from_gguf(cls, path: str | Path, dtype: Any = None, placement: Placement | None = None) -> LlamaModel:
        """A model from a llama.cpp GGUF file, dequantized into ``dtype`` (default float32).

        ``model.gguf`` keeps the file's facts (tokenizer ids, chat template, tensor types).
        """
        from yirage.models.gguf import read_gguf

        fmt = resolve_dtype(dtype)
        quantized = isinstance(fmt, str)  # read as float32, then quantize (Q8_0/Q4_0 files round-trip exactly)
        config, weights, info = read_gguf(path, None if quantized else fmt)
        model = cls(config, weights, fmt if quantized else None, placement)
        model.gguf = info
        return model

    def check_cache_fits(self, batch_size: int, max_len: int) -> None:
        """Refuse, before allocating anything, a KV cache larger than the memory available now on the device."""
        c = self.config
        kv = prefill.kv_cache_bytes(c, batch_size, max_len, self.kv_dtype.itemsize)
        rest = 2 * max_len * c.head_dim * 4 + batch_size * max_len * 8  # RoPE tables, token buffer
        self.placement.check_fits(
            kv, f"the KV cache for batch {batch_size} x {max_len} positions ({c.layers} layers x "
            f"{c.kv_heads} kv heads x head_dim {c.head_dim}, {str(self.kv_dtype).removeprefix('torch.')} keys "
            "and values)",
            "lower max_new_tokens (or the prompt length or batch size)", extra=rest)

    def reset_cache(self, batch_size: int, max_len: int) -> None:
        self.check_cache_fits(batch_size, max_len)
        self.k_cache = self.v_cache = []  # the old caches go before the new ones are made
        self.k_cache, self.v_cache = prefill.kv_caches(self.config, batch_size, max_len, self.device,
                                                          self.kv_dtype)
        self.cos, self.sin = prefill.rope_tables(self.config, max_len, self.device)

    # -- prefill (and any multi-token forward) in torch ----------------------------------
    def forward(self, input_ids: Any, positions: Any, last_only: bool = False, linear: Any = None) -> Any:
        """Logits (B, T, vocab) for ``input_ids`` at ``positions`` (B, T), writing the KV caches; with
        ``last_only``, (B, 1, vocab) for the last position only. The logits are on the model's device.
        ``linear``: the backend's projection for the prefill (Backend.prompt_linear), None for torch's."""
        import torch

        c = self.config
        if not self.k_cache:
            raise ModelError("call reset_cache(batch_size, max_len) before forward")
        if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2
                and input_ids.dtype in (torch.int32, torch.int64)):
            raise ModelError(f"input_ids must be a (batch, len) int tensor, got {getattr(input_ids, 'shape', None)} "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        b, t = input_ids.shape
        cache_batch, cache_len = self.k_cache[0].shape[0], self.k_cache[0].shape[2]
        if b > cache_batch:
            raise ModelError(f"input_ids has batch {b}, but the KV cache holds {cache_batch} rows: call "
                             f"reset_cache({b}, max_len) first")
        if not isinstance(positions, torch.Tensor) or positions.shape != (b, t) or t == 0 \
                or int(positions.min()) < 0 or int(positions.max()) >= cache_len:
            raise ModelError(f"positions must be a (B, T) = {(b, t)} tensor of positions in [0, {cache_len}) (the "
                             f"cache length; call reset_cache(batch, max_len) for a longer one)")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= c.vocab:
            raise ModelError(f"input_ids must lie in [0, vocab_size={c.vocab})")
        return prefill.prefill_logits(c, self.embed, self.blocks, self.norm, self.lm_head, self.k_cache,
                                      self.v_cache, self.cos, self.sin, input_ids, positions, last_only,
                                      linear=linear)

    # -- decode as a PersistentKernel ---------------------------------------------------------
    def decoder_parts(self) -> DecoderParts:
        """What the decode step reads (call reset_cache first)."""
        return DecoderParts(self.config, self.embed, self.norm, self.lm_head, self.blocks, self.k_cache,
                            self.v_cache, self.cos, self.sin, head_screen=self.head_screen)

    def head_screen(self) -> tuple[Any, Any] | None:
        """The LM head's bf16 copy and row bounds for a greedy decode's two-pass head (yirage.models.head_screen),
        or None where the head gets none (not float32, or not finite). Made on first use, and called again before
        every run of a decoder that reads it (PersistentKernel.before_each_run). Where the head changed in place
        since (a torch update: its version counter), the tensors given to decoders are remade in place; where it no
        longer gets a screen, or ``lm_head`` is another tensor now, their bounds are set to NaN instead, which makes
        the runtimes compute every row exactly (decoders built before keep the head they were given). Writes that
        torch does not count (``.data``, numpy views) are not seen, as for every buffer a runtime derives."""
        import torch

        head = self.lm_head
        if not isinstance(head, torch.Tensor):
            return None
        with self._screen_lock:  # decoders of this model run (and call this) under their own kernels' locks
            key = (head.data_ptr(), head._version)
            if self._screen is not None and self._screen[0] == key:
                return self._screen[1]
            made, given = bf16_screen(head), None if self._screen is None else self._screen[1]
            if given is not None:
                if self._screen[0][0] == key[0] and made is not None and made[0].shape == given[0].shape:
                    given[0].copy_(made[0])
                    given[1].copy_(made[1])
                    made = given
                else:
                    given[1].fill_(torch.nan)
            self._screen = (key, made)
            return made

    def build_decoder(self, step: Any, tokens: Any, backend: Any = None, num_workers: int | None = None,
                      num_local_schedulers: int | None = None, eos_token_id: Any = None,
                      sampling: dict[str, Any] | None = None, profiler_tensor: Any = None,
                      tasks: int | None = None, screen: bool = False) -> Any:
        """A compiled PersistentKernel that decodes with these weights and caches (yirage.models.decoder).

        ``step`` and ``tokens`` must be on the model's device. ``tasks``: tasks per projection (the LM head gets
        twice as many); None: the kernel configuration's ``tasks_per_layer``, else 16. ``screen``: a greedy decoder
        reads the LM head in two passes where the backend can (decoder.build_decoder); its "logits" are then -inf
        outside the rows that could be picked.
        """
        if not self.k_cache or self.k_cache[0].shape[0] != tokens.shape[0]:
            raise ModelError("call reset_cache(batch_size, max_len) with the tokens' batch size first")
        return build_decoder(self.decoder_parts(), step, tokens, backend=backend, num_workers=num_workers,
                             num_local_schedulers=num_local_schedulers, eos_token_id=eos_token_id, sampling=sampling,
                             profiler_tensor=profiler_tensor, tasks=tasks, screen=screen)
