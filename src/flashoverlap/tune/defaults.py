"""Default plans: which plan a shape gets before any tuning, and the measured constants behind that choice.

The policy half of planning (``flashoverlap.plan`` is the contract: what a plan is and which plans are valid);
the tuner (``tune/search.py``, ``tune/model.py``) starts from these defaults and replaces them by measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashoverlap.plan import (
    BLOCKED_OPS,
    NCCL_FREE_SMS,
    P2P_MAX_RANKS,
    PLAN_PATHS,
    RING_PATHS,
    Plan,
    TileConfig,
    check_int,
    nccl_free_sms,
)

# Below this many bytes of output per call, one collective's latency is a large share of its time and the
# GEMM is too short to hide anything: run sequentially.
MIN_OVERLAP_BYTES = 4 << 20
# Fewer waves of tiles than this leaves nothing to overlap with.
MIN_OVERLAP_WAVES = 2.0
# Measured on 2x H200 (benchmarks/results/logs/why-overlap-is-hard.md): where the collective takes under half the
# GEMM's time, NCCL's slowdown beside the GEMM and the GEMM's beside NCCL cost more than the overlap hides.
# Reduce-scatter paid from a lower ratio: 16384x8192x4096 (ratio 0.43) hid half the hideable time with 8 groups,
# one program per tile (benchmarks/results/logs, sweep at d2b0ea3).
MIN_OVERLAP_COMM_RATIO = {"all_reduce": 0.5, "reduce_scatter": 0.4, "all_gather": 0.5}
# Sub-bands per rank block of the P2P ring by default, and the fewest rows a sub-band's matmul may have: measured
# on 2 H200s at the nvlink grid, 1..8 sub-bands side by side (benchmarks/results/logs/issue12, sub-bands sweep at
# 1eba16f): reduce-scatter best at 2, all-reduce and all-gather at 4 (8 once, by 0.04 of E); sub-bands of 256 rows
# lost to those of 512 everywhere (odd counts, with tile-rounded rows, lost to even ones).
P2P_SUB_BANDS = {"reduce_scatter": 2, "all_reduce": 4, "all_gather": 4}
P2P_MIN_SUB_BAND_ROWS = 512
# NCCL CTAs for all-gather plans.
ALL_GATHER_COMM_CTAS = 16


def default_tile_config(m: int, n: int, k: int) -> TileConfig:
    """The tile shape the overlapped GEMM uses for a shape, before any tuning."""
    block_m = 128 if m > 64 else 64
    block_n = 256 if n > 128 else (128 if n > 64 else 64)
    return TileConfig(block_m=block_m, block_n=block_n, block_k=64, group_m=8, num_stages=3, num_warps=8)


PROFILES = ("even", "small-first", "small-last")


def split_rows(tiles_m: int, num_groups: int, profile: str = "even", ratio: float = 1.6) -> tuple[int, ...]:
    """Cut ``tiles_m`` tile rows into ``min(num_groups, tiles_m)`` bands of at least one tile row each.

    ``even``: equal bands. ``small-first``: band sizes grow by ``ratio`` (the first collective starts early;
    suits communication slower than the GEMM). ``small-last``: they shrink by ``ratio`` (little communication
    is left when the GEMM ends; suits communication faster than the GEMM).
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    num_groups = max(1, min(num_groups, tiles_m))
    weights = [1.0] * num_groups if profile == "even" else [ratio**g for g in range(num_groups)]
    if profile == "small-last":
        weights.reverse()
    # Largest-remainder rounding of each band's share of the spare rows, every band at least one row.
    spare = tiles_m - num_groups
    shares = [spare * w / sum(weights) for w in weights]
    sizes = [1 + int(s) for s in shares]
    by_remainder = sorted(range(num_groups), key=lambda g: shares[g] - int(shares[g]), reverse=True)
    for g in by_remainder[: tiles_m - sum(sizes)]:
        sizes[g] += 1
    return tuple(sizes)


