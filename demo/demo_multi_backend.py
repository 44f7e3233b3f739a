"""yirage multi-backend demo: kernel graphs and a PersistentKernel decode on every backend, checked.

For each selected backend that is available here it
  1. runs three LLM building blocks as kernel graphs (RMSNorm + Linear, a SwiGLU gate with residual,
     decode attention with GQA), checks every output against the graph evaluated in float64 by torch,
     and prints the median time beside torch eager measured in the same run;
  2. unless --skip-persistent, greedily decodes 16 tokens with a PersistentKernel on a small
     random-weight Llama built in memory, checks tokens and logits against the reference backend's
     PersistentKernel and against transformers' greedy decode (when transformers is installed), and
     prints ms/token beside transformers eager measured in the same run.
Unavailable backends and backends without a PersistentKernel runtime are listed with the reason.
Exit status: 1 when a check failed (a wrong result), 2 for a bad argument, else 0.

    python demo/demo_multi_backend.py                               # the default backend
    python demo/demo_multi_backend.py --backend all --iterations 20
    python demo/demo_multi_backend.py --backend cpu --skip-persistent
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.backend.selection import resolve
from yirage.models.config import LlamaConfig
from yirage.models.llama import LlamaModel
from yirage.models.placement import Placement
from yirage.testing import assert_matches_reference, assert_matches_torch
from yirage.testing.oracle import backend_device, on_backend

Case = tuple[yr.KernelGraph, list[torch.Tensor], Callable[..., torch.Tensor]]  # graph, inputs, torch eager


def rms_linear(batch: int, hidden: int, out: int) -> Case:
    g = yr.new_kernel_graph()
    x, gw = g.new_input((batch, hidden)), g.new_input((hidden,))
    w = g.new_input((hidden, out), strides=(1, hidden))  # the weight stored (out, hidden), as in nn.Linear
    g.mark_output(g.matmul(g.mul(g.rms_norm(x, (hidden,)), gw), w))
    inputs = [torch.randn(batch, hidden), torch.randn(hidden), torch.randn(out, hidden).t()]
    return g, inputs, lambda x, gw, wt: F.linear(F.rms_norm(x, (hidden,), gw, 1e-6), wt.t())


def swiglu(batch: int, width: int) -> Case:
    g = yr.new_kernel_graph()
    a, b, r = (g.new_input((batch, width)) for _ in range(3))
    g.mark_output(g.add(g.mul(g.silu(a), b), r))
    return g, [torch.randn(batch, width) for _ in range(3)], lambda a, b, r: F.silu(a) * b + r


def attention(batch: int, heads: int, kv_heads: int, seq: int, dim: int) -> Case:
    g = yr.new_kernel_graph()
    q = g.new_input((batch, heads, dim))
    k, v = g.new_input((batch, kv_heads, seq, dim)), g.new_input((batch, kv_heads, seq, dim))
    g.mark_output(g.attention(q, k, v))

    def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kk, vv = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q[:, :, None], kk, vv)[:, :, 0]

    return g, [torch.randn(batch, heads, dim), torch.randn(batch, kv_heads, seq, dim),
               torch.randn(batch, kv_heads, seq, dim)], eager


def cases() -> dict[str, Case]:
    torch.manual_seed(0)
    return {
        "rmsnorm+linear (1x4096 -> 4096)": rms_linear(1, 4096, 4096),
        "rmsnorm+linear (16x1024 -> 2816)": rms_linear(16, 1024, 2816),
        "swiglu+residual (64x11008)": swiglu(64, 11008),
        "decode attention (4x32 heads, 8 kv, 512 ctx)": attention(4, 32, 8, 512, 128),
    }


def median_s(fn: Callable[[], Any], iterations: int, device: Any = None) -> float:
    """Median seconds of ``fn()``; on an accelerator ``device`` a call ends when its device work has."""
    def call() -> None:
        fn()
        if device is not None and device.type != "cpu":
            torch.accelerator.synchronize(device)

    call()  # warm-up
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_graph(graph: yr.KernelGraph, inputs: list[torch.Tensor], eager: Callable[..., Any], name: str) -> None:
    """AssertionError unless ``name`` computes ``graph`` right. The float64 graph oracle evaluates the graph
    with the reference backend's op table, so the reference backend is checked against the torch expression."""
    if name == "reference":
        assert_matches_torch(graph, inputs, name, expect=eager, scale=lambda *xs: eager(*(x.abs() for x in xs)))
    else:
        assert_matches_reference(graph, inputs, name)


