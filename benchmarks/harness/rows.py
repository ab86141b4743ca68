"""One results row in docs/benchmarks.md's format, from the side-by-side times of one op at one shape: the
installed benchmark's row (``flashoverlap.bench.op_row``) with the harness's figures added."""

from __future__ import annotations

import torch

from flashoverlap.bench import efficiency, op_row
from flashoverlap.plan import Plan


def plan_summary(plan: Plan) -> dict:
    return {"path": plan.path, "groups": plan.num_groups, "programs": plan.grid_size, "comm_ctas": plan.comm_ctas,
            "sequential": plan.sequential, "gemm": plan.gemm,
            "tile": [plan.tile.block_m, plan.tile.block_n, plan.tile.block_k, plan.tile.group_m]}


def result_row(op: str, shape: tuple[int, int, int], dtype: torch.dtype, t: dict[str, float],
               decomposition: dict[int, float], async_tp: float | None, plan: Plan,
               host_us: dict[str, float] | None = None) -> dict:
    """``t`` holds the medians named gemm, comm, seq, ours and, where measured, our_gemm; ``host_us`` the host
    time per call of sequential and ours."""
    our_gemm = t.get("our_gemm")
    return {"path": plan.path, **op_row(op, shape, dtype, t, host_us), "t_our_gemm_ms": our_gemm,
            "our_gemm_vs_cublas": t["gemm"] / our_gemm if our_gemm else None,
            "baselines": {"decomposition_ms": min(decomposition.values()) if decomposition else None,
                          "decomposition_by_chunks_ms": decomposition, "async_tp_ms": async_tp},
            "plan": plan_summary(plan)}


def add_default(row: dict, t_default: float, plan: Plan) -> None:
    """Add to ``row`` (whose plan came from the plan cache) the hand-set default plan's time, timed side by side
    in the same run, its E and its plan: issue 5's "E with the cache no lower than with hand-set plans"."""
    row["t_default_ms"] = t_default
    row["E_default"] = efficiency(row["t_seq_ms"], t_default, row["t_ideal_ms"])
    row["plan_default"] = plan_summary(plan)


def add_auto(row: dict, t_auto: float, path: str, plan: Plan, host_us: float | None) -> None:
    """Add to ``row`` what a user gets from a plain call (``path="auto"``, no plan), timed side by side in the same
    run: its time, E, speedup, path, plan and host time per call."""
    row["auto"] = {"t_ms": t_auto, "E": efficiency(row["t_seq_ms"], t_auto, row["t_ideal_ms"]),
                   "speedup": row["t_seq_ms"] / t_auto, "path": path, "plan": plan_summary(plan),
                   "host_us": host_us}
