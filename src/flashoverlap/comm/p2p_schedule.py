"""The P2P paths' per-call work as data: for one rank, the ordered operations its copy stream runs.

Pure Python (no CUDA), so that the protocol can be executed for every rank on the CPU by a simulator that
interleaves the ranks' streams and GEMMs in any order (``tests/comm/test_p2p_protocol.py``); ``comm/p2p.py``
runs the same list on the GPU with stream memory operations and copy engines.

A location is ``(space, rank, offset)``: ``counter`` (this rank's per-group tile counters) and ``flag`` (the flag
header of ``rank``'s symmetric buffer) count int32 slots; ``work`` (``rank``'s symmetric data region, holding its
GEMM's partial products), ``scratch`` (this rank's ``[W][rows][N]`` pull buffer, flattened to rows) and ``out``
count rows of ``N`` elements. All-gather: ``shard`` (``rank``'s symmetric data region, holding its shard) and
``gathered`` (this rank's ``[group][W][rows][K]`` buffer) count rows of ``K`` elements; ``band`` is this rank's
per-group arrival flags, which the GEMM waits on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flashoverlap.comm.symmetric import FLAG_SLOTS
from flashoverlap.plan import Plan

# The flag header's last slots are the barriers': one slot per sending rank and channel.
BARRIER_RANKS = 64
READY, DONE = 0, 1  # the barrier channels: all-gather's shards are in place; no rank still pulls from a peer
GROUP_FLAG_SLOTS = FLAG_SLOTS - 2 * BARRIER_RANKS  # the slots before the barriers', for per-group flags


@dataclass(frozen=True)
class Loc:
    space: str
    rank: int
    offset: int


@dataclass(frozen=True)
class WaitGeq:
    """Block the stream until the int32 at ``loc`` is at least ``value``."""

    loc: Loc
    value: int


@dataclass(frozen=True)
class Write:
    """Write the int32 ``value`` at ``loc``."""

    loc: Loc
    value: int


@dataclass(frozen=True)
class Copy:
    """Copy ``rows`` rows from ``src`` to ``dst`` (a copy engine)."""

    dst: Loc
    src: Loc
    rows: int


@dataclass(frozen=True)
class Sum:
    """``out[out_row : out_row + rows] = sum over w of scratch[w][scratch_row : scratch_row + rows]``."""

    scratch_row: int
    rows: int
    out_row: int


def share(grp, rank: int, world_size: int) -> tuple[int, int]:
    """All-reduce: rank ``rank``'s rows of group ``grp``: W nearly equal shares, some empty if there are few rows."""
    rows = grp.row_end - grp.row_start
    return grp.row_start + rows * rank // world_size, grp.row_start + rows * (rank + 1) // world_size


def reduced_rows(plan: Plan, rank: int):
    """Per group: the group, the rows ``[lo, hi)`` of every rank's workspace that ``rank`` sums, the first row of
    the output they land in, and their offset in the scratch rows. Reduce-scatter: ``rank``'s band of its block
    (workspace ``[group][W][rows][N]``). All-reduce: ``rank``'s share of the group's rows of ``C``."""
    offset = 0
    for grp in plan.groups:
        if plan.op == "reduce_scatter":
            lo = grp.out_row_start + rank * grp.rows
            hi, dst = lo + grp.rows, grp.row_start
        else:
            lo, hi = share(grp, rank, plan.world_size)
            dst = lo
        yield grp, lo, hi, dst, offset
        offset += hi - lo


@functools.lru_cache(maxsize=256)
def scratch_rows(plan: Plan, rank: int) -> int:
    """Rows per rank-slot of ``rank``'s scratch (the scratch holds ``W`` such slots)."""
    return sum(hi - lo for _, lo, hi, _, _ in reduced_rows(plan, rank))


def _signal_and_wait(ops: list, first_slot: int, rank: int, world: int) -> None:
    """Set flag ``first_slot + rank`` in every peer, then wait for (and reset) every peer's in our header. The
    reset happens before this rank signals anything that a peer's next signal of the same slot depends on, so
    the flags need no epochs and a captured copy of these operations can be replayed."""
    for step in range(1, world):
        ops.append(Write(Loc("flag", (rank + step) % world, first_slot + rank), 1))
    for step in range(1, world):
        slot = Loc("flag", rank, first_slot + (rank + step) % world)
        ops += [WaitGeq(slot, 1), Write(slot, 0)]


@functools.lru_cache(maxsize=64)
def barrier(channel: int, rank: int, world: int) -> tuple:
    """A cross-rank barrier as stream memory operations (no kernel, no host wait): every rank sets its slot of
    ``channel`` in every peer's header, then waits for the peers' slots in its own and resets them."""
    if world > BARRIER_RANKS:
        raise ValueError(f"the P2P path's barriers support up to {BARRIER_RANKS} ranks, got {world}")
    ops: list = []
    _signal_and_wait(ops, FLAG_SLOTS - (channel + 1) * BARRIER_RANKS, rank, world)
    return tuple(ops)


@functools.lru_cache(maxsize=256)  # built once per plan: calls of a shape reuse it
def reduction(plan: Plan, rank: int) -> tuple:
    """The copy stream's operations for one reduce-scatter or all-reduce call on ``rank`` (see ``comm/p2p.py``)."""
    world = plan.world_size
    slot_rows = scratch_rows(plan, rank)
    second = plan.num_groups * world  # flag slots of the all-reduce's second round
    ops: list = []
    for grp, lo, hi, dst, offset in reduced_rows(plan, rank):
        counter = Loc("counter", rank, grp.index)
        ops += [WaitGeq(counter, grp.tile_count), Write(counter, 0)]
        _signal_and_wait(ops, grp.index * world, rank, world)  # every rank's partial of this group is written
        if hi > lo:
            for step in range(world):
                src = (rank + step) % world
                ops.append(Copy(Loc("scratch", rank, src * slot_rows + offset), Loc("work", src, lo), hi - lo))
            ops.append(Sum(offset, hi - lo, dst))
        if plan.op != "all_reduce":
            continue
        # Publish this rank's reduced share in its own workspace (no peer reads those partial rows), then pull
        # every peer's reduced share into the output.
        if hi > lo:
            ops.append(Copy(Loc("work", rank, lo), Loc("out", rank, lo), hi - lo))
        _signal_and_wait(ops, second + grp.index * world, rank, world)
        for step in range(1, world):
            src = (rank + step) % world
            s_lo, s_hi = share(grp, src, world)
            if s_hi > s_lo:
                ops.append(Copy(Loc("out", rank, s_lo), Loc("work", src, s_lo), s_hi - s_lo))
    # No rank's next call may overwrite its workspace while a peer still pulls from it.
    return tuple(ops) + barrier(DONE, rank, world)


@functools.lru_cache(maxsize=256)
def all_gather(plan: Plan, rank: int) -> tuple:
    """The copy stream's operations for one all-gather call on ``rank``: the ready barrier, then per band, pull it
    from every peer (rank+1, rank+2, ...) and raise the band's flag; then the done barrier."""
    world = plan.world_size
    ops: list = list(barrier(READY, rank, world))  # every rank's shard is in its workspace
    for grp in plan.groups:
        for step in range(1, world):
            peer = (rank + step) % world
            ops.append(Copy(Loc("gathered", rank, grp.out_row_start + peer * grp.rows),
                            Loc("shard", peer, grp.row_start), grp.rows))
        ops.append(Write(Loc("band", rank, grp.index), 1))
    return tuple(ops) + barrier(DONE, rank, world)  # as for the reduction
