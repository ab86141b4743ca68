"""Benchmark rows for the three ops (docs/benchmarks.md's columns, side by side in one run): cuBLAS, our GEMM alone,
the collective alone, sequential, the best decomposition, torch async TP, flashoverlap on the NCCL path with the
plan it resolves (and, where that plan came from the plan cache, the hand-set plan beside it), on NVLink on the P2P
path, and as a user calls it (``path="auto"``). The installed ``flashoverlap bench ops`` times the plain subset
(``flashoverlap.bench.calls``); these rows add the rest."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.harness.baselines import (
    DecomposedAllGather,
    DecomposedAllReduce,
    DecomposedReduceScatter,
    async_tp_ops,
)
from benchmarks.harness.rows import add_auto, add_default, result_row
from flashoverlap.bench import GRIDS, OP_FUNCTIONS, OP_NAMES, calls
from flashoverlap.kernels.gemm import gemm
from flashoverlap.runtime import plan_for
from flashoverlap.runtime.calls import GemmSpec, resolve
from flashoverlap.tune.defaults import default_plan
from flashoverlap.tune.timing import time_side_by_side

GRID_ALL_REDUCE, GRID_REDUCE_SCATTER, GRID_ALL_GATHER = GRIDS["all_reduce"], GRIDS["reduce_scatter"], \
    GRIDS["all_gather"]
DECOMPOSED = {"all_reduce": DecomposedAllReduce, "reduce_scatter": DecomposedReduceScatter,
              "all_gather": DecomposedAllGather}


def _try_async_tp(fn, *args):
    """``fn`` if one call of it runs here (the same on every rank), else ``None`` and the reason."""
    if fn is None:
        return None, None
    try:
        fn(*args)
        torch.cuda.synchronize()
        return fn, None
    except Exception as exc:  # an op signature this torch does not have, symmetric memory unavailable, ...
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def _measure(op, shape, dtype, fns, decomposed, plan, iters, fused, fused_args, before=None, why=None,
             sweep=None, call=None, p2p_plan=None, auto=None) -> list[dict]:
    """Time ``fns`` (plus torch async TP where it runs) side by side and build the results row (and, where
    ``fns`` has ``ours_p2p``/``our_gemm_p2p``, the P2P path's row with the same baselines); with ``sweep``, also
    ``sweep(op, call, shape, row)``: ``call(plan)`` over a family of plans."""
    fused, failed = _try_async_tp(fused, *fused_args)
    if fused is not None:
        fns["async_tp"] = lambda: fused(*fused_args)
    defaults = _hand_set_plans(op, shape, dtype, fns, call, {"ours": plan, "ours_p2p": p2p_plan})
    host_us: dict[str, float] = {}
    t = time_side_by_side(fns, warmup=5, iters=iters, before=before or {}, host_us=host_us)
    decomposition = {ch: t[f"decomp{ch}"] for ch in decomposed}
    rows = [result_row(op, shape, dtype, t, decomposition, t.get("async_tp"), plan, host_us)]
    if "ours_p2p" in t:
        t_p2p = {**t, "ours": t["ours_p2p"], "our_gemm": t["our_gemm_p2p"]}
        rows.append(result_row(op, shape, dtype, t_p2p, decomposition, t.get("async_tp"), p2p_plan,
                               {**host_us, "ours": host_us["ours_p2p"]}))
    for row, name in zip(rows, ("ours", "ours_p2p")):
        if name in defaults:
            add_default(row, t[f"{name}_default"], defaults[name])
    for row in rows:
        if fused is None:
            row["baselines"]["async_tp_note"] = failed or why or "not run"
        if auto is not None:
            add_auto(row, t["ours_auto"], auto[0], auto[1], host_us.get("ours_auto"))
    if sweep is not None:
        rows[0]["sweep"] = sweep(op, call, shape, rows[0])
    return rows


def _hand_set_plans(op, shape, dtype, fns, call, chosen: dict) -> dict:
    """Where a plan came from the plan cache, add its path's hand-set default plan to ``fns`` (as
    ``<name>_default``) so that both are timed side by side; returns those default plans by name."""
    m, n, k = shape
    device = torch.device("cuda", torch.cuda.current_device())
    defaults = {}
    for name, plan in chosen.items():
        if plan is None or name not in fns or call is None:
            continue
        hand = plan_for(op, (m, n, k), dist.group.WORLD, device, dtype, plan.path, tuned=False)
        if hand != plan:
            fns[f"{name}_default"] = lambda hand=hand: call(hand)
            defaults[name] = hand
    return defaults


def bench_op(op: str, shape: tuple[int, int, int], dtype: torch.dtype, iters: int, setting: str,
             sweep=None) -> list[dict]:
    """The rows of ``op`` at ``shape``: the NCCL path's and, where P2P runs (NVLink only), the P2P path's."""
    m, n, k = shape
    world_size, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    a, b, fns = calls(op, shape, dtype)
    fn = OP_FUNCTIONS[op]

    def call(**kw):
        return fn(a, b, **kw)

    plan = plan_for(op, (m, n, k), dist.group.WORLD, device, dtype)
    # Our GEMM alone with signalling on, in the plan the op uses (an overlapping plan even where the op would
    # choose sequential, so the figure always describes the kernel).
    kernel_plan = plan if not plan.sequential else default_plan(op, m, n, k, world_size, allow_sequential=False)
    before = {}
    if op == "all_gather":  # on an already gathered input (every band's flag set): the compute side of the op
        a_full = torch.empty((m, k), dtype=dtype, device=device)
        flags_ready = torch.ones(kernel_plan.num_groups, dtype=torch.int32, device=device)
        fns["our_gemm"] = lambda: gemm(a_full, b, kernel_plan, flags=flags_ready, rank=rank)
    else:
        counters = torch.zeros(kernel_plan.num_groups, dtype=torch.int32, device=device)
        fns["our_gemm"] = lambda: gemm(a, b, kernel_plan, counters=counters)
        before["our_gemm"] = counters.zero_
    decomposed = {ch: DECOMPOSED[op](ch, device) for ch in (2, 4, 8)
                  if op != "reduce_scatter" or ch % world_size == 0}
    fns.update({f"decomp{ch}": (lambda fn=fn: fn(a, b)) for ch, fn in decomposed.items()})
    fns["ours_auto"] = fns["ours"]  # what a user gets: path="auto", no plan
    fns["ours"] = lambda: call(plan=plan)
    p2p_plan = _try_p2p(op, call, shape, dtype, setting)
    if p2p_plan is not None:  # the P2P path multiplies with cuBLAS: its GEMM alone is T_gemm
        fns["our_gemm_p2p"] = fns["gemm"]
        fns["ours_p2p"] = lambda: call(plan=p2p_plan)
    auto = _auto(OP_NAMES[op], op, a, b)
    if op == "all_reduce":
        fused, why = None, "torch async TP has no fused all-reduce"
    elif setting != "nvlink":
        fused, why = None, "nvlink setting only"
    else:
        fused_rs, fused_ag, why = async_tp_ops()
        fused = fused_rs if op == "reduce_scatter" else fused_ag
    return _measure(op, shape, dtype, fns, decomposed, plan, iters, fused, (a, b), before=before, why=why,
                    sweep=sweep, call=lambda plan: call(plan=plan), p2p_plan=p2p_plan, auto=auto)


def _auto(name, op, a, b):
    """The path and plan an untuned ``path="auto"`` call takes here (what a user gets)."""
    path, _, plan = resolve(GemmSpec(name, op, a, b))
    return path, plan


def _try_p2p(op, call, shape, dtype, setting):
    """The P2P path's default plan for ``op`` at ``shape`` if one ``call(path="p2p")`` runs here (nvlink setting
    only), else None (and why, printed)."""
    if setting != "nvlink":
        return None
    try:
        call(path="p2p")
        torch.cuda.synchronize()
    except Exception as exc:  # P2P refused here (say why) or failing: the NCCL row still stands
        if dist.get_rank() == 0:
            print(f"    p2p path not measured: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None
    m, n, k = shape
    device = torch.device("cuda", torch.cuda.current_device())
    return plan_for(op, (m, n, k), dist.group.WORLD, device, dtype, "p2p")
