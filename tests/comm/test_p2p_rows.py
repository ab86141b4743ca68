"""Which rows each rank sums on the P2P reduce paths (pure functions; the copies themselves need GPUs)."""

import pytest

from flashoverlap.comm.p2p_schedule import reduced_rows, share
from flashoverlap.plan import TileConfig, default_plan

TILE = TileConfig(16, 16, 16, 2, 1, 4)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [6 * 8, 200, 1000])
def test_all_reduce_shares_partition_every_group(world_size, m):
    plan = default_plan("all_reduce", m, 64, 64, world_size, tile=TILE, num_groups=5, path="p2p",
                        allow_sequential=False)
    for grp in plan.groups:
        shares = [share(grp, r, world_size) for r in range(world_size)]
        assert shares[0][0] == grp.row_start and shares[-1][1] == grp.row_end
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(shares, shares[1:]))
    for rank in range(world_size):
        rows = list(reduced_rows(plan, rank))
        assert [dst for _, lo, _, dst, _ in rows] == [lo for _, lo, _, _, _ in rows]  # C rows land in place
        offsets = [off for *_, off in rows]
        assert offsets == [sum(hi - lo for _, lo, hi, _, _ in rows[:i]) for i in range(len(rows))]


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_rows_are_the_ranks_band_of_each_group(world_size):
    m = 96 * world_size
    plan = default_plan("reduce_scatter", m, 64, 64, world_size, tile=TILE, num_groups=3, path="p2p",
                        allow_sequential=False)
    a_rows, out_rows, valid = plan.tile_rows()
    for rank in range(world_size):
        covered = []
        for grp, lo, hi, dst, _ in reduced_rows(plan, rank):
            assert hi - lo == grp.rows and lo == grp.out_row_start + rank * grp.rows
            covered.extend(range(dst, dst + hi - lo))
            # The workspace rows [lo, hi) hold the product rows of this rank's block, band of the group.
            first = rank * plan.block_rows + grp.row_start
            assert any(int(o) == lo and int(a) == first for a, o in zip(a_rows, out_rows))
        assert covered == list(range(plan.block_rows))  # every output row of the rank, once, in order
