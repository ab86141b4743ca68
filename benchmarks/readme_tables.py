"""Render results files as the README's markdown tables (so the README's figures are the files', not retyped).

    python benchmarks/readme_tables.py bench benchmarks/results/h200x2-nvlink-tuned.json ...
    python benchmarks/readme_tables.py model benchmarks/results/h200x2-nvlink-model.json ...
"""

from __future__ import annotations

import json
import sys

OPS = {"all_reduce": "gemm_all_reduce", "reduce_scatter": "gemm_reduce_scatter", "all_gather": "all_gather_gemm"}


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _plan(plan: dict) -> str:
    if plan["sequential"]:
        return "sequential"
    where = "cuBLAS bands" if plan.get("gemm") == "cublas" else f"{plan['programs']} programs"
    ctas = f", {plan['comm_ctas']} NCCL CTAs" if plan.get("comm_ctas") else ""
    return f"{plan['groups']} groups, {where}{ctas}"


def _rows(paths: list[str]):
    """Each results file's rows, with the file's setting."""
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for row in data["rows"]:
            yield data["meta"]["setting"], row


def bench_table(paths: list[str]) -> str:
    """Benchmark rows; where a row's plan came from the plan cache, the hand-set plan's T and E timed beside it."""
    lines = ["| setting | op | path | M, N, K | T_gemm | our GEMM | T_comm | T_seq | best decomp. | async TP | **T** "
             "| E | plan | hand-set T | hand-set E |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, row in _rows(paths):
        base = row["baselines"]
        hand_t, hand_e = row.get("t_default_ms"), row.get("E_default")
        lines.append(
            f"| {setting} | {OPS[row['op']]} | {row['path']} | {row['M']}, {row['N']}, {row['K']} "
            f"| {_ms(row['t_gemm_ms'])} | {_ms(row['t_our_gemm_ms'])} | {_ms(row['t_comm_ms'])} "
            f"| {_ms(row['t_seq_ms'])} | {_ms(base['decomposition_ms'])} | {_ms(base['async_tp_ms'])} "
            f"| **{_ms(row['t_ms'])}** | {row['E']:+.2f} | {_plan(row['plan'])} "
            f"| {_ms(hand_t) if hand_t is not None else 'same plan'} "
            f"| {f'{hand_e:+.2f}' if hand_e is not None else '-'} |")
    return "\n".join(lines)


def model_table(paths: list[str]) -> str:
    """Model-check rows: predicted against measured T of the model's pick, the pick against the exhaustive best."""
    lines = ["| setting | op | M, N, K | predicted | measured | error | model's pick | exhaustive best | pick / best "
             "| candidates |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, row in _rows(paths):
        error = (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
        ratio = row["model_pick_ms"] / row["exhaustive_best_ms"]
        lines.append(
            f"| {setting} | {OPS[row['op']]} | {row['M']}, {row['N']}, {row['K']} "
            f"| {_ms(row['predicted_ms'])} | {_ms(row['measured_ms'])} | {100 * error:+.1f}% "
            f"| {row['model_pick_plan']} | {row['exhaustive_best_plan']} | {ratio:.3f} | {len(row['all'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    kind, files = sys.argv[1], sys.argv[2:]
    print(bench_table(files) if kind == "bench" else model_table(files))
