"""The model check's rows (``python -m benchmarks.model_check``, what ``tune validate`` was), on made-up
measurements: the pick is what ``tune plan`` would cache, against the exhaustive best."""

import pytest

from benchmarks.model_check import model_check_row, model_check_summary
from flashoverlap.tune.search import candidates


def test_model_check_row_takes_the_pick_tune_plan_would_cache():
    plans = candidates("all_reduce", 8192, 8192, 8192, 2, 132)
    seq = next(p for p in plans if p.sequential)
    overlapped = [p for p in plans if not p.sequential][:5]

    def record(plan, predicted, measured):
        return {"plan": plan.to_dict(), "predicted_ms": predicted, "measured_ms": measured}

    # The model's order: three overlapped plans, then two more, then sequential. The second is the fastest of the
    # top three; the fifth is the exhaustive best.
    records = [record(overlapped[0], 1.0, 1.30), record(overlapped[1], 1.1, 1.20), record(overlapped[2], 1.2, 1.25),
               record(overlapped[3], 1.3, 1.40), record(overlapped[4], 1.4, 1.10), record(seq, 1.5, 1.5)]
    row = model_check_row("all_reduce", "nccl", 8192, 8192, 8192, records)
    assert (row["predicted_ms"], row["measured_ms"], row["model_pick_ms"]) == (1.1, 1.20, 1.20)
    assert row["exhaustive_best_ms"] == 1.10 and row["model_top1_ms"] == 1.30
    # Sequential wins unless beaten by more than the margin, even from outside the model's top three.
    records[-1] = record(seq, 1.5, 1.21)
    assert model_check_row("all_reduce", "nccl", 8192, 8192, 8192, records)["model_pick_plan"] == "sequential"
    figures = model_check_summary([row, {**row, "predicted_ms": 1.32, "exhaustive_best_ms": 1.17}])
    assert figures["mean_error"] == pytest.approx((0.1 / 1.2 + 0.12 / 1.2) / 2)
    assert figures["max_error"] == pytest.approx(0.1) and figures["picks_within_3pct"] == 1  # 1.20 <= 1.03 * 1.17


def test_model_check_pick_includes_the_hand_set_plan_tune_plan_always_times():
    plans = candidates("all_gather", 8192, 28672, 8192, 2, 132, path="p2p")
    seq = next(p for p in plans if p.sequential)
    others = [p for p in plans if not p.sequential][:4]

    def record(plan, measured, hand_set=False):
        return {"plan": plan.to_dict(), "predicted_ms": 5.0, "measured_ms": measured, "hand_set": hand_set}

    records = [record(others[0], 5.2), record(others[1], 5.3), record(others[2], 5.25), record(seq, 5.2),
               record(others[3], 5.0, hand_set=True)]
    row = model_check_row("all_gather", "p2p", 8192, 28672, 8192, records)
    assert row["model_pick_ms"] == 5.0 and row["exhaustive_best_ms"] == 5.0
    records[-1]["hand_set"] = False  # not timed by tune plan: sequential stays (the others are within 2%)
    assert model_check_row("all_gather", "p2p", 8192, 28672, 8192, records)["model_pick_plan"] == "sequential"
