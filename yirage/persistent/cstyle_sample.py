"""The sampling layer's kernel for the C-family PersistentKernel renderer (yirage.persistent.cstyle).

Temperature, top-k, nucleus top-p and one seeded draw per row, in one work-item per row: thresholds are
found by bisecting the order-preserving integer keys of the scores (32 passes over the vocabulary) instead
of sorting, so the kernel needs only the dialect's float-bits and unsigned spellings. Same semantics as the
CPU runtime's ``sample_row`` (xorshift64* stream seeded by seed, position and row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from yirage.errors import NotSupportedError
from yirage.persistent.cstyle_buffers import SCORES, STEP, PKLaunch, tensor_name
from yirage.persistent.specs import FloatCol, IntCol


class Renderer(Protocol):
    """What the sampling kernel uses of the C-family renderer (``cstyle._Renderer``, which passes itself)."""

    d: Any  # the Dialect
    p: Any  # the PersistentProgram
    scratch: dict[str, int]
    dtypes: dict[str, str]
    it: str
    f32: str
    i64: str

    def col(self, layer: int, column: IntCol) -> int: ...
    def fcol(self, layer: int, column: FloatCol) -> float: ...
    def arg(self, layer: int, role: str) -> str: ...
    def ctype(self, dtype: str) -> str: ...
    def f(self, value: float) -> str: ...
    def ids(self) -> Any: ...
    def kernel(self, base: str, params: Sequence[tuple[str, str, bool]], body: list[str], groups: int, local: int,
               layer: int = -1) -> PKLaunch: ...


def sample(self: Renderer, i: int) -> list[PKLaunch]:
    """Temperature, top-k, nucleus top-p, one seeded draw (xorshift64*); see the CPU runtime's sample_row."""
    if not self.d.bits or not self.d.unsigned:
        raise NotSupportedError(f"the {self.d.name} dialect has no float-bits or unsigned spellings, which the "
                                "sampling layer needs; add them to its dialect file or decode greedily")
    vocab, batch = self.col(i, IntCol.K), self.p.batch
    temperature, top_p = self.fcol(i, FloatCol.TEMPERATURE), self.fcol(i, FloatCol.TOP_P)
    top_k, seed = self.col(i, IntCol.TOP_K), self.col(i, IntCol.SEED)
    self.scratch[SCORES] = max(self.scratch[SCORES], batch * vocab)
    it, f32, i64 = self.it, self.f32, self.i64
    u32, u64 = self.d.unsigned["uint32"], self.d.unsigned["uint64"]
    inf = self.f(math.inf)
    score = f"{f32} s = x[row + c] / {self.f(temperature)}; if (s != s) s = -{inf};"
    key = f"{u32} u = {self.d.bits.format(x='s')}; {u32} key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);"
    loop = f"for ({it} c = 0; c < {vocab}; c++)"
    body = [
        f"{it} b = {self.ids()[0]};", f"if (b >= {batch}) return;",
        f"{it} row = b * {vocab};",
        f"{f32} mx = -{inf};",
        f"{loop} {{ {score} mx = s > mx ? s : mx; }}",
        f"if (mx == -{inf}) {{  // nothing to draw from: the argmax of the raw logits",
        f"    {f32} bv = x[row]; {i64} bi = 0;",
        f"    for ({it} c = 1; c < {vocab}; c++) {{ {f32} v = x[row + c]; "
        "if (bv == bv && (v > bv || v != v)) { bv = v; bi = c; } }",
        f"    out[b] = ({self.ctype(self.dtypes[tensor_name(self.col(i, IntCol.OUTPUT))])})bi; return;",
        "}",
        f"{u32} kth = 0;",
    ]
    if 0 < top_k < vocab:
        body += [
            "for (int bit = 31; bit >= 0; bit--) {  // the largest key with top_k scores at or above it",
            f"    {u32} cand = kth | (1u << bit); {i64} count = 0;",
            f"    {loop} {{ {score} {key} count += key >= cand ? 1 : 0; }}",
            f"    if (count >= {top_k}) kth = cand;",
            "}",
        ]
    body += [
        f"{f32} total = {self.f(0)};",
        f"{loop} {{",
        f"    {score} {key}",
        f"    {f32} pr = key < kth ? {self.f(0)} : (mx == {inf} ? (s == {inf} ? {self.f(1)} : {self.f(0)}) : "
        f"{self.d.math['exp']}(s - mx));",
        "    sc[row + c] = pr; total = total + pr;",
        "}",
        f"{u32} cut = 0;",
    ]
    if top_p < 1.0:
        # keep a score iff the mass ranked strictly above it is below top_p * total: cut = 1 + the largest
        # key K whose mass above K still reaches top_p * total (keys above every score reach nothing)
        mass_above = [f"{f32} m = {self.f(0)};", f"{loop} {{ {score} {key} if (key > cand) m = m + sc[row + c]; }}"]
        body += [
            f"{f32} want = {self.f(top_p)} * total;",
            "{",
            f"    {u32} cand = 0;",
            *(f"    {line}" for line in mass_above),
            "    if (m >= want) {",
            f"        {u32} lo = 0;",
            "        for (int bit = 31; bit >= 0; bit--) {",
            "            cand = lo | (1u << bit);",
            *(f"            {line}" for line in mass_above),
            "            if (m >= want) lo = cand;",
            "        }",
            "        cut = lo + 1u;",
            "    }",
            "}",
        ]
    out_type = self.ctype(self.dtypes[tensor_name(self.col(i, IntCol.OUTPUT))])
    body += [
        f"{f32} mass = {self.f(0)};",
        f"{loop} {{ {score} {key} if (key >= cut) mass = mass + sc[row + c]; }}",
        f"{u64} st = ({u64}){seed} * ({u64})1000003 + ({u64})step[b] * ({u64})7919 + ({u64})b * ({u64})104729 "
        f"+ ({u64})1;",
        "st ^= st >> 12; st ^= st << 25; st ^= st >> 27;",
        f"{f32} draw = ({f32})((st * ({u64})2685821657736338717) >> 40) * {self.f(1 / 16777216)} * mass;",
        f"{i64} pick = -1; {i64} last = 0;",
        f"{loop} {{",
        f"    {score} {key}",
        f"    {f32} pr = sc[row + c];",
        f"    if (key >= cut && pr > {self.f(0)}) {{ last = c; draw = draw - pr; "
        f"if (draw <= {self.f(0)}) {{ pick = c; break; }} }}",
        "}",
        f"out[b] = ({out_type})(pick >= 0 ? pick : last);",
    ]
    params = [("out", tensor_name(self.col(i, IntCol.OUTPUT)), True), ("sc", SCORES, True),
              ("x", self.arg(i, "input"), False), ("step", STEP, False)]
    return [self.kernel("y_sample", params, body, batch, 1, i)]
