"""The benchmark's results rows and table, on made-up times (the timing itself needs GPUs)."""

import torch

import flashoverlap as fo
from benchmarks.harness.rows import efficiency, result_row
from benchmarks.ops import print_table


def _times(ours):
    return {"gemm": 1.0, "our_gemm": 1.05, "comm": 0.5, "seq": 1.5, "ours": ours}


def test_rows_carry_the_plans_path_and_the_efficiency():
    nccl = fo.default_plan("all_gather", 4096, 4096, 4096, 2, allow_sequential=False)
    p2p = fo.default_plan("all_gather", 4096, 4096, 4096, 2, path="p2p")
    rows = [result_row("all_gather", (4096, 4096, 4096), torch.bfloat16, _times(1.25), {2: 1.4}, 1.3, nccl,
                       {"seq": 200.0, "ours": 900.0}),
            result_row("all_gather", (4096, 4096, 4096), torch.bfloat16, _times(1.05), {2: 1.4}, 1.3, p2p)]
    assert [r["path"] for r in rows] == ["nccl", "p2p"]
    assert rows[0]["E"] == efficiency(1.5, 1.25, 1.0) == 0.5
    assert abs(rows[1]["E"] - 0.9) < 1e-12
    assert rows[0]["baselines"]["decomposition_ms"] == 1.4 and rows[0]["host_us"] == {"seq": 200.0, "ours": 900.0}
    assert rows[1]["plan"]["programs"] == 132 and rows[1]["host_us"] is None


def test_table_has_one_block_per_op_and_path(capsys):
    plans = {path: fo.default_plan("all_gather", 4096, 4096, 4096, 2, path=path, allow_sequential=False)
             for path in ("nccl", "p2p")}
    rows = [result_row("all_gather", (4096, 4096, 4096), torch.bfloat16, _times(1.2), {2: 1.4}, None, plans[p])
            for p in ("nccl", "p2p")]
    print_table(rows, {"gpus": "2x test", "setting": "nvlink"})
    out = capsys.readouterr().out
    assert "all_gather_gemm, path nccl" in out and "all_gather_gemm, path p2p" in out
    assert out.count("  4096x  4096x  4096") == 2


def test_a_tuned_row_carries_the_hand_set_plan_timed_beside_it():
    from benchmarks.harness.rows import add_default

    tuned = fo.default_plan("all_reduce", 4096, 4096, 4096, 2, num_groups=3, allow_sequential=False)
    hand = fo.default_plan("all_reduce", 4096, 4096, 4096, 2, num_groups=6, comm_ctas=8, allow_sequential=False)
    row = result_row("all_reduce", (4096, 4096, 4096), torch.bfloat16, _times(1.2), {2: 1.4}, None, tuned)
    add_default(row, 1.35, hand)
    assert row["t_default_ms"] == 1.35 and abs(row["E_default"] - 0.3) < 1e-12
    assert row["plan_default"]["groups"] == 6 and row["plan_default"]["comm_ctas"] == 8 and row["plan"]["groups"] == 3


def test_paired_figures_are_medians_of_each_rounds_difference_and_ratio():
    from benchmarks.harness.timing import paired_figures

    # Medians apart: 3 - 1 = 2 s. Round by round the call costs 0.5, 1 and 2 s more (median 1 s) and 2x, 1.11x and
    # 3x as much (median 2x): a slow round moves both calls, and the paired figures with them.
    times = {"ours": [1.0, 10.0, 3.0], "base": [0.5, 9.0, 1.0], "other": [0.0, 0.0, 0.0]}
    figures = paired_figures(times, (("ours", "base"),))
    assert figures == {"ours - base": 1e6, "ours / base": 2.0}
    assert paired_figures(times, ()) == {}


def test_interleaved_rounds_run_each_name_right_after_each_other_equally_often():
    from collections import Counter
    from itertools import permutations

    from benchmarks.harness.timing import cycle_rounds, round_order

    for count in (1, 2, 3, 4, 5, 12, 13):
        names = [f"part{i}" for i in range(count)]
        rounds = 3 * cycle_rounds(count)
        orders = [round_order(names, r) for r in range(rounds)]
        assert all(sorted(order) == sorted(names) for order in orders), "every round times each name once"
        follows = Counter((order[i], order[i + 1]) for order in orders for i in range(count - 1))
        pairs = list(permutations(names, 2))
        assert set(follows) == set(pairs), "some name never runs right after some other"
        assert len({follows[pair] for pair in pairs}) <= 1, follows
        firsts = Counter(order[0] for order in orders)
        assert set(firsts) == set(names) and len(set(firsts.values())) == 1, firsts
