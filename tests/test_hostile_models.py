"""Hostile model files (issue 28): each is refused with a clear error before it can cost memory or time.

A file or config.json declaring huge sizes must be refused before anything is allocated for them, so those
scenarios run in a child process with an address-space limit and a timeout: before the fixes they grew to
gigabytes (or ran on), and the child fails fast instead of eating the machine. A chat template is code from the
model file: it is rendered in jinja2's sandbox within limits. Broken tokenizer metadata is refused at load
instead of failing every generate() at the end.
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from yirage.engine import ChatTemplateError, InferEngine, render_chat_template
from yirage.models.config import LlamaConfig, ModelError
from yirage.models.gguf import MAX_ARRAY_LEN, GGUFError, read_gguf
from yirage.models.llama import LlamaModel

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from test_gguf import BYTE_TOKENS, CHAT_TEMPLATE, TINY, random_hf_model, write_gguf  # noqa: E402 - needs gguf

V = gguf.GGUFValueType
ROOT = Path(__file__).resolve().parent.parent
LIMIT = 3 << 30  # address space for a child: importing torch takes about 0.7 GiB of it
NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def run_limited(code: str, *args: str, timeout: float = 90) -> Any:
    """Run ``code`` in a child with at most LIMIT bytes of address space; its last stdout line, parsed as JSON."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))\n"
    try:
        done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args], capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s (under a {LIMIT >> 30} GiB limit)")
    assert done.returncode == 0, f"the child failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


REFUSAL = """
import json, sys, time
from yirage.errors import YirageError
start = time.monotonic()
try:
    {call}
    print(json.dumps({{"error": None}}))
except YirageError as exc:
    print(json.dumps({{"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}}))
"""


# -- files declaring sizes they do not hold -------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_model() -> torch.nn.Module:
    return random_hf_model("llama")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(**{**TINY, "head_dim": 16})
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def edited_config(hf_dir: Path, tmp_path: Path, **changes) -> Path:
    path = tmp_path / "m"
    shutil.copytree(hf_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))
    return path


def test_a_gguf_declaring_2_31_layers_is_refused_before_any_allocation(tmp_path, llama_model) -> None:
    """Was: ~7.6 GB of per-layer bookkeeping, then a MemoryError after 50 s."""
    path = write_gguf(tmp_path / "layers.gguf", llama_model, metadata={"llama.block_count": (2**31, V.UINT32)})
    got = run_limited(REFUSAL.format(call="from yirage.models.gguf import read_gguf; read_gguf(sys.argv[1])"),
                      str(path))
    assert got["error"] == "GGUFError"
    assert "llama.block_count=2147483648" in got["message"] and "only 2 of those layers" in got["message"]


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 exceeds 4096"),
    ({"num_attention_heads": 2**28, "num_key_value_heads": 2**28}, "num_attention_heads=268435456 exceeds 4096"),
])
def test_a_config_json_declaring_huge_sizes_is_refused_before_any_allocation(hf_dir, tmp_path, changes,
                                                                             message) -> None:
    """Was: 7+ GB (per-layer shapes, per-head q/k/v regrouping) before any shape was checked."""
    path = edited_config(hf_dir, tmp_path, **changes)
    got = run_limited(REFUSAL.format(
        call="from yirage.models.llama import LlamaModel; LlamaModel.from_pretrained(sys.argv[1])"), str(path))
    assert got["error"] == "ModelError" and message in got["message"], got


def test_a_layer_count_the_checkpoint_does_not_back_is_refused(hf_dir, tmp_path) -> None:
    with pytest.raises(ModelError, match=r"num_hidden_layers=3000, but the checkpoint holds weights for only 2 "
                                         r"of those layers \(layers\.2\.\* is the first missing\)"):
        LlamaModel.from_pretrained(edited_config(hf_dir, tmp_path, num_hidden_layers=3000))
    with pytest.raises(ModelError, match="num_attention_heads=5000 exceeds 4096"):
        LlamaConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 5000, "num_key_value_heads": 5000,
                               "head_dim": 16, "vocab_size": 256})