def sequential_plan(op: str, m: int, n: int, k: int, world_size: int, path: str = "nccl") -> Plan:
    """The plan that runs ``op`` as plain PyTorch would: the matmul, then one collective on the whole result."""
    tile = default_tile_config(m, n, k)
    blocks = world_size if op in BLOCKED_OPS else 1
    return Plan(op, m, n, k, world_size, tile, (math.ceil(max(1, m // blocks) / tile.block_m),), sequential=True,
                path=path)


@dataclass(frozen=True)
class PlanChoices:
    """What ``default_plan``'s keywords override (each None or default: the rule's choice)."""

    num_sms: int = 132
    element_size: int = 2
    comm_ratio: float | None = None
    num_groups: int | None = None
    profile: str | None = None
    num_programs: int | None = None
    comm_ctas: int | None = None
    tile: TileConfig | None = None
    allow_sequential: bool = True
    path: str = "nccl"
    gemm: str = "triton"


def default_plan(op: str, m: int, n: int, k: int, world_size: int, **choices) -> Plan:
    """A reasonable plan for any shape, before tuning; any keyword given (a ``PlanChoices`` field) overrides the
    choice.

    ``comm_ratio`` is the collective's estimated time over the GEMM's (``tune.rates``). The choices, from
    measurements on 2x H200 (benchmarks/results/logs/why-overlap-is-hard.md):

    - sequential where the output is under ``MIN_OVERLAP_BYTES``, the GEMM under ``MIN_OVERLAP_WAVES`` waves of
      tiles, or ``comm_ratio < MIN_OVERLAP_COMM_RATIO[op]``;
    - communication-bound (``comm_ratio >= 1``): 6 even groups; the GEMM persistent on all SMs but 32, which
      NCCL's 8 CTAs then find free as soon as the first group is ready;
    - otherwise: 8 even groups, one program per tile (programs retire as they finish, which lets NCCL's blocks
      in on the high-priority stream), NCCL's own CTA count.

    ``path="p2p"`` (copy engines and cuBLAS, ``comm/tp/ring_schedule.py``): every multiplication by cuBLAS, ``S``
    sub-bands per rank block (``P2P_SUB_BANDS``: 2 for reduce-scatter, 4 for all-reduce and all-gather, fewer where a
    sub-band would have fewer than ``P2P_MIN_SUB_BAND_ROWS`` rows).

    ``gemm="cublas"`` (NCCL path): the decomposition as a plan, 4 even bands each computed by cuBLAS; the tuner
    weighs it against the signalling GEMM's plans. Never the default.
    """
    try:
        chosen = PlanChoices(**choices)
    except TypeError as exc:
        raise TypeError(f"default_plan: {exc} (the keywords are PlanChoices' fields)") from None
    num_sms, element_size, comm_ratio = chosen.num_sms, chosen.element_size, chosen.comm_ratio
    num_groups = chosen.num_groups
    profile, num_programs, comm_ctas = chosen.profile, chosen.num_programs, chosen.comm_ctas
    tile, allow_sequential, path, gemm = chosen.tile, chosen.allow_sequential, chosen.path, chosen.gemm
    for name, value in (("m", m), ("n", n), ("k", k), ("world_size", world_size), ("num_sms", num_sms)):
        check_int(name, value, 1)
    tile = tile or default_tile_config(m, n, k)
    blocks = world_size if op in BLOCKED_OPS else 1
    tiles_per_block = math.ceil(max(1, m // blocks) / tile.block_m)
    tiles_m = blocks * tiles_per_block
    tiles_n = math.ceil(n / tile.block_n)
    waves = tiles_m * tiles_n / num_sms
    if path not in PLAN_PATHS:
        raise ValueError(f"path must be one of {PLAN_PATHS}, got {path!r}")
    too_small = (
        m * n * element_size < MIN_OVERLAP_BYTES
        or waves < MIN_OVERLAP_WAVES
        or world_size == 1
        or (path == "nccl" and comm_ratio is not None and comm_ratio < MIN_OVERLAP_COMM_RATIO[op])
    )
    if path in RING_PATHS:
        gemm = "cublas"
        block_rows = m // world_size
        per_block = num_groups or max(1, min(P2P_SUB_BANDS[op], block_rows // P2P_MIN_SUB_BAND_ROWS))
        if op == "all_reduce":  # the ring's W blocks, each of per_block groups
            per_block = min(per_block, tiles_m // world_size)
            too_small = too_small or per_block < 1 or world_size > P2P_MAX_RANKS
            num_groups = per_block * world_size
        else:
            num_groups = per_block
    if too_small and allow_sequential:
        return Plan(op, m, n, k, world_size, tile, (tiles_per_block,), num_sms, comm_ctas or 0, True, path)
    comm_bound = comm_ratio is not None and comm_ratio >= 1.0
    if gemm == "cublas" or path in RING_PATHS:
        choice = dict(num_groups=4, profile="even", num_programs=num_sms, comm_ctas=0)
    elif op == "all_gather":
        # The GEMM spins on bands NCCL delivers, so NCCL must always find SMs: a fixed CTA count and that many
        # SMs never taken by the GEMM (deadlock rule 2).
        ctas = comm_ctas or ALL_GATHER_COMM_CTAS
        choice = dict(num_groups=4 if comm_bound else 8, profile="even",
                      num_programs=max(1, num_sms - nccl_free_sms(num_sms, ctas)), comm_ctas=ctas)
    elif comm_bound:
        choice = dict(num_groups=6, profile="even", num_programs=max(1, num_sms - NCCL_FREE_SMS), comm_ctas=8)
    else:
        choice = dict(num_groups=8, profile="even", num_programs=tiles_m * tiles_n, comm_ctas=0)
    given = dict(num_groups=num_groups, profile=profile, num_programs=num_programs, comm_ctas=comm_ctas)
    choice.update({key: value for key, value in given.items() if value is not None})
    rows = split_rows(tiles_per_block, choice["num_groups"], choice["profile"])
    if path in RING_PATHS and op == "all_reduce" and len(rows) % world_size:
        return Plan(op, m, n, k, world_size, tile, (tiles_per_block,), num_sms, 0, True, path)
    return Plan(op, m, n, k, world_size, tile, rows, choice["num_programs"], choice["comm_ctas"], False, path, gemm)
