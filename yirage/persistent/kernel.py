"""PersistentKernel: an LLM decode step as one task graph (Mirage MPK's API).

Build it layer by layer (each layer becomes ``grid_dim`` tasks), ``compile()``
it for a backend, then call it: it decodes until every sequence has produced
``eos_token_id`` or reached ``max_seq_length``, appending tokens to the
``tokens`` meta tensor and advancing ``step``.

Decode-step contract: ``tokens[b, step[b]]`` is the token processed now;
its key/value go to cache position ``step[b]``, attention covers positions
``0..step[b]``, the chosen token is written to ``tokens[b, step[b] + 1]`` and
``step[b]`` advances.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Any

from yirage.autoconfig import BackendConfig, check_count, check_counts, resolve_pk_config
from yirage.backend.runtime_contract import PersistentRuntime
from yirage.errors import NotSupportedError
from yirage.locks import ForkSafeRLock
from yirage.persistent import shutdown  # noqa: F401 - registers the exit hook before any decode runs
from yirage.persistent.guard import Snapshot, check_disjoint, check_tensor, refuse_dispatch_modes
from yirage.persistent.layers import Layer, LayerError, PKTensor, check_collective_layer, check_world, require, split_ok
from yirage.persistent.program import PersistentProgram, build_program
from yirage.persistent.runtime import check_runtime
from yirage.persistent.specs import layer_spec
from yirage.persistent.task_graph import TaskGraph
from yirage.quant import FORMATS as QUANT_FORMATS
from yirage.quant import QuantizedTensor

#: the most bytes of float32 copies of Q8_0 / Q4_0 matrices an eager start makes (the oracle's bodies read those); a
#: larger quantized model waits for its compile: widening its blocks per call made its torch steps slower than that
EAGER_FLOAT_COPIES = 1 << 30
#: seconds of eager steps a kernel starts at most; then it waits for its compile. Torch's steps and the compile share
#: the cores, and the compile runs niced: SmolLM2 f32 on 2 cores decoded 199 eager steps in 22 s with its kernels
#: ready after 32 s, against about 17 s for the whole answer waiting for them. An answer done within the budget
#: (a chat reply of a small model: SmolLM2 Q4_0's 48 tokens after 4.2 s instead of 13) comes seconds early; a longer
#: one costs at most about the budget (200 f32 tokens: 21.9 s against 19.4)
EAGER_SECONDS = 5.0
#: the serial torch runtime eager_start runs steps with (yirage.reference.eager installs EagerRuntime: the reference
#: layer sits above this one); None: no eager steps
_eager_runtime_class: Callable[[PersistentProgram, dict[str, int]], Any] | None = None


def install_eager_runtime(factory: Callable[[PersistentProgram, dict[str, int]], Any]) -> None:
    """Set what ``PersistentKernel(..)(eager_start=True)`` runs steps with while its runtime compiles: a
    ``factory(program, config)`` returning a runtime (``run``, ``pick``, ``stop``) of the serial kind."""
    global _eager_runtime_class
    if not callable(factory):
        raise TypeError(f"install_eager_runtime needs a factory(program, config), got {factory!r}")
    _eager_runtime_class = factory

_FLOATS = ("float32", "bfloat16", "float16")
#: the smallest sampling temperature taken (0 is greedy, through argmax_layer). Why: the runtimes divide the logits
#: by it in float32 (OpenCL, CUDA, reference) or float64 (cpu); far below 1e-6, logits / temperature overflow
#: float32 (a subnormal temperature is even flushed to 0 on GPUs), and the backends then disagree: greedy tokens,
#: near-uniform draws, or an error. At or above it the scores stay finite for any logit below 3e32, so the backends
#: agree, and so cold a sampler is greedy in effect anyway: pass temperature=0 for greedy decoding.
TEMPERATURE_FLOOR = 1e-6
EOS_LIMIT = 2**63  # eos ids are compared with int64 tokens on every runtime


def check_eos_ids(eos_token_id: Any) -> list[int]:
    """``eos_token_id`` (None, an int or a sequence of them) as a list of int64 token ids, else LayerError."""
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, Integral) else eos_token_id
    if isinstance(eos, (str, bytes)) or not isinstance(eos, Sequence) or not all(
            isinstance(e, Integral) and not isinstance(e, bool) and 0 <= e < EOS_LIMIT for e in eos):
        raise LayerError(f"eos_token_id must be None, a token id (an int in [0, 2**63)) or a list of them, got "
                         f"{eos_token_id!r}; pass the model's end-of-sequence id(s), e.g. eos_token_id=2")
    return [int(e) for e in eos]


def _grid(grid_dim: Any) -> int:
    dims = (grid_dim,) if isinstance(grid_dim, int) else tuple(grid_dim)
    if not dims or any(not isinstance(d, int) or d < 1 for d in dims):
        raise LayerError(f"grid_dim must be positive ints, e.g. (8, 1, 1); got {grid_dim!r}")
    return math.prod(dims)


class PersistentKernel:
    """See the module docstring; the constructor matches Mirage's ``mi.PersistentKernel``.

    Thread-safe: ``compile()`` and calls hold a per-kernel lock, so concurrent
    callers are serialized (they share the meta tensors and caches anyway).
    The lock is fork-safe: a child forked while another thread was inside a
    call gets a fresh lock instead of one that is never released.
    """

    def __init__(
        self,
        world_size: int = 1,
        mpi_rank: int = 0,
        num_workers: int | None = None,
        num_local_schedulers: int | None = None,
        num_remote_schedulers: int = 0,
        max_seq_length: int = 1024,
        eos_token_id: int | Sequence[int] | None = None,
        meta_tensors: Sequence[Any] | None = None,
        profiler_tensor: Any = None,
        spec_decode_config: Any = None,
        backend: Any = None,
    ) -> None:
        from yirage.backend.selection import current_backend, resolve

        self.backend = (current_backend(need="persistent") if backend is None
                        else resolve(backend, "PersistentKernel(backend=...)", need="persistent"))
        if num_remote_schedulers:
            raise NotSupportedError(
                f"num_remote_schedulers={num_remote_schedulers!r}: remote schedulers are not supported; the "
                "collectives of a multi-rank kernel run on the runtime's communication thread (allreduce_layer, "
                "allgather_layer): pass num_remote_schedulers=0")
        self.world_size, self.mpi_rank = check_world(self.backend, world_size, mpi_rank)
        if spec_decode_config is not None:
            raise NotSupportedError("speculative decoding is not supported yet; pass spec_decode_config=None")
        if meta_tensors is None or len(meta_tensors) != 2:
            raise LayerError("meta_tensors must be [step, tokens]: step (B,) int and tokens (B, max_seq_length) int64")
        step, tokens = meta_tensors
        import torch

        if not (isinstance(step, torch.Tensor) and isinstance(tokens, torch.Tensor)):
            raise LayerError("meta_tensors must be torch tensors [step, tokens]")
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise LayerError(f"tokens must be a (batch, max_seq_length) int tensor, got {tuple(tokens.shape)} "
                             f"{tokens.dtype}")
        if step.shape != (tokens.shape[0],) or step.dtype not in (torch.int32, torch.int64):
            raise LayerError(f"step must be an int tensor of shape ({tokens.shape[0]},), got {tuple(step.shape)}")
        if tokens.shape[1] < max_seq_length:
            raise LayerError(f"tokens has {tokens.shape[1]} columns, fewer than max_seq_length={max_seq_length}")
        self._device_type = torch.device(self.backend.torch_device).type
        for what, t in (("meta_tensors[0] (step)", step), ("meta_tensors[1] (tokens)", tokens)):
            check_tensor(t, what, self._device_type, written=True)
        check_disjoint([("step", step, True), ("tokens", tokens, True)])
        self._lock = ForkSafeRLock()  # a child forked mid-call must not inherit it held
        self._before_run: list[Callable[[], Any]] = []  # before_each_run's callbacks
        self._snapshot: Snapshot | None = None
        self.batch = int(tokens.shape[0])
        self.max_seq_length = int(max_seq_length)
        self.eos_token_ids = check_eos_ids(eos_token_id)
        self.step, self.tokens = step, tokens
        for key, value in (("num_workers", num_workers), ("num_local_schedulers", num_local_schedulers)):
            if value is not None:
                check_count(key, value, "PersistentKernel", LayerError, "pass a count, or None for the device's "
                            "configuration")
        self.num_workers = num_workers
        self.num_local_schedulers = num_local_schedulers
        self.profiler_tensor = profiler_tensor
        self.tensors: dict[str, PKTensor] = {}
        self.torch_tensors: dict[str, Any] = {}
        self.layers: list[Layer] = []
        self._written: set[str] = set()
        self.program: PersistentProgram | None = None  # built by compile()
        self.runtime: PersistentRuntime | None = None
        self._eager: Any = None  # the EagerRuntime of eager_start, while the runtime compiles; then None
        self.eager_steps = 0  # steps run by it, over this kernel's life
        self._eager_s = 0.0  # and their seconds (at most EAGER_SECONDS' worth are started)
        self.tokens_tensor = self._register("tokens", tuple(tokens.shape), str(tokens.dtype).removeprefix("torch."),
                                            True, tokens)

    # -- tensors -----------------------------------------------------------------
    def _register(self, name: str, dims: tuple[int, ...], dtype: str, attached: bool, torch_tensor: Any) -> PKTensor:
        if not name or name in self.tensors:
            raise LayerError(f"tensor name {name!r} is empty or already used; give each tensor a unique name")
        t = PKTensor(name, dims, dtype, attached, len(self.tensors))
        self.tensors[name] = t
        if torch_tensor is not None:
            self.torch_tensors[name] = torch_tensor
        return t

    def attach_input(self, torch_tensor: Any, name: str) -> PKTensor:
        """A tensor living in torch memory: weights, KV caches, RoPE tables.

        A matrix weight may also be a ``yirage.quant.QuantizedTensor`` (Q8_0/Q4_0 blocks) on a backend whose
        runtime reads that format (``persistent_weight_formats``); its PKTensor has the logical (N, K) dims.
        """
        import torch

        if isinstance(torch_tensor, QuantizedTensor):
            fmt = torch_tensor.format
            if fmt not in self.backend.persistent_weight_formats:
                from yirage.backend.selection import registry

                readable = sorted(self.backend.persistent_weight_formats)
                readers = [n for n in registry().names() if fmt in registry().get(n).persistent_weight_formats]
                raise NotSupportedError(f"attach_input({name!r}): backend {self.backend.name!r}'s PersistentKernel "
                                        f"runtime does not read {fmt} weights (it reads {', '.join(readable)}); "
                                        f"use a backend that does ({', '.join(readers) or 'none installed'}), or "
                                        "pass qt.dequantize() instead")
            check_tensor(torch_tensor.blocks, f"attach_input({name!r}) ({fmt} blocks) on backend "
                         f"{self.backend.name!r}", self._device_type)
            return self._register(name, torch_tensor.shape, fmt, True, torch_tensor.blocks)
        if not isinstance(torch_tensor, torch.Tensor):
            raise LayerError(f"attach_input({name!r}): expected a torch.Tensor, got {type(torch_tensor).__name__}")
        check_tensor(torch_tensor, f"attach_input({name!r}) on backend {self.backend.name!r}", self._device_type)
        dtype = str(torch_tensor.dtype).removeprefix("torch.")
        return self._register(name, tuple(torch_tensor.shape), dtype, True, torch_tensor)

    def new_tensor(
        self, dims: Sequence[int], dtype: Any = "float32", name: str = "", io_category: str = ""
    ) -> PKTensor:
        """An intermediate the kernel owns; one layer must write it before others read it."""
        dtype_name = getattr(dtype, "name", str(dtype).removeprefix("torch."))
        dims_t = tuple(int(d) for d in dims)
        if not dims_t or any(d < 1 for d in dims_t):
            raise LayerError(f"new_tensor({name!r}): dims must be positive, got {tuple(dims)}")
        if dtype_name not in _FLOATS + ("int64", "int32"):
            raise LayerError(f"new_tensor({name!r}): unsupported dtype {dtype_name}")
        return self._register(name or f"t{len(self.tensors)}", dims_t, dtype_name, False, None)

    def _own(self, layer: str, role: str, t: Any, kind: str = "activation") -> PKTensor:
        """Check ownership, write-before-read and dtype: weights may be narrow, the rest is float32."""
        if not isinstance(t, PKTensor) or self.tensors.get(t.name) is not t:
            raise LayerError(f"{layer}: {role} must be a tensor of this PersistentKernel "
                             f"(from attach_input or new_tensor), got {t!r}")
        if not t.attached and t.name not in self._written:
            raise LayerError(f"{layer}: {role} {t.name!r} is read before any layer writes it; "
                             "add the layer that produces it first")
        if kind == "weight" and t.dtype not in _FLOATS:
            raise LayerError(f"{layer}: {role} {t.name!r} is {t.dtype}; weights must be one of {_FLOATS}"
                             + (" (quantized blocks are for matrices: linear and embed weights)"
                                if t.dtype in QUANT_FORMATS else ""))
        if kind == "matrix" and t.dtype not in _FLOATS + QUANT_FORMATS:
            raise LayerError(f"{layer}: {role} {t.name!r} is {t.dtype}; matrix weights must be one of "
                             f"{_FLOATS + QUANT_FORMATS}")
        if kind == "kv_cache" and t.dtype not in _FLOATS:
            raise LayerError(f"{layer}: {role} {t.name!r} is {t.dtype}; KV caches must be one of {_FLOATS}")
        if kind == "activation" and t.attached and t is not self.tokens_tensor and t.dtype != "float32":
            raise LayerError(f"{layer}: {role} {t.name!r} is {t.dtype}; attach activations and RoPE tables as "
                             "float32 (weights and KV caches may be bfloat16/float16)")
        return t

    def _add(self, kind: str, inputs: dict[str, PKTensor], output: PKTensor, tasks: int, **params: Any) -> None:
        layer = f"{kind}_layer(output={getattr(output, 'name', output)!r})"
        if not isinstance(output, PKTensor) or self.tensors.get(output.name) is not output:
            raise LayerError(f"{layer}: output must be a tensor of this PersistentKernel")
        if output.attached and output is not self.tokens_tensor:
            raise LayerError(f"{layer}: output {output.name!r} is an attached input; write to a new_tensor")
        if output.name in self._written:
            raise LayerError(f"{layer}: {output.name!r} is already written by another layer; use a new tensor")
        self.layers.append(Layer(kind, len(self.layers), inputs, output, tasks, params))
        self._written.add(output.name)
        self.program = self.runtime = self._snapshot = None  # a changed graph must be compiled again

    @property
    def task_graph(self) -> TaskGraph | None:
        """The compiled program's task graph (None until ``compile()``)."""
        return None if self.program is None else self.program.task_graph

    def _dims(self, layer: str, role: str, t: PKTensor, dims: tuple[int, ...], floats: bool = True) -> None:
        require(t.dims == dims, layer, f"{role} {t.name!r} has dims {t.dims}, expected {dims}")
        if floats:
            require(t.dtype in _FLOATS, layer, f"{role} {t.name!r} has dtype {t.dtype}; expected one of {_FLOATS}")

    # -- layers (one thin method each) ---------------------------------------------------
    def embed_layer(self, input: PKTensor, weight: PKTensor, output: PKTensor, grid_dim: Any = 1,
                    block_dim: Any = None) -> None:
        name = "embed_layer"
        input, weight = self._own(name, "input", input), self._own(name, "weight", weight, "matrix")
        require(input is self.tokens_tensor, name, "input must be the tokens meta tensor (the current token is read "
                                                   "at tokens[b, step[b]])")
        require(len(weight.dims) == 2, name, f"weight must be (vocab, hidden), got {weight.dims}")
        self._dims(name, "output", output, (self.batch, weight.dims[1]))
        tasks = _grid(grid_dim)
        split_ok(name, weight.dims[1], tasks)
        self._add("embed", {"input": input, "weight": weight}, output, tasks)

    def rmsnorm_linear_layer(self, input: PKTensor, weight_norm: PKTensor, weight_linear: PKTensor,
                             output: PKTensor, grid_dim: Any = 1, block_dim: Any = None, eps: float = 1e-6,
                             bias: PKTensor | None = None) -> None:
        """output = rms_norm(input) * weight_norm @ weight_linear.T (+ bias); weight_linear is (N, K)."""
        name = "rmsnorm_linear_layer"
        x = self._own(name, "input", input)
        require(len(x.dims) == 2 and x.dims[0] == self.batch, name,
                f"input must be (batch={self.batch}, K), got {x.dims}")
        k = x.dims[1]
        self._dims(name, "weight_norm", self._own(name, "weight_norm", weight_norm, "weight"), (k,))
        w = self._own(name, "weight_linear", weight_linear, "matrix")
        require(len(w.dims) == 2 and w.dims[1] == k, name,
                f"weight_linear must be (N, {k}) like nn.Linear, got {w.dims}")
        self._dims(name, "output", output, (self.batch, w.dims[0]))
        inputs = {"input": x, "weight_norm": weight_norm, "weight_linear": w}
        if bias is not None:
            self._dims(name, "bias", self._own(name, "bias", bias, "weight"), (w.dims[0],))
            inputs["bias"] = bias
        tasks = _grid(grid_dim)
        split_ok(name, w.dims[0], tasks)
        require(eps >= 0, name, f"eps={eps} must be >= 0")
        self._add("rmsnorm_linear", inputs, output, tasks, eps=float(eps))

    def attention_layer(self, input: PKTensor, k_cache: PKTensor, v_cache: PKTensor, q_norm: Any = None,
                        k_norm: Any = None, cos_pos_embed: PKTensor | None = None,
                        sin_pos_embed: PKTensor | None = None, output: PKTensor | None = None,
                        grid_dim: Any = None, block_dim: Any = None) -> None:
        """Decode attention with RoPE over a KV cache (GQA).

        The caches are float32, bfloat16 or float16 (both the same): a 16-bit cache halves the bytes a long
        context reads per step; the new key and value are rounded to it (to nearest even, like torch) before
        the step's attention reads them, as transformers' caches of a 16-bit model do.

        ``input`` holds q, k, v per kv group: for group g the columns
        ``[q heads of g | k_g | v_g]``, each head ``head_dim`` wide (the model
        builder permutes the QKV weight rows into this layout).
        """
        name = "attention_layer"
        if q_norm is not None or k_norm is not None:
            raise NotSupportedError(f"{name}: q_norm/k_norm (Qwen3-style) are not supported yet; pass None")
        x = self._own(name, "input", input)
        kc, vc = self._own(name, "k_cache", k_cache, "kv_cache"), self._own(name, "v_cache", v_cache, "kv_cache")
        require(kc.dtype == vc.dtype, name, f"k_cache is {kc.dtype} but v_cache is {vc.dtype}; give both caches "
                                            "one dtype")
        require(kc is not vc, name, f"k_cache and v_cache are the same tensor {kc.name!r}; decoding writes both, "
                                    "so keys would overwrite values: attach a separate buffer for each")
        for other in self.layers:
            for role in other.spec.writes:
                require(other.inputs[role] not in (kc, vc), name,
                        f"{other.inputs[role].name!r} is already the {role} of {other}; every attention layer "
                        "writes its caches, so give each layer its own k_cache and v_cache")
        require(cos_pos_embed is not None and sin_pos_embed is not None, name, "cos_pos_embed and sin_pos_embed "
                                                                              "are required (RoPE)")
        cos, sin = self._own(name, "cos_pos_embed", cos_pos_embed), self._own(name, "sin_pos_embed", sin_pos_embed)
        require(len(kc.dims) == 4 and kc.dims == vc.dims and kc.dims[0] == self.batch, name,
                f"k_cache and v_cache must both be (batch={self.batch}, kv_heads, max_seq_length, head_dim), "
                f"got {kc.dims} and {vc.dims}")
        _, kv_heads, seq, head_dim = kc.dims
        require(seq >= self.max_seq_length, name, f"the caches hold {seq} positions < max_seq_length")
        require(cos.dims == sin.dims == (seq, head_dim), name,
                f"cos/sin_pos_embed must be ({seq}, {head_dim}), got {cos.dims} and {sin.dims}")
        require(len(x.dims) == 2 and x.dims[0] == self.batch and x.dims[1] % (kv_heads * head_dim) == 0, name,
                f"input must be (batch, kv_heads * (group + 2) * head_dim), got {x.dims}")
        group = x.dims[1] // (kv_heads * head_dim) - 2
        require(group >= 1, name, f"input {x.dims} is too narrow for q, k and v of {kv_heads} kv heads")
        if output is None:
            raise LayerError(f"{name}: output is required (a new_tensor of (batch, heads * head_dim))")
        self._dims(name, "output", output, (self.batch, kv_heads * group * head_dim))
        tasks = self.batch * kv_heads
        if grid_dim is not None:
            require(_grid(grid_dim) == tasks, name, f"grid_dim must be (batch, kv_heads, 1) = ({self.batch}, "
                                                    f"{kv_heads}, 1), got {grid_dim}")
        self._add("attention", {"input": x, "k_cache": kc, "v_cache": vc, "cos": cos, "sin": sin}, output, tasks,
                  kv_heads=kv_heads, group=group, head_dim=head_dim)

    def linear_with_residual_layer(self, input: PKTensor, weight: PKTensor, residual: PKTensor, output: PKTensor,
                                   grid_dim: Any = 1, block_dim: Any = None) -> None:
        self._linear_residual("linear_with_residual", input, weight, residual, output, grid_dim, 1)

    def silu_mul_linear_with_residual_layer(self, input: PKTensor, weight: PKTensor, residual: PKTensor,
                                            output: PKTensor, grid_dim: Any = 1, block_dim: Any = None) -> None:
        """output = (silu(gate) * up) @ weight.T + residual, with input = [gate | up]."""
        self._linear_residual("silu_mul_linear_with_residual", input, weight, residual, output, grid_dim, 2)

    def _linear_residual(self, kind: str, input: PKTensor, weight: PKTensor, residual: PKTensor, output: PKTensor,
                         grid_dim: Any, widen: int) -> None:
        name = f"{kind}_layer"
        x, w = self._own(name, "input", input), self._own(name, "weight", weight, "matrix")
        r = self._own(name, "residual", residual)
        require(len(w.dims) == 2, name, f"weight must be (N, K) like nn.Linear, got {w.dims}")
        self._dims(name, "input", x, (self.batch, w.dims[1] * widen))
        self._dims(name, "residual", r, (self.batch, w.dims[0]))
        self._dims(name, "output", output, (self.batch, w.dims[0]))
        tasks = _grid(grid_dim)
        split_ok(name, w.dims[0], tasks)
        self._add(kind, {"input": x, "weight": w, "residual": r}, output, tasks)

    def allreduce_layer(self, input: PKTensor, output: PKTensor, label: str, grid_dim: Any = 1,
                        block_dim: Any = None) -> None:
        """output = the sum of ``input`` over the ranks (after a row-parallel projection); ``label`` names it in
        errors ("layer 3 o_proj all-reduce"). One task: it waits for the collective, other layers' tasks go on."""
        name = "allreduce_layer"
        x = self._own(name, "input", input)
        self._dims(name, "output", output, x.dims)
        require(x.dtype == "float32", name, f"input {x.name!r} is {x.dtype}; collectives sum float32 activations")
        check_collective_layer(name, (self.world_size, self.mpi_rank), label, grid_dim)
        self._add("allreduce", {"input": x}, output, 1, label=label)

    def allgather_layer(self, input: PKTensor, output: PKTensor, label: str, shard_width: int, grid_dim: Any = 1,
                        block_dim: Any = None) -> None:
        """Every rank's ``input`` columns side by side: rank r's land at ``r * shard_width`` (a vocabulary-parallel
        LM head's logits); ``output`` keeps its first columns (the last shard may be short: the rest is padding)."""
        name = "allgather_layer"
        x = self._own(name, "input", input)
        require(len(x.dims) == 2 and x.dims[0] == self.batch and x.dtype == "float32", name,
                f"input must be float32 (batch={self.batch}, columns), got {x.dims} {x.dtype}")
        require(isinstance(shard_width, int) and not isinstance(shard_width, bool) and x.dims[1] <= shard_width,
                name, f"shard_width={shard_width!r} must be an int >= the input's {x.dims[1]} columns (every "
                      "rank's shard is padded to it)")
        n, r = self.world_size, self.mpi_rank
        require(len(output.dims) == 2 and output.dims[0] == self.batch and (n - 1) * shard_width < output.dims[1]
                <= n * shard_width, name, f"output must be (batch={self.batch}, columns) with columns in "
                                          f"({(n - 1) * shard_width}, {n * shard_width}] for {n} shards of "
                                          f"{shard_width}, got {output.dims}")
        require(x.dims[1] == min(shard_width, output.dims[1] - r * shard_width), name,
                f"rank {r} holds columns {r * shard_width}.. of {output.dims[1]}: its input must have "
                f"{min(shard_width, output.dims[1] - r * shard_width)} columns, got {x.dims[1]}")
        self._dims(name, "output", output, output.dims)
        check_collective_layer(name, (self.world_size, self.mpi_rank), label, grid_dim)
        self._add("allgather", {"input": x}, output, 1, label=label, shard_width=shard_width)

    def screened_logits_layer(self, input: PKTensor, hidden: PKTensor, weight_norm: PKTensor, weight: PKTensor,
                              row_bound: PKTensor, output: PKTensor, eps: float = 1e-6, grid_dim: Any = 1,
                              block_dim: Any = None) -> None:
        """A greedy LM head's second pass: ``output`` holds, for every row ``i`` that can hold a row's maximum, the
        exact logit ``rms_norm(hidden) * weight_norm @ weight[i]`` (bit for bit what ``rmsnorm_linear_layer`` over
        ``weight`` computes), and -inf for every other row, so ``argmax_layer`` over ``output`` picks what it picks
        over the exact logits, NaN and ties included.

        ``input`` is the first pass: scores of the same rows from a cheaper copy of ``weight`` (fewer bytes to
        stream, e.g. rounded to bfloat16), within ``bound_i = row_bound[i] * sum(|x|) + K * SCREEN_UNDERFLOW`` of
        the exact logit, where ``x`` is the normalized hidden row (yirage.models.head_screen derives ``row_bound``;
        yirage.persistent.specs the constants). A row ``i`` is kept where ``input[i] + bound_i >= max_j (input[j] -
        bound_j)``: the exact maximum is always among them. A screen or bound that is not finite, or a bound that
        reaches SCREEN_OVERFLOW (the float32 dot products could overflow), is not trusted: then every row is computed
        exactly. One task; only runtimes that declare a body run it (``runs("screened_logits")``). Nothing but
        ``argmax_layer`` may read ``output``."""
        name = "screened_logits_layer"
        a, x = self._own(name, "input", input), self._own(name, "hidden", hidden)
        require(len(x.dims) == 2 and x.dims[0] == self.batch, name,
                f"hidden must be (batch={self.batch}, K), got {x.dims}")
        k = x.dims[1]
        self._dims(name, "weight_norm", self._own(name, "weight_norm", weight_norm, "weight"), (k,))
        w = self._own(name, "weight", weight, "weight")
        require(len(w.dims) == 2 and w.dims[1] == k, name, f"weight must be (vocab, {k}) like nn.Linear, got "
                                                           f"{w.dims}")
        self._dims(name, "input", a, (self.batch, w.dims[0]))
        bound = self._own(name, "row_bound", row_bound, "weight")
        self._dims(name, "row_bound", bound, (w.dims[0],))
        require(bound.dtype == "float32", name, f"row_bound {bound.name!r} is {bound.dtype}; give float32 bounds")
        self._dims(name, "output", output, (self.batch, w.dims[0]))
        require(grid_dim is None or _grid(grid_dim) == 1, name, f"one task scans the screen; grid_dim must be 1, "
                                                               f"got {grid_dim}")
        require(eps >= 0, name, f"eps={eps} must be >= 0")
        self._add("screened_logits", {"input": a, "hidden": x, "weight_norm": weight_norm, "weight": w,
                                      "row_bound": bound}, output, 1, eps=float(eps))

    def before_each_run(self, refresh: Callable[[], Any]) -> None:
        """Call ``refresh()`` before every decode of this kernel (under its lock, before its tensors are checked): a
        model keeps the tensors it derived from others up to date with them (LlamaModel.head_screen: a changed LM
        head's screen)."""
        self._before_run.append(refresh)

    def runs(self, kind: str) -> bool:
        """Whether this kernel's backend runs layers of ``kind`` (its runtime's task bodies,
        ``Backend.persistent_task_bodies``): a model asks before it builds a layer only some runtimes have, such
        as ``screened_logits``, and builds the plain layers otherwise."""
        layer_spec(kind)
        bodies = self.backend.persistent_task_bodies()
        return bodies is not None and kind in bodies.bodies

    def argmax_layer(self, input: PKTensor, output: PKTensor, grid_dim: Any = 1, block_dim: Any = None) -> None:
        """Greedy decoding: output[b, 0] = argmax of the logits row (first index on ties)."""
        self._picker("argmax", input, output, {})

    def sampling_layer(self, input: PKTensor, output: PKTensor, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int = 0, grid_dim: Any = 1, block_dim: Any = None) -> None:
        """Sample from softmax(logits / temperature) restricted to top_k and nucleus top_p."""
        require(isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                and TEMPERATURE_FLOOR <= temperature < math.inf, "sampling_layer",
                f"temperature={temperature!r} must be a finite number >= {TEMPERATURE_FLOOR:g}: below it the backends' "
                "float32 scores overflow and disagree; for greedy decoding use argmax_layer (temperature=0)")
        require(top_k >= 0 and 0 < top_p <= 1, "sampling_layer", f"need top_k >= 0 and 0 < top_p <= 1, got "
                                                                 f"top_k={top_k}, top_p={top_p}")
        require(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32, "sampling_layer",
                f"seed must be an int in [0, 2**32) (it is mixed with positions in int64), got {seed!r}")
        self._picker("sample", input, output, {"temperature": float(temperature), "top_k": int(top_k),
                                               "top_p": float(top_p), "seed": int(seed)})

    def _picker(self, kind: str, input: PKTensor, output: PKTensor, params: dict[str, Any]) -> None:
        name = f"{kind}_layer"
        x = self._own(name, "input", input)
        require(len(x.dims) == 2 and x.dims[0] == self.batch, name, f"input must be (batch, vocab), got {x.dims}")
        screened = any(layer.kind == "screened_logits" and layer.output is x for layer in self.layers)
        require(kind == "argmax" or not screened, name,
                f"input {x.name!r} holds screened logits (-inf outside the rows that can be the maximum): only "
                "argmax_layer may read them; sample from the exact logits of an rmsnorm_linear_layer")
        self._dims(name, "output", output, (self.batch, 1), floats=False)
        require(output.dtype in ("int64", "int32"), name, f"output must be an int tensor, got {output.dtype}")
        self._add(kind, {"input": x}, output, 1, **params)

    # -- compile and run ---------------------------------------------------------------
    def compile(self) -> PersistentKernel:
        refuse_dispatch_modes("PersistentKernel.compile() was called")
        with self._lock:
            if not self.layers or not self.layers[-1].spec.picks_token:
                raise LayerError("the last layer must be argmax_layer or sampling_layer: it picks the next token")
            self._check_token_range()
            self._check_memory()
            self.program = build_program(
                batch=self.batch, max_seq_length=self.max_seq_length, eos_token_ids=self.eos_token_ids,
                tensors=self.tensors, torch_tensors=self.torch_tensors, step=self.step, tokens=self.tokens,
                layers=self.layers, profiler_tensor=self.profiler_tensor)
            self.runtime = check_runtime(self.backend, self.backend.persistent_runtime(self.program, self._config()))
            self._snapshot = Snapshot([*self.torch_tensors.items(), ("step", self.step)])
        return self

    def _check_token_range(self) -> None:
        """The picker's ids feed the next step's embed lookup: every id it can emit must be a row there."""
        picker = self.layers[-1]
        width = picker.inputs["input"].dims[1]
        for layer in (lay for lay in self.layers if lay.spec.token_table is not None):
            table = layer.inputs[layer.spec.token_table]
            rows = table.dims[0]
            if width > rows:
                raise LayerError(
                    f"{picker.spec.method} picks token ids in [0, {width}) (its input {picker.inputs['input'].name!r} "
                    f"has {width} columns), but {layer.spec.method}'s {layer.spec.token_table} {table.name!r} has "
                    f"only {rows} rows: the next step would read past the table. Make the logits as wide as the "
                    "embed table (lm_head rows = embed rows = vocab_size)")

    def _check_memory(self) -> None:
        """Tensors that decoding writes (meta tensors, KV caches) must not alias anything else handed over.

        Read-only sharing is fine (one tensor attached under two names, e.g.
        tied embeddings); a written tensor must have exactly one use: one
        name, one role in one layer, and no bytes in common with any other.
        """
        written = {"tokens"} | {layer.inputs[r].name for layer in self.layers for r in layer.spec.writes}
        for name in written - {"tokens"}:
            uses = [f"{role} of {layer}" for layer in self.layers for role, t in layer.inputs.items()
                    if t.name == name]
            if len(uses) > 1:
                raise LayerError(f"KV cache {name!r} is used {len(uses)} times ({'; '.join(uses)}), but decoding "
                                 "writes it: give every use its own buffer")
        for name in written - {"tokens"}:
            check_tensor(self.torch_tensors[name], f"KV cache {name!r}", self._device_type, written=True)
        items = [("step", self.step, True)]
        items += [(name, t, name in written) for name, t in self.torch_tensors.items()]
        check_disjoint(items)

    def _config(self) -> dict[str, int]:
        """Explicit counts, else the applied configuration for this device, else the backend's default_config
        (yirage.autoconfig); kept as ``self.config`` with the source of each value."""
        active = resolve_pk_config(self.backend, self.num_workers, self.num_local_schedulers)
        config = active.values()
        check_counts(config, f"PersistentKernel ({active.sources()})", LayerError,
                     "pass num_workers/num_local_schedulers explicitly, or fix the saved configuration")
        self._active_config = active
        return config

    @property
    def config(self) -> BackendConfig:
        """The configuration this kernel runs with (compiled) or would run with now, with each value's source
        ("explicit", "saved", "derived", "default")."""
        active = getattr(self, "_active_config", None)
        if active is None or self.runtime is None:
            active = resolve_pk_config(self.backend, self.num_workers, self.num_local_schedulers)
        return active

    def check_meta(self) -> None:
        """step and the current tokens must be in range: compiled runtimes index memory with them."""
        vocab = next((lay.inputs[lay.spec.token_table].dims[0] for lay in self.layers
                      if lay.spec.token_table is not None), None)
        for b in range(self.batch):
            pos = int(self.step[b])
            if not 0 <= pos < self.max_seq_length:
                raise LayerError(f"step[{b}] = {pos} is outside [0, max_seq_length={self.max_seq_length})")
            tok = int(self.tokens[b, pos])
            if vocab is not None and not 0 <= tok < vocab:
                raise LayerError(f"tokens[{b}, {pos}] = {tok} is not a token id in [0, {vocab})")

    def __call__(self, max_new_tokens: int | None = None, *, eager_start: bool = False) -> int:
        """Decode until EOS or max_seq_length (or ``max_new_tokens`` steps); returns steps run.

        Every tensor handed to compiled code is re-checked first (address,
        shape, strides, dtype, storage size). Concurrent calls are serialized.

        ``eager_start``: while the runtime's code is still compiling (its ``compiling()``, which starts that
        compile in the background), greedy steps run in torch (``yirage.reference.eager``) on the same tensors,
        one at a time, and the runtime takes over at the first step after its compile ends: the first answer
        of a cold process does not wait for the compile. At most ``EAGER_SECONDS`` of such steps per kernel: then
        it waits for the compile, which has the cores to itself. Not for sampling (the draws would depend on which
        runtime ran a step), multi-rank kernels or quantized matrices above ``EAGER_FLOAT_COPIES`` bytes as
        float32: those wait, as without it.
        """
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 0):
            raise LayerError(f"max_new_tokens must be an int >= 0 or None, got {max_new_tokens!r}")
        if max_new_tokens is not None:  # a decode stops at max_seq_length anyway; runtimes count steps in int64
            max_new_tokens = min(max_new_tokens, self.max_seq_length)
        refuse_dispatch_modes("a PersistentKernel was called")
        with self._lock:
            if self.runtime is None:
                self.compile()
            for refresh in self._before_run:
                refresh()
            assert self._snapshot is not None
            self._snapshot.verify()
            self.check_meta()
            steps = 0
            eager = self._eager_runtime() if eager_start else None
            while eager is not None and (max_new_tokens is None or steps < max_new_tokens):
                start = time.perf_counter()
                ran = eager.run(1)
                self._eager_s += time.perf_counter() - start
                self.eager_steps += ran
                steps += ran
                if ran == 0:  # every row is at an EOS or max_seq_length
                    return steps
                eager = self._eager_runtime()
            if max_new_tokens is not None and steps == max_new_tokens:
                return steps
            return steps + int(self.runtime.run(None if max_new_tokens is None else max_new_tokens - steps))

    def _eager_runtime(self) -> Any:
        """The EagerRuntime for ``eager_start`` while the runtime compiles (made on first need), else None (and
        the eager one, with its buffers, dropped). Under the kernel's lock."""
        compiling = getattr(self.runtime, "compiling", None)
        if (compiling is None or _eager_runtime_class is None or self._eager_s >= EAGER_SECONDS
                or not self._eager_allowed() or not compiling()):
            self._eager = None
            return None
        if self._eager is None:
            assert self.program is not None
            self._eager = _eager_runtime_class(self.program, {"num_workers": 1, "num_local_schedulers": 1})
        return self._eager

    def _eager_allowed(self) -> bool:
        """Greedy, one rank, and float32 copies of the Q8_0 / Q4_0 matrices within ``EAGER_FLOAT_COPIES`` bytes:
        where the torch steps pick what the runtime would (a sampler's draws would depend on which runtime ran a
        step), need no collective, and take at most that much memory until the runtime takes over."""
        if self.program is None or self.program.picker.kind != "argmax" or any(
                layer.spec.collective is not None for layer in self.layers):
            return False
        copies = sum(4 * math.prod(t.dims) for t in self.program.tensors if t.dtype in QUANT_FORMATS)
        return copies <= EAGER_FLOAT_COPIES

    def wait_compiled(self) -> None:
        """Compile (or load) the runtime's code now, if it compiles on first use (its ``prepare()``): after this a
        call runs no eager step and waits for no compile. Compiles the kernel first where needed."""
        refuse_dispatch_modes("PersistentKernel.wait_compiled() was called")
        with self._lock:
            if self.runtime is None:
                self.compile()
            prepare = getattr(self.runtime, "prepare", None)
            if prepare is not None:
                prepare()
            self._eager = None

    def pick(self, logits: Any, *, eager_start: bool = False) -> Any:
        """Every row's next token picked from ``logits`` (batch, vocab) by this kernel's last layer (argmax, or its
        sampler at each row's position ``step[b]``) without decoding a step: a prompt's first token, drawn from the
        same sampler as the decode steps. Returns (batch,) int64 on the kernel's device; writes neither ``tokens``
        nor ``step`` (the caller appends the token and advances ``step``). ``eager_start``: as in ``__call__``."""
        import torch

        refuse_dispatch_modes("PersistentKernel.pick() was called")
        with self._lock:
            if self.runtime is None:
                self.compile()
            assert self._snapshot is not None and self.program is not None
            want = self.program.picker.inputs["input"].dims
            if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != want or not logits.is_floating_point():
                raise LayerError(f"pick(logits): logits must be a float tensor of shape {want} (batch, vocab), got "
                                 f"{getattr(logits, 'shape', type(logits).__name__)}")
            logits = logits.to(device=self.step.device, dtype=torch.float32).contiguous()
            self._snapshot.verify()
            self.check_meta()
            eager = self._eager_runtime() if eager_start else None
            return (eager or self.runtime).pick(logits).to(torch.int64, copy=True)

    def read(self, name: str) -> Any:
        """A copy of a tensor of the last run (e.g. ``"logits"``), for tests and debugging.

        Copied under the kernel's lock, so a later run cannot change it.
        """
        with self._lock:
            if self.runtime is None:
                raise LayerError("read() needs a compiled kernel that has run: call compile() and the kernel first")
            if name not in self.tensors:
                raise LayerError(f"{name!r} is not a tensor of this PersistentKernel; it has "
                                 f"{', '.join(sorted(self.tensors))}")
            return self.runtime.value(name).clone()

    def __str__(self) -> str:
        graph = self.task_graph.summary() if self.task_graph else "(not compiled)"
        return f"PersistentKernel on {self.backend.name}, batch {self.batch}\n{graph}"