def _text(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _text(key) + struct.pack("<I", vtype) + payload


def raw_gguf(path: Path, kvs: list[bytes], tensors: list[tuple[str, list[int], int, int]] = (),
             data: bytes = b"") -> Path:
    """A GGUF v3 file byte by byte, to declare what gguf.GGUFWriter would not write."""
    infos = b"".join(_text(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)
                     for name, dims, kind, offset in tensors)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + infos
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return path


def test_a_40_mb_metadata_array_of_10_7_values_is_refused_at_once(tmp_path) -> None:
    """Was: 104 s and 6.9 GB inside gguf.GGUFReader (about 0.7 KB per array value)."""
    n = 10**7
    path = raw_gguf(tmp_path / "array.gguf", [
        _kv("general.architecture", V.STRING, _text("llama")),
        _kv("tokenizer.ggml.scores", V.ARRAY, struct.pack("<IQ", V.FLOAT32, n) + np.zeros(n, "<f4").tobytes())])
    assert path.stat().st_size > 40_000_000
    got = run_limited(REFUSAL.format(call="from yirage.models.gguf import open_gguf; open_gguf(sys.argv[1])"),
                      str(path))
    assert got["error"] == "GGUFError", got
    assert f"'tokenizer.ggml.scores' is an array of {n} values, more than the {MAX_ARRAY_LEN}" in got["message"]
    assert got["seconds"] < 5


def test_a_tensor_declaring_more_bytes_than_the_file_holds_is_refused(tmp_path) -> None:
    path = raw_gguf(tmp_path / "tensor.gguf", [_kv("general.architecture", V.STRING, _text("llama"))],
                    [("token_embd.weight", [64, 2**40], gguf.GGMLQuantizationType.F32, 0)], b"\0" * 256)
    with pytest.raises(GGUFError, match=r"tensor 'token_embd.weight' \(F32, shape \[64, 1099511627776\]\) declares "
                                        r"281474976710656 bytes at offset \d+, past the end of the file"):
        read_gguf(path)


# -- chat templates: sandboxed and bounded ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory, llama_model) -> Path:
    return write_gguf(tmp_path_factory.mktemp("chat") / "chat.gguf", llama_model, tokenizer=True,
                      chat_template=CHAT_TEMPLATE)


@pytest.fixture
def chat_engine(chat_gguf):
    engine = InferEngine(chat_gguf, backend="reference")
    yield engine
    engine.tokenizer.chat_template = CHAT_TEMPLATE


TEMPLATES_IN_A_CHILD = """
import json, sys, time
from yirage.engine import InferEngine
from yirage.errors import YirageError
engine = InferEngine(sys.argv[1], backend="reference")
out = []
for template in json.loads(sys.argv[2]):
    engine.tokenizer.chat_template = template
    start = time.monotonic()
    try:
        engine.apply_chat_template([{"role": "user", "content": "Hi"}])
        out.append({"error": None})
    except YirageError as exc:
        out.append({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start})
print(json.dumps(out))
"""


def test_costly_templates_stop_with_a_clear_error(chat_gguf) -> None:
    """Was: nested range() loops still rendering after 60 s (jinja2's sandbox allows 100000 items per range, so
    10**10 in two loops), and one expression could take gigabytes. Run in a child under a memory limit."""
    costly = {"{{ 'x' * 10**9 }}": "repeats a str", "{{ 10 ** 100000000 }}": "over 65536 bits",
              "{{ '%999999999d' % 1 }}": "wider than 4096", "{{ '{:>999999999}'.format(1) }}": "wider than 4096",
              NESTED_RANGES + "x": "loops without bound", "{% for i in range(100000) %}" + "y" * 40 +
              "{% endfor %}": "output grows without bound"}
    got = run_limited(TEMPLATES_IN_A_CHILD, str(chat_gguf), json.dumps(list(costly)))
    for (template, message), result in zip(costly.items(), got, strict=True):
        assert result["error"] == "ChatTemplateError" and message in result["message"], (template, result)
        assert "pass the prompt without the chat template" in result["message"] and result["seconds"] < 15


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}", r"chat template is malformed: Unexpected end of template.*\(line 1\)"),
    ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses without bound"),
    ("{{ messages.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'"),
])
def test_bad_templates_are_clear_yirage_errors(chat_engine, template, message) -> None:
    """Was: raw jinja2 errors (TemplateSyntaxError, TemplateError, SecurityError) or a RecursionError."""
    chat_engine.tokenizer.chat_template = template
    with pytest.raises(ChatTemplateError, match=message) as info:
        chat_engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "fix the model's chat template" in str(info.value) and "messages=[...]" in str(info.value)


