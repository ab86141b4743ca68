"""Benchmark rows for the three ops (docs/benchmarks.md's columns, side by side in one run): cuBLAS, our GEMM alone,
the collective alone, sequential, the best decomposition, torch async TP, flashoverlap on the NCCL path and, on
NVLink, on the P2P path."""

from __future__ import annotations

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.bench.baselines import (
    DecomposedAllGather,
    DecomposedAllReduce,
    DecomposedReduceScatter,
    async_tp_ops,
    sequential_all_reduce,
)
from flashoverlap.bench.rows import add_auto, add_default, result_row
from flashoverlap.bench.timing import time_side_by_side
from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from flashoverlap.kernels.gemm import gemm
from flashoverlap.ops.all_gather_gemm import all_gather_gemm
from flashoverlap.ops.gemm_reduce_scatter import gemm_reduce_scatter
from flashoverlap.runtime import plan_for
from flashoverlap.runtime.calls import resolve
from flashoverlap.tune.defaults import default_plan

GRID_ALL_REDUCE = [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 4096), (8192, 8192, 14336),
                   (2048, 8192, 14336)]
GRID_REDUCE_SCATTER = GRID_ALL_REDUCE
GRID_ALL_GATHER = [(4096, 8192, 8192), (8192, 14336, 8192), (16384, 8192, 8192), (8192, 28672, 8192)]


def inputs(rows: int, n: int, k: int, dtype: torch.dtype, rank: int):
    """Fresh random ``a [rows, K]`` and ``b [K, N]``, b as an nn.Linear weight's transposed view."""
    gen = torch.Generator(device="cuda").manual_seed(4321 + rank)
    a = torch.randn(rows, k, dtype=dtype, device="cuda", generator=gen)
    w = torch.randn(n, k, dtype=dtype, device="cuda", generator=gen) / k**0.5
    return a, w.t()


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
        hand = plan_for(op, m, n, k, dist.group.WORLD, device, dtype, plan.path, tuned=False)
        if hand != plan:
            fns[f"{name}_default"] = lambda hand=hand: call(hand)
            defaults[name] = hand
    return defaults


def bench_all_reduce(m, n, k, dtype, iters, world_size, device, setting, sweep=None) -> list[dict]:
    rank = dist.get_rank()
    a, b = inputs(m, n, k, dtype, rank)
    c = torch.matmul(a, b)
    plan = plan_for("all_reduce", m, n, k, dist.group.WORLD, device, dtype)
    # Our GEMM alone with signalling on, in the plan the op uses (an overlapping plan even where the op would
    # choose sequential, so the figure always describes the kernel).
    kernel_plan = plan if not plan.sequential else default_plan("all_reduce", m, n, k, world_size,
                                                                allow_sequential=False)
    counters = torch.zeros(kernel_plan.num_groups, dtype=torch.int32, device=device)
    decomposed = {ch: DecomposedAllReduce(ch, device) for ch in (2, 4, 8)}
    fns = {
        "gemm": lambda: torch.matmul(a, b),
        "our_gemm": lambda: gemm(a, b, kernel_plan, counters=counters),
        "comm": lambda: dist.all_reduce(c),
        "seq": lambda: sequential_all_reduce(a, b),
        **{f"decomp{ch}": (lambda fn=fn: fn(a, b)) for ch, fn in decomposed.items()},
        "ours": lambda: fo.gemm_all_reduce(a, b, plan=plan),
    }
    before = {"our_gemm": counters.zero_}
    call = lambda **kw: fo.gemm_all_reduce(a, b, **kw)  # noqa: E731
    fns["ours_auto"] = lambda: fo.gemm_all_reduce(a, b)  # what a user gets: path="auto", no plan
    auto = _auto("gemm_all_reduce", "all_reduce", a, b)
    p2p_plan = _p2p_reduction("all_reduce", a, b, call, fns, before, dtype, setting)
    return _measure("all_reduce", (m, n, k), dtype, fns, decomposed, plan, iters, None, (), before=before,
                    why="torch async TP has no fused all-reduce", sweep=sweep, call=lambda plan: call(plan=plan),
                    p2p_plan=p2p_plan, auto=auto)


def _p2p_reduction(op, a, b, call, fns, before, dtype, setting):
    """Add the P2P path's op (``ours_p2p``) and its GEMM alone (``our_gemm_p2p``) to ``fns`` where P2P runs;
    return its plan (None where it does not)."""
    m, k = a.shape
    n = b.shape[1]
    p2p_plan = _try_p2p(op, call, (m, n, k), dtype, setting)
    if p2p_plan is not None:  # the P2P path multiplies with cuBLAS: its GEMM alone is T_gemm
        fns["our_gemm_p2p"] = fns["gemm"]
        fns["ours_p2p"] = lambda: call(plan=p2p_plan)
    return p2p_plan


