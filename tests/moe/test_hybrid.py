"""The hybrid expert GEMM (``comm/expert/chunked_gemm.py``: heavy experts a ``torch.mm`` per (source, expert) segment as
chunks land, light ones in one row-mapped Triton launch over every source's rows) without ranks: the heavy/light
split and the light row map from a layout's sizes, the policy that picks it, and, under the Triton interpreter in a
child process (``python -m tests.moe.test_hybrid``, which sets TRITON_INTERPRET before triton is imported), the
values: every chunk's heavy part then the light launch (dispatch's order) and the light launch first (combine's)
equal the plain per-segment product, and neither part writes the other's rows.
"""

import json
import os
import sys

if __name__ == "__main__":  # the child: interpret the kernels (before anything imports triton)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from flashoverlap.comm.expert import (  # noqa: E402
    ExpertPlan,
    HybridCut,
    Layout,
    chunked_gemm,  # noqa: E402
)
from flashoverlap.runtime import experts as runtime_experts  # noqa: E402
from flashoverlap.tune.grouped import HYBRID_CUT, hybrid_pays  # noqa: E402
from tests.interpreter import interpreted_lines, needs_interpreter  # noqa: E402

# Rows per (source, local expert) of a rank's receive layout at W = 3, L = 5: expert 0 heavy everywhere, expert 3
# heavy in sum only, expert 4 without rows, an empty segment inside a chunk, and a whole chunk (source 2) of light
# rows around one heavy segment.
COUNTS = [[30, 4, 0, 11, 0], [25, 9, 7, 12, 0], [3, 0, 6, 13, 0]]
HEAVY = 36  # the threshold these counts are cut at: experts 0 (58 rows) and 3 (36)
CUT = HybridCut(heavy_rows=HEAVY, light_flat_rows=256)


def exact_layout(counts) -> Layout:
    """A rank's exact-mode layout with the given receive counts (the send side is unused here)."""
    recv = torch.tensor(counts, dtype=torch.int64)
    world, local = recv.shape
    ends = recv.reshape(-1).cumsum(0)
    starts = ends - recv.reshape(-1)
    splits = tuple(int(v) for v in recv.sum(1))
    return Layout(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), recv.clone(), recv,
                  starts.to(torch.int32), ends.to(torch.int32), mode="exact", bound=None, top_k=1,
                  tokens=0, experts=world * local, send_splits=splits, recv_splits=splits,
                  max_pair_rows=max(splits))


def test_split_and_row_map():
    layout = exact_layout(COUNTS)
    heavy, light, per_expert = chunked_gemm.hybrid_split(layout, HEAVY)
    assert heavy == {0, 3} and light == [1, 2] and per_expert == [58, 13, 13, 36, 0]
    row_map, ends, experts = chunked_gemm.light_tables(layout, HEAVY)
    # Expert 1's rows from sources 0, 1 (rows 30..33, 45..53), then expert 2's from sources 1, 2 (54..60, 97..102).
    starts = torch.tensor(COUNTS).reshape(-1).cumsum(0) - torch.tensor(COUNTS).reshape(-1)
    want = []
    for e in light:
        for s in range(3):
            first = int(starts[s * 5 + e])
            want += list(range(first, first + COUNTS[s][e]))
    assert row_map.dtype == torch.int32 and row_map.tolist() == want
    assert ends.tolist() == [13, 26] and experts.tolist() == [1, 2]
    assert chunked_gemm.light_tables(layout, HEAVY)[0] is row_map  # made once per layout
    assert chunked_gemm.light_tables(exact_layout(COUNTS), 1) is None  # every expert with rows is heavy


def test_the_light_experts_on_the_device_are_the_hosts_at_every_threshold():
    """The light tables' experts are made on the device from the layout's own counts (no host list copied there,
    which would wait for the GPU): at every threshold, including each expert's own row count (``>=`` is heavy), they
    are the host split's light experts, in order."""
    for threshold in range(1, 61):
        layout = exact_layout(COUNTS)
        light = chunked_gemm.hybrid_split(layout, threshold)[1]
        tables = chunked_gemm.light_tables(layout, threshold)
        assert (None if tables is None else tables[2].tolist()) == (light or None), threshold
        if tables is not None:
            assert tables[1][-1].item() == tables[0].numel() == sum(sum(row[e] for row in COUNTS) for e in light)


def _plan(cut: HybridCut) -> ExpertPlan:
    return ExpertPlan("dispatch", 3, 15, 8, 8, 1, 0, gemm="hybrid", hybrid=cut)


def test_both_parts_read_one_split_also_when_the_threshold_changes():
    """The heavy set (the chunked part) and the light tables (the one launch) come from one cached entry per layout
    and threshold: every expert with rows is in exactly one part, whatever the calls in between."""
    layout = exact_layout(COUNTS)
    for threshold in (1, HEAVY, 10**6, HEAVY):
        heavy, tables = chunked_gemm.hybrid_parts(layout, threshold)
        light = [] if tables is None else tables[2].tolist()
        assert sorted([*heavy, *light]) == [0, 1, 2, 3] and not set(heavy) & set(light), (threshold, heavy, light)
        assert chunked_gemm.light_tables(layout, threshold) is tables
    b = torch.zeros(5, 8, 8)
    variant = chunked_gemm.light_variant(_plan(CUT), layout, b)
    assert variant is not None and variant == chunked_gemm.light_variant(_plan(CUT), exact_layout(COUNTS), b)
    assert variant != chunked_gemm.light_variant(_plan(CUT), layout, torch.zeros(5, 8, 16))  # another N
    # The light tile follows the plan's cut: the flattened loop once the light experts average 13 rows.
    assert variant != chunked_gemm.light_variant(_plan(HybridCut(HEAVY, 13)), layout, b)
    assert chunked_gemm.light_variant(_plan(HybridCut(1, 256)), layout, b) is None  # no light expert: nothing to load
    assert chunked_gemm.light_variant(ExpertPlan("dispatch", 3, 15, 8, 8, 1, 0, gemm="loop"), layout, b) is None


