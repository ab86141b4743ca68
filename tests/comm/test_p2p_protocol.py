"""The P2P reduce-scatter and all-reduce protocols executed for every rank on the CPU: each rank's copy stream runs
``p2p_schedule.reduction`` and each rank's GEMM finishes its groups, interleaved in random orders, on shared
memories. Checks that no interleaving deadlocks, that every output holds the sum, and that counters and flags are
back at zero for the next call (two calls run back to back with fresh partials)."""

import random

import numpy as np
import pytest

from flashoverlap.comm.p2p_schedule import Copy, Sum, WaitGeq, Write, reduction, scratch_rows
from flashoverlap.comm.symmetric import FLAG_SLOTS
from flashoverlap.plan import TileConfig, default_plan

TILE = TileConfig(16, 16, 16, 2, 1, 4)


class Rank:
    def __init__(self, plan, rank):
        w, n = plan.world_size, plan.n
        self.counter = np.zeros(plan.num_groups, dtype=np.int64)
        self.flag = np.zeros(FLAG_SLOTS, dtype=np.int64)
        self.work = np.full((plan.m, n), np.nan)
        self.scratch = np.full((w * max(scratch_rows(plan, rank), 1), n), np.nan)
        out_rows = plan.block_rows if plan.op == "reduce_scatter" else plan.m
        self.out = np.full((out_rows, n), np.nan)


def _workspace_rows(plan, grp):
    """(product rows, workspace rows) the GEMM writes for group ``grp``."""
    if plan.op == "all_reduce":
        return [(grp.row_start, grp.row_end, grp.row_start)]
    return [(b * plan.block_rows + grp.row_start, b * plan.block_rows + grp.row_end, grp.out_row_start + b * grp.rows)
            for b in range(plan.world_size)]


def _run_call(plan, ranks, partials, rng, schedule=reduction):
    w = plan.world_size
    programs = [list(schedule(plan, r)) for r in range(w)]
    gemm_left = [list(plan.groups) for _ in range(w)]

    def view(rank, loc):
        mem = getattr(ranks[loc.rank], loc.space)
        assert loc.space in ("counter", "flag") or loc.rank == rank or loc.space == "work", loc
        return mem

    def runnable(r):
        if not programs[r]:
            return False
        op = programs[r][0]
        return not isinstance(op, WaitGeq) or view(r, op.loc)[op.loc.offset] >= op.value

    while any(programs) or any(gemm_left):
        actors = [("gemm", r) for r in range(w) if gemm_left[r]] + [("stream", r) for r in range(w) if runnable(r)]
        assert actors, f"deadlock: every stream waits: {[p[0] if p else None for p in programs]}"
        kind, r = rng.choice(actors)
        if kind == "gemm":
            grp = gemm_left[r].pop(0)
            for p_lo, p_hi, w_lo in _workspace_rows(plan, grp):
                ranks[r].work[w_lo : w_lo + p_hi - p_lo] = partials[r][p_lo:p_hi]
            ranks[r].counter[grp.index] += grp.tile_count  # the kernel's bumps, all at once
            continue
        op = programs[r].pop(0)
        if isinstance(op, Write):
            view(r, op.loc)[op.loc.offset] = op.value
        elif isinstance(op, Copy):
            src, dst = view(r, op.src), view(r, op.dst)
            dst[op.dst.offset : op.dst.offset + op.rows] = src[op.src.offset : op.src.offset + op.rows]
        elif isinstance(op, Sum):
            slot, first = ranks[r].scratch.shape[0] // w, op.scratch_row
            parts = [ranks[r].scratch[s * slot + first : s * slot + first + op.rows] for s in range(w)]
            ranks[r].out[op.out_row : op.out_row + op.rows] = np.sum(parts, axis=0)


@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("world_size,m,groups", [(2, 96, 3), (3, 48, 4), (4, 64, 2), (8, 40, 3), (4, 8, 1)])
def test_every_interleaving_sums_and_leaves_no_state(op, world_size, m, groups):
    m = m * world_size if op == "reduce_scatter" else m + 7  # odd row counts for all-reduce
    plan = default_plan(op, m, 24, 16, world_size, tile=TILE, num_groups=groups, path="p2p",
                        allow_sequential=False)
    rng = random.Random(f"{op}{world_size}{m}")
    ranks = [Rank(plan, r) for r in range(world_size)]
    for call in range(2):
        partials = [np.random.default_rng(100 * call + r).standard_normal((m, plan.n)) for r in range(world_size)]
        for seed in range(3 if call == 0 else 1):  # several interleavings of the first call
            for rank in ranks:
                rank.out[:] = np.nan
            _run_call(plan, ranks, partials, random.Random(rng.random() + seed))
            total = np.sum(partials, axis=0)
            for r, rank in enumerate(ranks):
                want = total[r * plan.block_rows : (r + 1) * plan.block_rows] if op == "reduce_scatter" else total
                np.testing.assert_allclose(rank.out, want, rtol=1e-12, atol=1e-12)
                assert not rank.counter.any() and not rank.flag.any(), "state left for the next call"


