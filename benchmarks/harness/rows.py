"""One results row in docs/benchmarks.md's format, from the side-by-side times of one op at one shape."""

from __future__ import annotations

import torch

from flashoverlap.plan import Plan


def efficiency(t_seq: float, t: float, t_ideal: float) -> float:
    """docs/benchmarks.md's E: the share of the hideable time ``t_seq - t_ideal`` that ``t`` hid."""
    return (t_seq - t) / (t_seq - t_ideal) if t_seq > t_ideal else float("nan")


def plan_summary(plan: Plan) -> dict:
    return {"path": plan.path, "groups": plan.num_groups, "programs": plan.grid_size, "comm_ctas": plan.comm_ctas,
            "sequential": plan.sequential, "gemm": plan.gemm,
            "tile": [plan.tile.block_m, plan.tile.block_n, plan.tile.block_k, plan.tile.group_m]}


def result_row(op: str, shape: tuple[int, int, int], dtype: torch.dtype, t: dict[str, float],
               decomposition: dict[int, float], async_tp: float | None, plan: Plan,
               host_us: dict[str, float] | None = None) -> dict:
    """``t`` holds the medians named gemm, comm, seq, ours and, where measured, our_gemm; ``host_us`` the host
    time per call of sequential and ours."""
    m, n, k = shape
    t_ideal = max(t["gemm"], t["comm"])
    our_gemm = t.get("our_gemm")
    return {
        "op": op, "path": plan.path, "dtype": str(dtype).replace("torch.", ""), "M": m, "N": n, "K": k,
        "t_gemm_ms": t["gemm"], "t_our_gemm_ms": our_gemm, "t_comm_ms": t["comm"], "t_seq_ms": t["seq"],
        "t_ms": t["ours"], "t_ideal_ms": t_ideal, "speedup": t["seq"] / t["ours"],
        "E": efficiency(t["seq"], t["ours"], t_ideal),
        "our_gemm_vs_cublas": t["gemm"] / our_gemm if our_gemm else None,
        "baselines": {"decomposition_ms": min(decomposition.values()) if decomposition else None,
                      "decomposition_by_chunks_ms": decomposition, "async_tp_ms": async_tp},
        "plan": plan_summary(plan),
        "host_us": {name: host_us[name] for name in ("seq", "ours") if name in host_us} if host_us else None,
    }


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