# -- a small PersistentKernel decode --------------------------------------------------------------------------
TOY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
PROMPT_LEN, NEW_TOKENS = 6, 16
REL_TOL = 1e-3  # per step: max |logit error| <= REL_TOL x the expected logits' range (as tests/llm_oracle.py)


def toy_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights under Hugging Face names, scaled as tests/llm_oracle.py's diverse_init so greedy
    decoding does not repeat one token (with transformers' default init, equal tokens would prove little)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in LlamaConfig.from_dict(TOY).weight_shapes().items():
        noise = torch.randn(shape, generator=gen)
        if name.startswith("embed"):
            weights[name] = 0.3 * noise
        elif "norm" in name:
            weights[name] = 1 + 0.25 * noise
        else:  # projections of order-1 outputs; the LM head sharper, for a clear argmax
            weights[name] = (4.0 if name.startswith("lm_head") else 1.5) * noise / math.sqrt(shape[1])
    return weights


@dataclass
class Decode:
    tokens: torch.Tensor  # (batch, NEW_TOKENS)
    logits: torch.Tensor  # (batch, NEW_TOKENS, vocab): the scores each token was picked from
    ms_per_token: float  # median over timed decodes, decode steps only (prefill and the first pick excluded)


def yirage_decode(weights: dict[str, torch.Tensor], backend: str, prompt: torch.Tensor, iterations: int) -> Decode:
    """Prefill in torch, then decode on ``backend``'s PersistentKernel one step at a time, reading each step's
    logits; then time whole decodes. NotSupportedError: the backend has no PersistentKernel runtime."""
    placement = Placement.of_backend(resolve(backend, "yirage_decode(backend=...)", need="persistent"))
    model = LlamaModel(LlamaConfig.from_dict(TOY), weights, placement=placement)  # every tensor on its device
    batch, p = prompt.shape
    model.reset_cache(batch, p + NEW_TOKENS)
    tokens = torch.zeros(batch, p + NEW_TOKENS, dtype=torch.int64, device=model.device)  # reads i, writes i + 1
    step = torch.full((batch,), p, dtype=torch.int64, device=model.device)
    first = model.forward(prompt, torch.arange(p).expand(batch, p))[:, -1]
    tokens[:, :p], tokens[:, p] = prompt, first.argmax(-1)
    pk = model.build_decoder(step, tokens, backend=backend, tasks=4)
    scores = [first]
    for i in range(NEW_TOKENS - 1):
        if pk(1) != 1:
            raise AssertionError(f"the PersistentKernel stopped after {i} of {NEW_TOKENS - 1} decode steps")
        scores.append(pk.read("logits"))
    checked = tokens[:, p:].clone()
    device = model.device
    times = []
    for _ in range(iterations):
        step.fill_(p)
        start = time.perf_counter()
        pk(NEW_TOKENS - 1)
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        times.append(time.perf_counter() - start)
        if not torch.equal(tokens[:, p:], checked):
            raise AssertionError(f"a timed re-run decoded {tokens[0, p:].tolist()}, the checked run "
                                 f"{checked[0].tolist()}: the decode is not deterministic")
    return Decode(checked.cpu(), torch.stack(scores, 1).float().cpu(),
                  statistics.median(times) / (NEW_TOKENS - 1) * 1e3)


def hf_decode(weights: dict[str, torch.Tensor], prompt: torch.Tensor, iterations: int) -> Decode | None:
    """transformers' greedy ``generate`` on the same weights (None when transformers is not installed). ms/token:
    the model's forward with its KV cache, one token at a time, timed without generate()'s per-step bookkeeping
    (several times the forward at this size): the stronger peer for the comparison."""
    if importlib.util.find_spec("transformers") is None:
        return None
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in TOY.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict({k if k.startswith("lm_head") else f"model.{k}": v for k, v in weights.items()})
    model.generation_config.eos_token_id = None  # never stop early: both sides decode NEW_TOKENS tokens
    times = []
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(prompt), output_logits=True, return_dict_in_generate=True)
        for _ in range(iterations + 1):  # the first is a warm-up
            step = model(prompt, use_cache=True)
            start = time.perf_counter()
            for _ in range(NEW_TOKENS - 1):
                step = model(step.logits[:, -1:].argmax(-1), past_key_values=step.past_key_values, use_cache=True)
            times.append(time.perf_counter() - start)
    return Decode(out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, 1).float(),
                  statistics.median(times[1:]) / (NEW_TOKENS - 1) * 1e3)