def test_a_missing_peer_signal_is_a_deadlock_the_simulator_sees():
    plan = default_plan("reduce_scatter", 64, 24, 16, 2, tile=TILE, num_groups=2, path="p2p", allow_sequential=False)
    ranks = [Rank(plan, r) for r in range(2)]
    partials = [np.ones((64, 24)), np.ones((64, 24))]

    def dropping(plan, rank):  # rank 1 never signals rank 0
        return [o for o in reduction(plan, rank) if not (rank == 1 and isinstance(o, Write) and o.loc.rank == 0)]

    with pytest.raises(AssertionError, match="deadlock"):
        _run_call(plan, ranks, partials, random.Random(0), dropping)


# -- all-gather: the copy streams, the consuming GEMMs and the ready/done barriers ---------------------------------
def _all_gather_calls(plan, shards_per_call, rng):
    """Run consecutive all-gather calls on every rank with generator actors: each rank's producer stream (own
    shard into its workspace, the GEMM consuming bands as their flags rise, join, clear) and its copy stream
    (``p2p_schedule.all_gather``: ready barrier, pulls, band flags, done barrier, on shared flag headers). Returns,
    per call and rank, the rows the GEMM read for each band."""
    from flashoverlap.comm.p2p_schedule import all_gather

    w, block = plan.world_size, plan.block_rows
    workspace = [np.full((block, plan.k), np.nan) for _ in range(w)]
    band = [np.zeros(plan.num_groups, dtype=np.int64) for _ in range(w)]
    flag = [np.zeros(FLAG_SLOTS, dtype=np.int64) for _ in range(w)]
    progress = [0]
    read = {}

    def copy_stream(r, gathered, joined):
        for op in all_gather(plan, r):
            if isinstance(op, WaitGeq):
                assert op.loc.space == "flag" and op.loc.rank == r, op  # a rank waits on its own header only
                while flag[r][op.loc.offset] < op.value:
                    yield None
            elif isinstance(op, Copy):
                yield None
                src = workspace[op.src.rank]
                gathered[op.dst.offset : op.dst.offset + op.rows] = src[op.src.offset : op.src.offset + op.rows]
            else:
                yield None
                (band[r] if op.loc.space == "band" else flag[op.loc.rank])[op.loc.offset] = op.value
            progress[0] += 1
        joined[0] = True

    def producer(r, call, shard):
        gathered = np.full((plan.m, plan.k), np.nan)
        workspace[r][:] = shard  # the next call's shard overwrites the last one: the done barrier protects it
        for grp in plan.groups:
            gathered[grp.out_row_start + r * grp.rows : grp.out_row_start + (r + 1) * grp.rows] = \
                shard[grp.row_start : grp.row_end]
        joined = [False]
        actors.append(copy_stream(r, gathered, joined))  # the copy stream starts after the producer's writes
        for grp in plan.groups:  # own shard's tiles need nothing; then each band waits for its flag
            while not band[r][grp.index]:
                yield None
            read[(call, r, grp.index)] = gathered[grp.out_row_start : grp.out_row_end].copy()
            progress[0] += 1
        while not joined[0]:
            yield None
        band[r][:] = 0

    def rank_calls(r):  # a rank goes on to its next call as soon as its own producer stream allows
        for call, shards in enumerate(shards_per_call):
            yield from producer(r, call, shards[r])

    actors = [rank_calls(r) for r in range(w)]
    idle = 0
    while actors:
        actor = rng.choice(actors)
        try:
            before = (progress[0], len(actors))
            next(actor)
            idle = 0 if (progress[0], len(actors)) != before else idle + 1
        except StopIteration:
            actors.remove(actor)
            idle = 0
        assert idle < 10000, "deadlock: no actor makes progress"
    assert not any(f.any() for f in flag), "barrier flags left set"
    return read


@pytest.mark.parametrize("world_size,rows,groups", [(2, 40, 3), (3, 48, 4), (4, 16, 2), (8, 24, 3)])
def test_all_gather_bands_arrive_complete_and_calls_do_not_overlap(world_size, rows, groups):
    plan = default_plan("all_gather", rows * world_size, 24, 16, world_size, tile=TILE, num_groups=groups,
                        path="p2p", allow_sequential=False)
    calls = [[np.random.default_rng(10 * c + r).standard_normal((rows, 16)) for r in range(world_size)]
             for c in range(3)]
    for seed in range(4):
        read = _all_gather_calls(plan, calls, random.Random(seed))
        for (call, _rank, g), rows_read in read.items():
            grp = plan.groups[g]
            want = np.concatenate([calls[call][src][grp.row_start : grp.row_end] for src in range(world_size)])
            np.testing.assert_array_equal(rows_read, want)  # every source's rows of this band, this call's
        assert len(read) == 3 * world_size * plan.num_groups
