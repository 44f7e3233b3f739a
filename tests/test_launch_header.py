"""The launch header (``yirage.codegen.launch``): one line on top of a rendered source, read back as written.

Every backend's render stage writes it and its load stage reads it, so a header that does not round-trip, or a
damaged one that is not refused with the file named, breaks every backend at once.
"""

from __future__ import annotations

import json

import pytest

import yirage as yr
from yirage.codegen.cstyle import render
from yirage.codegen.dialects import dialect
from yirage.codegen.launch import (
    C_COMMENT,
    PYTHON_COMMENT,
    Check,
    Gemm,
    Launch,
    LaunchHeader,
    LaunchHeaderError,
    Scratch,
    TritonLaunch,
)
from yirage.codegen.triton import render_triton
from yirage.compiler.lower import build_plan


def plan_with_a_gemm_step() -> object:
    """An embedding (a status check) and a matmul large enough for a ``host_gemm`` dialect's Gemm step."""
    g = yr.new_kernel_graph()
    ids, table, w = g.new_input((4,), dtype=yr.int64), g.new_input((50, 128)), g.new_input((128, 256))
    x = g.embedding(ids, table)
    g.mark_output(g.relu(g.matmul(g.new_input((16, 128)), w)))
    g.mark_output(x)
    return build_plan(g)


def test_a_c_family_header_round_trips_with_gemm_steps_checks_and_extra_fields() -> None:
    plan = plan_with_a_gemm_step()
    rendered = render(plan, dialect("cuda"))
    assert any(isinstance(s, Gemm) for s in rendered.steps) and any(x.check for x in rendered.launches)
    header = LaunchHeader.of(plan, rendered.launches, rendered.scratch, rendered.steps, work=12345)
    source = header.write(rendered.source, C_COMMENT)
    first, _, body = source.partition("\n")
    assert body == rendered.source and first.startswith("// yirage-launch: {")
    back = LaunchHeader.read(source, "kernels.cu", C_COMMENT)
    assert back == header and back.extra == {"work": 12345}
    assert back.steps == rendered.steps and back.launches == rendered.launches and back.scratch == rendered.scratch


def test_steps_equal_to_the_launches_are_not_written_and_read_back_as_the_launches() -> None:
    plan = plan_with_a_gemm_step()
    rendered = render(plan, dialect("opencl"))  # no host_gemm: every kernel is a step
    header = LaunchHeader.of(plan, rendered.launches, rendered.scratch)
    assert '"steps"' not in header.line(C_COMMENT)
    assert LaunchHeader.read(header.write("", C_COMMENT), "x", C_COMMENT).steps == rendered.launches


def test_a_triton_header_round_trips_in_a_python_comment() -> None:
    plan = plan_with_a_gemm_step()
    rendered = render_triton(plan)
    header = LaunchHeader.of(plan, rendered.launches, rendered.scratch)
    source = header.write(rendered.source, PYTHON_COMMENT)
    assert source.startswith("# yirage-launch: {")
    back = LaunchHeader.read(source, "kernels.py", PYTHON_COMMENT)
    assert back == header and all(isinstance(x, TritonLaunch) for x in back.launches)
    with pytest.raises(LaunchHeaderError, match="kernels.py does not start with a launch header line"):
        LaunchHeader.read(source, "kernels.py", C_COMMENT)  # the other language's comment
    as_c = LaunchHeader.prefix(C_COMMENT) + source.removeprefix(LaunchHeader.prefix(PYTHON_COMMENT))
    with pytest.raises(LaunchHeaderError, match="kernels.cu is damaged .*KeyError: 'groups'"):
        LaunchHeader.read(as_c, "kernels.cu", C_COMMENT)  # Triton records where C-family ones belong
    with pytest.raises(ValueError, match="use C_COMMENT or PYTHON_COMMENT"):
        LaunchHeader.read(source, "kernels.py", "--")


def test_mixed_steps_refer_to_their_launches_by_name() -> None:
    plan = plan_with_a_gemm_step()
    cuda = Launch("k0", ("out0", "ids"), 2, 64, Check("st", "IndexError", "bad id at {pos}\nsecond line"))
    tri = TritonLaunch("k1", ("out1", "a"), 4, ((256, "BLOCK_N"),), (("BLOCK_N", 64),), 2)
    gemm = Gemm("k2", "a", (16, 128), (128, 1), "w", (128, 256), (256, 1), "out1", (16, 256), "float32", "k2_full")
    header = LaunchHeader.of(plan, [cuda], [Scratch("st", 1, "int32")], [cuda, tri, gemm], [tri], triton_chars=7)
    line = header.line(C_COMMENT)
    assert "\n" not in line  # one line, whatever the messages hold
    back = LaunchHeader.read(line, "mixed.cu", C_COMMENT)
    assert back == header and back.steps[1] is back.triton[0] and back.launches[0].check == cuda.check


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda line: line[: len(line) // 2], "JSONDecodeError"),  # cut short
    (lambda line: line.replace('"launches"', '"launchez"'), "KeyError: 'launches'"),
    (lambda line: line.replace('"groups":', '"groups":"many","x":'), "ValueError"),
    (lambda line: "// yirage-launch: [1, 2]", "TypeError"),
])
def test_a_damaged_header_is_refused_naming_the_file_and_the_problem(damage, problem) -> None:
    plan = plan_with_a_gemm_step()
    rendered = render(plan, dialect("cuda"))
    line = LaunchHeader.of(plan, rendered.launches, rendered.scratch, rendered.steps).line(C_COMMENT)
    with pytest.raises(LaunchHeaderError, match=f"launch header of /cache/x/kernels.cu is damaged .*{problem}"
                       ".*delete the compile-cache entry"):
        LaunchHeader.read(damage(line) + "\n__global__ void k() {}\n", "/cache/x/kernels.cu", C_COMMENT)


def test_a_step_naming_a_kernel_the_header_does_not_list_is_damage() -> None:
    plan = plan_with_a_gemm_step()
    rendered = render(plan, dialect("cuda"))
    data = json.loads(LaunchHeader.of(plan, rendered.launches, rendered.scratch, rendered.steps)
                      .line(C_COMMENT).removeprefix(LaunchHeader.prefix(C_COMMENT)))
    data["steps"].append({"kernel": "nowhere"})
    with pytest.raises(LaunchHeaderError, match="KeyError: 'nowhere'"):
        LaunchHeader.read(LaunchHeader.prefix(C_COMMENT) + json.dumps(data), "x.cu", C_COMMENT)


def test_a_source_without_a_header_is_refused_and_extra_fields_cannot_shadow_the_header() -> None:
    with pytest.raises(LaunchHeaderError, match=r"x.metal does not start with a launch header line \('// yirage"):
        LaunchHeader.read("kernel void k() {}\n", "x.metal", C_COMMENT)
    with pytest.raises(ValueError, match=r"\['outputs'\] would shadow"):
        LaunchHeader.of(plan_with_a_gemm_step(), [], [], outputs=["x"])