def mismatch(ours: Decode, want: Decode, what: str) -> str | None:
    """None when the logits of every step are within REL_TOL x the expected range and the tokens are equal."""
    if ours.logits.shape != want.logits.shape:
        return f"logits shape {tuple(ours.logits.shape)} differs from {what}: {tuple(want.logits.shape)}"
    ref = want.logits.double()
    err = (ours.logits.double() - ref).abs().amax(-1)
    bound = REL_TOL * (ref.amax(-1) - ref.amin(-1))
    bad = ~(err <= bound)  # NaN counts as bad
    if bool(bad.any()):
        return (f"logits differ from {what} at {int(bad.sum())} of {bad.numel()} steps (max |error| "
                f"{float(err.max()):.3g}, allowed {REL_TOL:g} x the logit range)")
    if not torch.equal(ours.tokens, want.tokens):
        return f"tokens {ours.tokens[0].tolist()} differ from {what}: {want.tokens[0].tolist()}"
    return None


# -- the driver -----------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    unavailable: str = ""  # the probe's reason when the backend cannot run here
    graphs: str = "-"
    persistent: str = "-"
    failures: int = 0


def short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]  # graph failures print the graph in between
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, machine-wide busy CPU seconds, this process's CPU seconds): what other processes ran meanwhile
    tells whether the timings are worth reading (on a small machine a busy neighbour stalls every thread)."""
    machine, mine = psutil.cpu_times(), psutil.Process().cpu_times()
    return time.perf_counter(), machine.user + machine.nice + machine.system, mine.user + mine.system


def selected(choice: str) -> list[str]:
    if choice == "all":
        return [b.value for b in yr.BackendType]
    if choice == "default":
        return [yr.get_backend().value]
    return [yr.get_backend_info(choice)["name"]]  # an unknown name raises UnknownBackendError with the names


def run_graphs(names: list[str], iterations: int, outcomes: dict[str, Outcome]) -> None:
    print(f"{'workload':<46}{'backend':<11}{'kernels':>8}{'yirage µs':>12}{'torch µs':>11}{'torch/yirage':>14}")
    passed = dict.fromkeys(names, 0)
    workloads = cases()
    for title, (graph, inputs, eager) in workloads.items():
        torch_us: dict[Any, float] = {}  # torch eager on each device a backend computes on
        for name in names:
            try:
                device = backend_device(name)
                there = on_backend(inputs, name)  # the backend reads its own device's tensors
                if device not in torch_us:
                    torch_us[device] = median_s(lambda eager=eager, x=there: eager(*x), iterations, device) * 1e6
                exe = graph.compile(name)
                check_graph(graph, inputs, eager, name)  # a wrong result never gets a time
            except yr.NotSupportedError as exc:
                print(f"{title:<46}{name:<11}  skipped: {short(exc)}")
                continue
            except (AssertionError, yr.YirageError) as exc:
                print(f"{title:<46}{name:<11}  FAIL: {short(exc)}")
                outcomes[name].failures += 1
                continue
            ours = median_s(lambda exe=exe, x=there: exe(x), iterations, device) * 1e6
            fused = "op/op" if name == "reference" else str(len(exe.plan.kernels))  # reference runs op by op
            eager_us = torch_us[device]
            print(f"{title:<46}{name:<11}{fused:>8}{ours:>12.0f}{eager_us:>11.0f}{eager_us / ours:>13.2f}x")
            passed[name] += 1
    for name in names:
        outcomes[name].graphs = f"{passed[name]}/{len(workloads)} match"


def run_persistent(names: list[str], iterations: int, outcomes: dict[str, Outcome]) -> None:
    weights = toy_weights()
    prompt = torch.randint(0, TOY["vocab_size"], (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    print(f"\nPersistentKernel: {NEW_TOKENS} greedy tokens of a random {TOY['num_hidden_layers']}-layer Llama "
          f"(hidden {TOY['hidden_size']}, {TOY['num_attention_heads']} heads / {TOY['num_key_value_heads']} kv, "
          f"vocab {TOY['vocab_size']}); logits within {REL_TOL:g} x the logit range, tokens equal")
    hf = hf_decode(weights, prompt, iterations)
    oracles = [] if hf is None else [("transformers", hf)]
    if hf is None:
        print("transformers is not installed: checked against the reference backend only, no HF timing")
    if any(name != "reference" for name in names):
        oracles.insert(0, ("reference PK", yirage_decode(weights, "reference", prompt, 1)))
    print(f"{'backend':<11}{'yirage ms/tok':>14}{'HF eager ms/tok':>17}{'HF/yirage':>11}  check")
    for name in names:
        try:
            ours = yirage_decode(weights, name, prompt, iterations)
        except yr.NotSupportedError as exc:
            print(f"{name:<11}  n/a: {short(exc)}")
            outcomes[name].persistent = f"n/a: {short(exc)}"
            continue
        except (AssertionError, yr.YirageError) as exc:
            print(f"{name:<11}  FAIL: {short(exc)}")
            outcomes[name].persistent, outcomes[name].failures = "FAIL", outcomes[name].failures + 1
            continue
        against = [(what, want) for what, want in oracles if not (name == "reference" and what == "reference PK")]
        problems = [p for what, want in against if (p := mismatch(ours, want, what))]
        verdict = f"FAIL: {'; '.join(problems)}" if problems else \
            f"ok: matches {' and '.join(w for w, _ in against)}" if against else "unchecked: no independent oracle"
        ms = ours.ms_per_token
        hf_ms, ratio = ("-", "-") if hf is None else (f"{hf.ms_per_token:.3f}", f"{hf.ms_per_token / ms:.2f}x")
        print(f"{name:<11}{ms:>14.3f}{hf_ms:>17}{ratio:>11}  {verdict}")
        outcomes[name].persistent = f"{'FAIL' if problems else 'match'}, {ms:.3f} ms/token ({ratio} HF eager)"
        outcomes[name].failures += bool(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="default", help="a backend name, 'auto', 'all' or 'default'")
    parser.add_argument("--iterations", type=int, default=20, help="timed runs per measurement (default 20)")
    parser.add_argument("--skip-persistent", action="store_true", help="run the kernel graphs only")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}; pass e.g. --iterations 20")
    try:
        names = selected(args.backend.strip().lower())
    except yr.YirageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start, outcomes = cpu_seconds(), {}
    for name in names:
        info = yr.get_backend_info(name)
        outcomes[name] = Outcome("" if info["available"] else info["reason"],
                                 persistent="skipped" if args.skip_persistent else "-")
    ready = [name for name in names if not outcomes[name].unavailable]
    print(f"yirage demo on: {', '.join(ready) or 'no available backend'} "
          f"(host: {yr.get_backend_info('reference')['device']['name']})")
    if len(ready) < len(names):
        print(f"unavailable here: {', '.join(n for n in names if n not in ready)} (reasons in the summary)")
    if ready:
        run_graphs(ready, args.iterations, outcomes)
        if not args.skip_persistent:
            run_persistent(ready, args.iterations, outcomes)
    print(f"\nSummary\n{'backend':<11}{'status':<13}{'kernel graphs':<15}PersistentKernel")
    for name, o in outcomes.items():
        print(f"{name:<11}" + (f"{'unavailable':<13}{o.unavailable}" if o.unavailable else
                               f"{'available':<13}{o.graphs:<15}{o.persistent}"))
    (t0, busy0, own0), (t1, busy1, own1) = start, cpu_seconds()
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)
    if ready and others > 0.25:
        print(f"WARNING: other processes used {others:.1f} of {os.cpu_count()} cores during this run: the timings "
              "are noisy (the checks are not); rerun on a quiet machine for figures")
    if any(o.failures for o in outcomes.values()):
        print(f"FAILED: {sum(o.failures for o in outcomes.values())} check(s) gave a wrong result (see FAIL above)")
        return 1
    print("All checks passed. Ratios under 1.15x are ties on this noisy machine." if ready else
          "Nothing was checked: no selected backend is available here (`--backend all` lists them all).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
