"""fork() after a backend started threads: the child gets an error naming the fix, never a hang (issue 28).

A PoCL OpenCL runtime, GNU OpenMP (torch's and numba's threads) keep worker threads that fork() does not copy;
in the child the first call waits for them forever and SIGINT does not get it out. Each scenario runs in a fresh
interpreter that forks; the parent waits for the child with a deadline, so a hang fails the test instead of the
run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import os, time
pid = os.fork()
if pid == 0:
    try:
        child()
        print("child ran", flush=True)
    except Exception as exc:
        print("child raised", type(exc).__name__, exc, flush=True)
    os._exit(0)
deadline = time.time() + 60
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    print("child HUNG", flush=True)
"""


def forked(setup: str) -> str:
    code = textwrap.dedent(setup) + CHILD
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def test_an_opencl_graph_in_a_forked_child_raises_instead_of_hanging() -> None:
    pytest.importorskip("pyopencl")
    import yirage as yr

    if "opencl" not in [str(b) for b in yr.get_available_backends()]:
        pytest.skip("no OpenCL device here")
    out = forked("""
        import torch, yirage as yr
        g = yr.new_kernel_graph(backend="opencl")
        g.mark_output(g.exp(g.new_input((64,))))
        x = torch.randn(64)
        assert torch.allclose(g(inputs=[x])[0], x.exp())
        def child():
            g(inputs=[x])
    """)
    assert "child raised OpenCLForkError" in out and "'spawn'" in out and "child exit 0" in out, out
    out = forked("""
        import torch, yirage as yr
        g = yr.new_kernel_graph(backend="opencl")
        g.mark_output(g.exp(g.new_input((64,))))
        g(inputs=[torch.randn(64)])
        def child():  # a new graph: its compile touches the device too
            h = yr.new_kernel_graph(backend="opencl")
            h.mark_output(h.sqrt(h.new_input((32,))))
            h(inputs=[torch.rand(32)])
    """)
    assert "child raised OpenCLForkError" in out and "child exit 0" in out, out


def test_a_cpu_generate_in_a_forked_child_raises_fork_error_before_the_prefill() -> None:
    pytest.importorskip("numba")
    pytest.importorskip("transformers")
    out = forked("""
        import sys, tempfile, torch
        from pathlib import Path
        sys.path.insert(0, "tests")
        from llm_oracle import zoo_model
        from yirage.engine import GenerationConfig, InferEngine
        model = zoo_model("llama-gqa", torch.float32, Path(tempfile.mkdtemp()))
        engine = InferEngine(model.path, backend="cpu")
        config = GenerationConfig(max_new_tokens=4, eos_token_id=())
        engine.generate(model.reference.ids, config)
        def child():
            engine.generate(model.reference.ids, config)
    """)
    assert "child raised ForkError" in out and "spawn" in out and "child exit 0" in out, out