def bench_reduce_scatter(m, n, k, dtype, iters, world_size, device, setting, sweep=None) -> list[dict]:
    rank = dist.get_rank()
    a, b = inputs(m, n, k, dtype, rank)
    c = torch.matmul(a, b)
    out = torch.empty((m // world_size, n), dtype=dtype, device=device)
    plan = plan_for("reduce_scatter", m, n, k, dist.group.WORLD, device, dtype)
    kernel_plan = plan if not plan.sequential else default_plan("reduce_scatter", m, n, k, world_size,
                                                                allow_sequential=False)
    counters = torch.zeros(kernel_plan.num_groups, dtype=torch.int32, device=device)
    decomposed = {ch: DecomposedReduceScatter(ch, device) for ch in (2, 4, 8) if ch % world_size == 0}
    fns = {
        "gemm": lambda: torch.matmul(a, b),
        "our_gemm": lambda: gemm(a, b, kernel_plan, counters=counters),
        "comm": lambda: reduce_scatter_tensor(out, c, None),
        "seq": lambda: reduce_scatter_tensor(out, torch.matmul(a, b), None),
        **{f"decomp{ch}": (lambda fn=fn: fn(a, b)) for ch, fn in decomposed.items()},
        "ours": lambda: gemm_reduce_scatter(a, b, plan=plan),
    }
    before = {"our_gemm": counters.zero_}
    fns["ours_auto"] = lambda: gemm_reduce_scatter(a, b)
    auto = _auto("gemm_reduce_scatter", "reduce_scatter", a, b)
    p2p_plan = _p2p_reduction("reduce_scatter", a, b, lambda **kw: gemm_reduce_scatter(a, b, **kw), fns, before,
                              dtype, setting)
    fused_rs, _, why = async_tp_ops() if setting == "nvlink" else (None, None, "nvlink setting only")
    return _measure("reduce_scatter", (m, n, k), dtype, fns, decomposed, plan, iters, fused_rs, (a, b),
                    before=before, why=why, sweep=sweep, call=lambda plan: gemm_reduce_scatter(a, b, plan=plan),
                    p2p_plan=p2p_plan, auto=auto)


def bench_all_gather(m, n, k, dtype, iters, world_size, device, setting, sweep=None) -> list[dict]:
    rank = dist.get_rank()
    rows = m // world_size
    a_shard, b = inputs(rows, n, k, dtype, rank)
    a_full = torch.empty((m, k), dtype=dtype, device=device)
    plan = plan_for("all_gather", m, n, k, dist.group.WORLD, device, dtype)
    kernel_plan = plan if not plan.sequential else default_plan("all_gather", m, n, k, world_size,
                                                                allow_sequential=False)
    # Our GEMM alone on an already gathered input (every band's flag set): the compute side of the op.
    flags_ready = torch.ones(kernel_plan.num_groups, dtype=torch.int32, device=device)
    decomposed = {ch: DecomposedAllGather(ch, device) for ch in (2, 4, 8)}

    def sequential():
        all_gather_into_tensor(a_full, a_shard, None)
        return torch.matmul(a_full, b)

    fns = {
        "gemm": lambda: torch.matmul(a_full, b),
        "our_gemm": lambda: gemm(a_full, b, kernel_plan, flags=flags_ready, rank=rank),
        "comm": lambda: all_gather_into_tensor(a_full, a_shard, None),
        "seq": sequential,
        **{f"decomp{ch}": (lambda fn=fn: fn(a_shard, b)) for ch, fn in decomposed.items()},
        "ours": lambda: all_gather_gemm(a_shard, b, plan=plan),
    }
    p2p_plan = _try_p2p("all_gather", lambda **kw: all_gather_gemm(a_shard, b, **kw), (m, n, k), dtype, setting)
    if p2p_plan is not None:  # cuBLAS multiplies on the P2P path
        fns["our_gemm_p2p"] = fns["gemm"]
        fns["ours_p2p"] = lambda: all_gather_gemm(a_shard, b, plan=p2p_plan)
    fns["ours_auto"] = lambda: all_gather_gemm(a_shard, b)
    auto = _auto("all_gather_gemm", "all_gather", a_shard, b)
    _, fused_ag, why = async_tp_ops() if setting == "nvlink" else (None, None, "nvlink setting only")
    return _measure("all_gather", (m, n, k), dtype, fns, decomposed, plan, iters, fused_ag, (a_shard, b), why=why,
                    sweep=sweep, call=lambda plan: all_gather_gemm(a_shard, b, plan=plan), p2p_plan=p2p_plan,
                    auto=auto)


def _auto(name, op, a, b):
    """The path and plan an untuned ``path="auto"`` call takes here (what a user gets)."""
    path, _, plan = resolve(name, op, a, b, None, None, "auto")
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
    return plan_for(op, m, n, k, dist.group.WORLD, device, dtype, "p2p")