def test_policy_picks_the_hybrid_in_exact_mode_where_weights_bind(monkeypatch):
    assert hybrid_pays(experts=128, rows=32768) and hybrid_pays(experts=32, rows=32 * 512)
    assert not hybrid_pays(experts=64, rows=65536) and not hybrid_pays(experts=4, rows=100)
    monkeypatch.setattr(runtime_experts, "_triton_available", lambda: True)
    assert runtime_experts.choose_gemm("exact", 128, 32768, 7168, 4096, torch.bfloat16, (9, 0)) == "hybrid"
    assert runtime_experts.choose_gemm("bounded", 128, 32768, 7168, 4096, torch.bfloat16, (9, 0)) != "hybrid"
    assert runtime_experts.choose_gemm("exact", 64, 65536, 2048, 1536, torch.bfloat16, (9, 0)) != "hybrid"
    monkeypatch.setattr(runtime_experts, "_triton_available", lambda: False)
    assert runtime_experts.choose_gemm("exact", 128, 32768, 7168, 4096, torch.bfloat16, (9, 0)) == "loop"
    with pytest.raises(ValueError, match="gemm='hybrid' cannot run with mode='bounded'"):
        ExpertPlan("dispatch", 2, 4, 8, 8, 1, 3, "bounded", 3, "hybrid", hybrid=HYBRID_CUT)
    with pytest.raises(ValueError, match="gemm='hybrid' takes its cut"):
        ExpertPlan("dispatch", 2, 4, 8, 8, 1, 3, gemm="hybrid")
    with pytest.raises(ValueError, match="gemm='hybrid' takes its cut"):
        ExpertPlan("dispatch", 2, 4, 8, 8, 1, 3, gemm="loop", hybrid=HYBRID_CUT)
    with pytest.raises(ValueError, match="heavy_rows must be an int >= 1"):
        HybridCut(0, 256)


def run_values() -> list[dict]:
    """The child's cases: both orders of the two parts, fp16 and fp32, as the communicators call them."""
    rows = []
    for dtype in (torch.float16, torch.float32):
        gen = torch.Generator().manual_seed(3)
        layout = exact_layout(COUNTS)
        world, local = 3, 5
        total = sum(map(sum, COUNTS))
        k, n = 24, 20
        x = torch.randn(total, k, generator=gen).to(dtype)
        b = torch.randn(local, k, n, generator=gen).to(dtype)
        plan = ExpertPlan("dispatch", world, world * local, k, n, 1, 0, gemm="hybrid", hybrid=CUT)
        kind = chunked_gemm.chunk_gemm(plan, dtype, x.device)
        multiply = chunked_gemm.chunk_multiplier(kind, plan, layout, b, torch.arange(local, dtype=torch.int32))
        light = chunked_gemm.light_multiplier(kind, plan, layout, b)
        starts, ends = layout.recv_seg_starts.tolist(), layout.recv_seg_ends.tolist()
        want = torch.zeros(total, n, dtype=torch.float64)
        for i, (a, e) in enumerate(zip(starts, ends)):
            want[a:e] = x[a:e].double() @ b[i % local].double()
        heavy_rows = torch.zeros(total, dtype=torch.bool)
        for i, (a, e) in enumerate(zip(starts, ends)):
            heavy_rows[a:e] = (i % local) in (0, 3)
        at = [0, *torch.tensor(layout.recv_splits).cumsum(0).tolist()]
        result = {"dtype": str(dtype), "kind": kind, "light": light is not None}
        for order in ("dispatch", "combine"):
            out = torch.full((total, n), float("nan"), dtype=dtype)
            if order == "combine":
                light(x, out)
                result["light_only_heavy_untouched"] = bool(torch.isnan(out[heavy_rows]).all())
            for s in range(world):
                multiply(s, x, at[s], out, at[s], layout.recv_splits[s])
            if order == "dispatch":
                result["heavy_only_light_untouched"] = bool(torch.isnan(out[~heavy_rows]).all())
                light(x, out)
            result[f"{order}_nan"] = bool(torch.isnan(out).any())
            result[f"{order}_err"] = float((out.double() - want).norm() / want.norm())
        rows.append(result)
    return rows




@needs_interpreter
def test_values_under_the_interpreter():
    rows = interpreted_lines("tests.moe.test_hybrid", timeout=300)
    assert len(rows) == 2
    for row in rows:
        assert row["kind"] == "hybrid" and row["light"], row
        assert row["heavy_only_light_untouched"] and row["light_only_heavy_untouched"], row
        limit = 1e-5 if row["dtype"] == "torch.float32" else 2e-3
        for order in ("dispatch", "combine"):
            assert not row[f"{order}_nan"], (order, row)
            assert row[f"{order}_err"] < limit, (order, row)


if __name__ == "__main__":
    for result in run_values():
        print(json.dumps(result), flush=True)
    sys.exit(0)
