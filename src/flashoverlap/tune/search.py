"""Plan search (issue 5): the candidate plans for one call, ranked by the performance model. The tuner measures
the top few on the GPUs (``python -m flashoverlap tune plan``) and caches the winner; this module is the
part that needs no GPU."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from flashoverlap.plan import Plan, TileConfig, nccl_free_sms
from flashoverlap.tune.defaults import default_plan, default_tile_config
from flashoverlap.tune.model import Curve, Machine, predict

GROUPS = (1, 2, 3, 4, 6, 8, 12, 16)
PROFILES = ("even", "small-first", "small-last")
# SMs a persistent GEMM leaves to the collectives (0: one program per tile instead). 16 was tried as well and
# dropped: over both settings' exhaustive runs on 2 H200s (330bb22) it was never the best class of plan and up to
# 56% slower than the best through host memory, where NCCL's kernels want more than 16 SMs.
FREE_SMS = (0, 32)
# NCCL CTA counts tried: all-gather on NCCL, where the GEMM spins on bands NCCL delivers and must leave it SMs,
# 8 and 16; the reductions, NCCL's own count (0) and 8. The model cannot tell CTA counts apart (their cost is part
# of the measured slowdowns): candidates that differ only in them tie, and timing the model's top few decides.
# (Through host memory 8 CTAs beat NCCL's own count by up to 4% at 330bb22/447f55d; on NVLink they were within 1%.)
NCCL_CTAS = (8, 16)
REDUCTION_NCCL_CTAS = (0, 8)
# Sub-bands per rank block of the P2P path's ring plans (cuBLAS: no tiles, programs or CTAs to choose).
P2P_SUB_BANDS = (1, 2, 3, 4, 6, 8)


def tile_choices(m: int, n: int, k: int) -> tuple[TileConfig, ...]:
    """The GEMM tile configurations the search tries: the default. (128x128 tiles beside 128x256 ones were tried
    and dropped: in the exhaustive runs on 2 H200s at 330bb22 they were never more than 1% ahead of the wide
    tiles' best plan, and mostly 5-30% behind, at twice the tuning time.) The search and the machine figures
    are written for several."""
    return (default_tile_config(m, n, k),)


def candidates(op: str, m: int, n: int, k: int, world_size: int, num_sms: int, path: str = "nccl") -> list[Plan]:
    """Every plan the search considers: sequential; for each tile configuration (``tile_choices``), each
    combination of group count, group-size profile, GEMM programs (one per tile, or persistent leaving some SMs
    free) and, on NCCL, NCCL CTAs (``NCCL_CTAS``, ``REDUCTION_NCCL_CTAS``), without duplicates and without
    all-gather plans the op would refuse (deadlock rule 2); and on the NCCL path cuBLAS bands (the decomposition,
    so that the pick is never worse than it where the model is right)."""
    seen: dict[tuple, Plan] = {}
    base = default_plan(op, m, n, k, world_size, num_sms=num_sms, allow_sequential=False, path=path)
    seq = Plan(op, m, n, k, world_size, base.tile, (base.tiles_per_block,), num_sms, 0, True, path)
    seen[("seq",)] = seq
    if path == "p2p":
        for plan in ring_plans(op, m, n, k, world_size, num_sms):
            seen.setdefault((plan.group_row_tiles,), plan)
        return list(seen.values())
    ctas_options = (0,) if path != "nccl" else NCCL_CTAS if op == "all_gather" else REDUCTION_NCCL_CTAS
    for tile in tile_choices(m, n, k):
        tiles = default_plan(op, m, n, k, world_size, num_sms=num_sms, tile=tile, allow_sequential=False,
                             path=path).num_tiles
        for groups in GROUPS:
            for profile in PROFILES:
                for free in FREE_SMS:
                    for ctas in ctas_options:
                        if op == "all_gather" and path == "nccl":
                            if ctas == 0 or free < nccl_free_sms(num_sms, ctas):
                                continue
                            programs = num_sms - free
                        else:
                            programs = tiles if free == 0 else num_sms - free
                        plan = default_plan(op, m, n, k, world_size, num_sms=num_sms, tile=tile, num_groups=groups,
                                            profile=profile, num_programs=programs, comm_ctas=ctas,
                                            allow_sequential=False, path=path)
                        key = (plan.tile, plan.group_row_tiles, plan.grid_size, plan.comm_ctas)
                        seen.setdefault(key, plan)
    for plan in cublas_band_plans(op, m, n, k, world_size, num_sms, path):
        seen.setdefault(("cublas", plan.group_row_tiles), plan)
    return list(seen.values())


def ring_plans(op: str, m: int, n: int, k: int, world_size: int, num_sms: int) -> list[Plan]:
    """The P2P path's candidates: the ring with each sub-band count of ``P2P_SUB_BANDS`` (those the shape
    allows)."""
    plans = [default_plan(op, m, n, k, world_size, num_sms=num_sms, num_groups=sub, path="p2p",
                          allow_sequential=False) for sub in P2P_SUB_BANDS]
    return [plan for plan in plans if not plan.sequential]


def cublas_band_plans(op: str, m: int, n: int, k: int, world_size: int, num_sms: int, path: str) -> list[Plan]:
    """The decomposition as plans (NCCL path only): cuBLAS bands, 2, 4 and 8 of them, as the baseline's chunks."""
    if path != "nccl":
        return []
    return [default_plan(op, m, n, k, world_size, num_sms=num_sms, num_groups=groups, gemm="cublas",
                         allow_sequential=False) for groups in (2, 4, 8)]


def machine_of(plan: Plan, machines: Machine | Mapping[TileConfig, Machine]) -> Machine:
    """The machine figures measured with ``plan``'s tile configuration (or the one ``Machine`` given)."""
    if isinstance(machines, Machine):
        return machines
    return machines.get(plan.tile) or next(iter(machines.values()))


def rank(plans: list[Plan], machine: Machine | Mapping[TileConfig, Machine], curve: Curve,
         predict_fn: Callable[[Plan, Machine, Curve], float] | None = None) -> list[tuple[float, Plan]]:
    """``plans`` with their predicted times, fastest first (ties keep the candidates' order). ``machine``: one
    ``Machine``, or one per tile configuration (our GEMM's time per wave depends on it)."""
    def predicted(plan: Plan) -> float:
        figures = machine_of(plan, machine)
        if predict_fn is not None:
            return predict_fn(plan, figures, curve)
        return predict(plan, figures, curve).total_ms

    scored = [(predicted(plan), i, plan) for i, plan in enumerate(plans)]
    return [(t, plan) for t, _, plan in sorted(scored, key=lambda x: (x[0], x[1]))]