CHATML = ("{% set ns = namespace(sys=false) %}{% for m in messages %}{% if m.role == 'system' %}"
          "{% set ns.sys = true %}{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + "
          "'<|im_end|>\n' }}{% if loop.last and not add_generation_prompt %}{% break %}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ bos_token }}{{ messages | tojson }}"
          "{% for i in range(messages | length - 1, -1, -1) %}[{{ i }}]{% endfor %}")


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHATML])
def test_rendering_matches_transformers(chat_engine, template) -> None:
    tokenizer = chat_engine.tokenizer
    tokenizer.chat_template = template
    chats = [[{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi ü"}]]
    assert render_chat_template(tokenizer, chats) == [
        tokenizer.apply_chat_template(chats[0], add_generation_prompt=True, tokenize=False)]


# -- tokenizer metadata that fails only at the end of generate() -------------------------------------------------
@pytest.mark.parametrize("metadata, message", [
    ({"tokenizer.ggml.eos_token_id": (999, V.UINT32)}, "tokenizer.ggml.eos_token_id=999 is not a token id"),
    ({"tokenizer.ggml.bos_token_id": (256, V.UINT32)}, r"tokenizer.ggml.bos_token_id=256 .*ids 0..255"),
    ({"tokenizer.ggml.padding_token_id": (300, V.UINT32)}, "tokenizer.ggml.padding_token_id=300"),
    ({"tokenizer.ggml.tokens": (BYTE_TOKENS[:100], V.ARRAY)}, "has 100 tokens, fewer than the 256 rows"),
    ({"tokenizer.ggml.tokens": (list(range(256)), V.ARRAY)}, "must be an array of strings.*got ARRAY/INT32"),
])
def test_bad_tokenizer_metadata_is_refused_at_load(tmp_path, llama_model, metadata, message) -> None:
    """Was: loaded, then every generate() failed at the end with a raw IndexError/TypeError from transformers."""
    path = write_gguf(tmp_path / "tok.gguf", llama_model, tokenizer=True, metadata=metadata)
    with pytest.raises(GGUFError, match=message):
        LlamaModel.from_gguf(path)


def test_a_head_count_that_does_not_divide_the_hidden_size_says_so(tmp_path, llama_model) -> None:
    """Was: "differs from the head size 0"."""
    path = write_gguf(tmp_path / "heads.gguf", llama_model, metadata={"llama.attention.head_count": (3, V.UINT32)})
    with pytest.raises(GGUFError, match=r"llama.embedding_length=64 is not divisible by "
                                        r"llama.attention.head_count=3 \(64 / 3 = 21.3333\)"):
        read_gguf(path)


# -- unreadable checkpoints, and the files --make-random-model writes ------------------------------------------
def test_an_unreadable_checkpoint_reports_the_real_os_error(hf_dir, tmp_path, monkeypatch) -> None:
    """Was: safetensors' "No such device" / "No such file or directory"."""
    folder = tmp_path / "folder"
    shutil.copytree(hf_dir, folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(ModelError, match=r"cannot read .*model.safetensors: Is a directory \(IsADirectoryError"):
        LlamaModel.from_pretrained(folder)

    locked = tmp_path / "locked"
    shutil.copytree(hf_dir, locked)
    real_open = builtins.open

    def deny(file, *args, **kwargs):
        if str(file) == str(locked / "model.safetensors"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)  # root reads any file: simulate a file this user may not read
    with pytest.raises(ModelError, match=r"cannot read .*model.safetensors: Permission denied \(PermissionError"):
        LlamaModel.from_pretrained(locked)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_make_random_model_files_follow_the_umask(tmp_path, umask) -> None:
    """Was: model.safetensors 0600, the other files 0644."""
    spec = importlib.util.spec_from_file_location("yirage_demo_generate", ROOT / "demo" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    old = os.umask(umask)
    try:
        generate.make_random_model(tmp_path / "m", "tiny", overwrite=True)
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
