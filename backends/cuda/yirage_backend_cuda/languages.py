"""Which kernel language runs each plan kernel on the cuda backend: CUDA C (NVRTC) or Triton.

The choice is per plan kernel class (``pointwise``, ``row``, ``matmul``,
``embedding``, ``attention``), set by ``YIRAGE_CUDA_KERNELS`` (``cuda``, the
default; ``triton``; or a map such as ``matmul=triton,row=cuda`` whose missing
classes stay ``cuda``) or programmatically through
``CUDABackend.kernel_languages`` (a later superoptimizer sets it per plan).

A plan whose kernels all stay CUDA C renders exactly as before. Otherwise the
plan is rendered twice, by the C-family renderer (CUDA dialect) and by the
Triton renderer, and ``render_mixed`` keeps, per plan kernel, the launches of
the chosen language (a CUDA launch belongs to plan kernel ``k`` when it is
named ``k``, ``k_pro`` or ``k_full``; a ``Gemm`` step by its ``name``; the
Triton renderer emits one launch named ``k``). Both renderings go into one
cache entry: ``kernels.cu`` (the launch metadata, which now lists Triton steps
too, and the CUDA C, compiled to cubins as always) and ``kernels.py`` (the
Triton module, compiled by Triton on first launch). Plan buffers (outputs,
temporaries) are shared by both languages, which lay them out alike (outputs
in their dtype, temporaries flat at compute type); each rendering's scratch is
its own (Triton's is renamed with the ``triton:`` prefix).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from yirage.compiler.kernel_ir import Attention, Embedding, Kernel, KernelPlan, Matmul, Pointwise, Row
from yirage.errors import YirageError

ENV = "YIRAGE_CUDA_KERNELS"
LANGUAGES = ("cuda", "triton")
KERNEL_CLASSES = {Pointwise: "pointwise", Row: "row", Matmul: "matmul", Embedding: "embedding",
                  Attention: "attention"}
CLASS_NAMES = tuple(KERNEL_CLASSES.values())
CUDA_SUFFIXES = ("", "_pro", "_full")  # what the C-family renderer appends to a plan kernel's name
TRITON_SCRATCH = "triton:"  # prefix of the Triton rendering's scratch buffers in a mixed plan's metadata


class KernelLanguageError(YirageError, ValueError):
    """A kernel-language setting that names an unknown language or kernel class."""


def parse_kernel_languages(value: str | Mapping[str, str] | None, where: str = ENV) -> dict[str, str]:
    """The language of every kernel class from ``"cuda"``, ``"triton"``, ``"matmul=triton,row=cuda"`` or a mapping.

    Unset or empty means all ``cuda``; anything else unknown raises KernelLanguageError naming the valid values.
    """
    valid = (f"use 'cuda' (the default), 'triton', or class=language pairs separated by commas over the classes "
             f"{', '.join(CLASS_NAMES)} with languages {' or '.join(LANGUAGES)} (e.g. 'matmul=triton,row=cuda')")
    result = dict.fromkeys(CLASS_NAMES, "cuda")
    if value is None:
        return result
    if isinstance(value, str):
        text = value.strip().lower()
        if not text:
            return result
        if text in LANGUAGES:
            return dict.fromkeys(CLASS_NAMES, text)
        pairs = []
        for item in text.split(","):
            cls, eq, lang = (part.strip() for part in item.partition("="))
            if not eq:
                raise KernelLanguageError(f"{where}={value!r}: {item.strip()!r} is neither a language nor a "
                                          f"class=language pair; {valid}")
            pairs.append((cls, lang))
    elif isinstance(value, Mapping):
        pairs = [(str(k).strip().lower(), str(v).strip().lower()) for k, v in value.items()]
    else:
        raise KernelLanguageError(f"{where} must be a string or a mapping of kernel class to language, got "
                                  f"{type(value).__name__}; {valid}")
    seen = set()
    for cls, lang in pairs:
        if cls not in result:
            raise KernelLanguageError(f"{where}={value!r}: unknown kernel class {cls!r}; {valid}")
        if lang not in LANGUAGES:
            raise KernelLanguageError(f"{where}={value!r}: unknown language {lang!r} for {cls}; {valid}")
        if cls in seen:
            raise KernelLanguageError(f"{where}={value!r}: kernel class {cls} is set twice; {valid}")
        seen.add(cls)
        result[cls] = lang
    return result


def from_env() -> dict[str, str]:
    """The setting of ``YIRAGE_CUDA_KERNELS`` (read when a plan is rendered, so a change applies to later compiles)."""
    return parse_kernel_languages(os.environ.get(ENV))


def kernel_class(kernel: Kernel) -> str:
    """The class name (``pointwise``, ``row``, ...) of a plan kernel."""
    for cls, name in KERNEL_CLASSES.items():
        if isinstance(kernel, cls):
            return name
    raise KernelLanguageError(f"plan kernel {kernel.name} is a {type(kernel).__name__}, which has no kernel class "
                              f"({', '.join(CLASS_NAMES)}): a yirage version mismatch; reinstall yirage_backend_cuda "
                              "with the same yirage")


def choose(plan: KernelPlan, by_class: Mapping[str, str]) -> dict[str, str]:
    """The language of each plan kernel (by name, in plan order) under a class -> language setting."""
    return {k.name: by_class.get(kernel_class(k), "cuda") for k in plan.kernels}


def owner(launch: str, kernels: list[str]) -> str:
    """The plan kernel a CUDA launch belongs to (``k``, ``k_pro``, ``k_full``), or KernelLanguageError."""
    found = [k for k in kernels if any(launch == k + suffix for suffix in CUDA_SUFFIXES)]
    if len(found) != 1:
        raise KernelLanguageError(f"the CUDA kernel {launch!r} belongs to {found or 'no'} plan kernel(s) of "
                                  f"{kernels}: the C-family renderer's names changed; a bug, report it with the "
                                  f"graph (g.to_json()) and set {ENV}=cuda meanwhile")
    return found[0]


__all__ = ["CLASS_NAMES", "ENV", "KERNEL_CLASSES", "LANGUAGES", "TRITON_SCRATCH", "KernelLanguageError",
           "choose", "from_env", "kernel_class", "owner", "parse_kernel_languages"]
