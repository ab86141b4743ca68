"""The fp8 grouped-GEMM choice (``tune/grouped_fp8.py``) against what one H200 measured
(``benchmarks/results/h200x1-fp8-grouped.json``): on the configs it was fitted on and, above all, on those it was not
(the file's ``set: validate`` rows), the way it picks runs within 5% of the fastest of the three measured ways."""

import json
from pathlib import Path

import pytest

from flashoverlap.tune import grouped_fp8
from flashoverlap.tune.grouped import GroupedCall

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200x1-fp8-grouped.json"
TIMES = {"triton": "t_ours_ms", "cublas": "t_scaled_grouped_mm_ms", "loop": "t_loop_ms"}


def _rows():
    return [row for row in json.loads(RESULTS.read_text())["rows"] if row.get("t_ours_ms") is not None]


def _chosen_over_best(row) -> float:
    call = GroupedCall.balanced(row["experts"], row["rows"], row["K"], row["N"])
    way, _ = grouped_fp8.expert_gemm_fp8(call, row["scaling"], mode="exact", device_capability=(9, 0))
    measured = {w: row[key] for w, key in TIMES.items() if row.get(key) is not None}
    return measured[way] / min(measured.values())


@pytest.mark.parametrize("which", ["validate", "fit"])
def test_the_choice_is_within_five_percent_of_the_best_way(which):
    rows = [row for row in _rows() if row["set"] == which]
    assert rows, f"no '{which}' rows in {RESULTS.name}"
    worst = {f"{r['config']} {r['routing']} {r['scaling']}": round(_chosen_over_best(r), 3) for r in rows}
    assert max(worst.values()) <= 1.05, worst


def test_few_large_experts_go_to_the_loop_block_wise_and_only_where_the_sizes_are_on_the_host():
    big = GroupedCall.balanced(4, 16384, 6144, 32768)  # Mixtral-8x22B's up projection at W = 2
    small = GroupedCall.balanced(64, 32768, 2048, 1536)  # Qwen3-30B-A3B's
    assert grouped_fp8.expert_gemm_fp8(big, "block", mode="exact", device_capability=(9, 0))[0] == "loop"
    assert grouped_fp8.expert_gemm_fp8(big, "row", mode="exact", device_capability=(9, 0))[0] == "triton"
    assert grouped_fp8.expert_gemm_fp8(big, "block", mode="bounded", device_capability=(9, 0))[0] == "triton"
    assert grouped_fp8.expert_gemm_fp8(small, "block", mode="exact", device_capability=(9, 0))[0] == "triton"
    assert grouped_fp8.expert_gemm_fp8(small, "row", mode="bounded", device_capability=(9, 0),
                                       triton=False)[0] == "cublas"
