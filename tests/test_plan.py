"""The plan: validation, groups, tile order, default plans."""

import copy
import dataclasses
import pickle

import numpy as np
import pytest

from flashoverlap.plan import MAX_GROUPS, Plan, TileConfig
from flashoverlap.tune.defaults import default_plan, split_rows

SMALL = TileConfig(16, 16, 16, 2, 1, 4)


def test_groups_are_contiguous_row_bands_covering_c():
    plan = Plan("all_reduce", 100, 70, 30, 2, SMALL, (2, 3, 2), num_programs=5)
    assert plan.tiles_m == 7 and plan.tiles_n == 5 and plan.num_tiles == 35
    rows = [(g.row_start, g.row_end) for g in plan.groups]
    assert rows == [(0, 32), (32, 80), (80, 100)]  # the last band stops at M
    assert [g.tile_count for g in plan.groups] == [10, 15, 10]
    assert [g.tile_start for g in plan.groups] == [0, 10, 25]
    assert plan.group_bytes(2) == [32 * 70 * 2, 48 * 70 * 2, 20 * 70 * 2]


@pytest.mark.parametrize("rows,group_m", [((2, 3, 2), 2), ((7,), 3), ((1, 1, 1, 1, 1, 1, 1), 4), ((4, 3), 8)])
def test_tile_order_is_a_permutation_with_each_group_a_consecutive_run(rows, group_m):
    tile = TileConfig(16, 16, 16, group_m, 1, 4)
    plan = Plan("all_reduce", 100, 70, 30, 2, tile, rows, num_programs=3)
    order, owner = plan.tile_order(), plan.tile_groups()
    assert sorted(order.tolist()) == list(range(plan.num_tiles))
    for grp in plan.groups:
        run = order[grp.tile_start : grp.tile_start + grp.tile_count]
        pid_m = run // plan.tiles_n
        # Exactly the tiles of the group's rows, nothing else.
        assert set(pid_m.tolist()) == set(range(grp.row_start // 16, -(-grp.row_end // 16)))
        assert len(run) == len(set(run.tolist())) == grp.tile_count
        assert (owner[grp.tile_start : grp.tile_start + grp.tile_count] == grp.index).all()


def test_tile_order_visits_group_m_rows_column_by_column():
    plan = Plan("all_reduce", 64, 48, 16, 2, TileConfig(16, 16, 16, 2, 1, 4), (4,), num_programs=1)
    pairs = [(v // 3, v % 3) for v in plan.tile_order().tolist()]
    assert pairs[:6] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert pairs[6:8] == [(2, 0), (3, 0)]


def test_tables_are_read_only_int32():
    plan = default_plan("all_reduce", 1000, 1000, 100, 2, tile=SMALL, allow_sequential=False)
    for table in (plan.tile_order(), plan.tile_groups()):
        assert table.dtype == np.int32 and not table.flags.writeable


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(op="gather"), "Plan.op"),
        (dict(m=0), "Plan.m"),
        (dict(k=-3), "Plan.k"),
        (dict(world_size=0), "Plan.world_size"),
        (dict(num_programs=0), "Plan.num_programs"),
        (dict(comm_ctas=-1), "Plan.comm_ctas"),
        (dict(group_row_tiles=()), "at least one group"),
        (dict(group_row_tiles=(3, 3)), "must sum to"),
        (dict(group_row_tiles=(7, 0)), r"group_row_tiles\[1\]"),
        (dict(tile="big"), "TileConfig"),
        (dict(m=True), "Plan.m"),
    ],
)
def test_invalid_plans_name_the_field(kwargs, match):
    base = dict(op="all_reduce", m=100, n=70, k=30, world_size=2, tile=SMALL, group_row_tiles=(7,), num_programs=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Plan(**base)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(block_m=48), "block_m"), (dict(block_k=8), "block_k"), (dict(group_m=0), "group_m"),
     (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages")],
)
def test_invalid_tile_configs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TileConfig(**kwargs)


def test_too_many_groups():
    with pytest.raises(ValueError, match="at most"):
        Plan("all_reduce", 16 * (MAX_GROUPS + 1), 16, 16, 2, SMALL, (1,) * (MAX_GROUPS + 1), num_programs=1)


def test_plans_are_frozen_and_hashable():
    a = default_plan("all_reduce", 8192, 8192, 8192, 2)
    b = default_plan("all_reduce", 8192, 8192, 8192, 2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.m = 1


def test_a_plans_cached_hash_follows_its_fields_and_is_never_carried_between_processes():
    a = default_plan("all_reduce", 8192, 8192, 8192, 2)
    changed = [dataclasses.replace(a, **{name: value}) for name, value in (
        ("num_programs", 100), ("comm_ctas", 4), ("tile", TileConfig(128, 128, 32, 4, 2, 4)),
        ("group_row_tiles", (32, 32)), ("sequential", True))]
    assert all(plan != a for plan in changed) and len({hash(plan) for plan in changed} | {hash(a)}) == 6
    state = pickle.dumps(a)
    assert b"_hash" not in state  # a string's hash is salted per process: an unpickled plan hashes its fields anew
    copied = pickle.loads(state)
    assert copied == a and hash(copied) == hash(a) and hash(copy.deepcopy(a)) == hash(a)
    rebuilt = Plan.from_dict(a.to_dict())
    assert rebuilt == a and hash(rebuilt) == hash(a) and len({a, rebuilt, copied}) == 1


@pytest.mark.parametrize("tiles_m,groups", [(64, 8), (7, 3), (5, 8), (1, 1), (128, 12), (16, 6)])
@pytest.mark.parametrize("profile", ["even", "small-first", "small-last"])
def test_split_rows(tiles_m, groups, profile):
    sizes = split_rows(tiles_m, groups, profile)
    assert sum(sizes) == tiles_m and min(sizes) >= 1 and len(sizes) == min(groups, tiles_m)
    if profile == "small-first":
        assert list(sizes) == sorted(sizes)
    if profile == "small-last":
        assert list(sizes) == sorted(sizes, reverse=True)
    if profile == "even":
        assert max(sizes) - min(sizes) <= 1


def test_split_rows_rejects_unknown_profile():
    with pytest.raises(ValueError, match="profile"):
        split_rows(8, 2, "random")


def test_default_plan_regimes():
    # Tiny outputs and short GEMMs run sequentially.
    assert default_plan("all_reduce", 128, 128, 128, 2).sequential
    assert default_plan("all_reduce", 1, 4096, 4096, 2).sequential
    assert default_plan("all_reduce", 8192, 8192, 8192, 1).sequential
    # Communication much shorter than the GEMM: sequential (overlap does not pay on NVLink there).
    assert default_plan("all_reduce", 8192, 8192, 8192, 2, comm_ratio=0.3).sequential
    # Compute-bound: even groups, one program per tile, NCCL's own CTAs.
    plan = default_plan("all_reduce", 8192, 8192, 8192, 2, comm_ratio=0.7)
    assert not plan.sequential and plan.num_groups == 8 and plan.grid_size == plan.num_tiles
    assert plan.comm_ctas == 0
    # Communication-bound: SMs left for NCCL, whose CTA count is set.
    plan = default_plan("all_reduce", 8192, 8192, 8192, 2, comm_ratio=3.0, num_sms=132)
    assert plan.grid_size == 100 and plan.comm_ctas == 8 and plan.num_groups == 6
    # Every override wins.
    plan = default_plan("all_reduce", 8192, 8192, 8192, 2, comm_ratio=3.0, num_groups=3, profile="small-last",
                        num_programs=7, comm_ctas=2)
    assert (plan.num_groups, plan.grid_size, plan.comm_ctas) == (3, 7, 2)
    assert list(plan.group_row_tiles) == sorted(plan.group_row_tiles, reverse=True)
    # Forced overlap at any shape, even one tile.
    plan = default_plan("all_reduce", 1, 1, 1, 2, allow_sequential=False)
    assert not plan.sequential and plan.num_tiles == 1 and plan.num_groups == 1


def test_describe_mentions_every_group():
    plan = default_plan("all_reduce", 8192, 8192, 8192, 2, comm_ratio=0.7)
    text = plan.describe(2)
    assert text.count("group ") == plan.num_groups and "16.00 MiB" in text


@pytest.mark.parametrize("m,world_size,block_m,rows", [(96, 2, 16, (1, 2)), (50, 2, 16, (2,)), (120, 4, 16, (1, 1)),
                                                        (8, 8, 16, (1,)), (255, 3, 32, (2, 1))])
def test_reduce_scatter_layout_lands_each_band_in_place(m, world_size, block_m, rows):
    """Replay the plan's tables on a C whose entries name their row: every group's workspace slice must hold, rank
    block after rank block, exactly the rows that reduce_scatter_tensor hands each rank for that band."""
    tile = TileConfig(block_m, 16, 16, 2, 1, 4)
    plan = Plan("reduce_scatter", m, 40, 8, world_size, tile, rows, num_programs=3)
    assert plan.blocks == world_size and plan.block_rows == m // world_size
    a_row, out_row, valid = plan.tile_rows()
    c = np.arange(m)
    workspace = np.full(m, -1)
    for p in range(plan.tiles_m):
        assert valid[p] >= 1 and a_row[p] // plan.block_rows == (a_row[p] + valid[p] - 1) // plan.block_rows
        workspace[out_row[p] : out_row[p] + valid[p]] = c[a_row[p] : a_row[p] + valid[p]]
    assert (workspace >= 0).all(), "every workspace row is written exactly by some tile"
    assert sorted(workspace.tolist()) == list(range(m))
    for grp in plan.groups:
        band = workspace[grp.out_row_start : grp.out_row_end].reshape(world_size, -1)
        for rank in range(world_size):
            want = np.arange(rank * plan.block_rows + grp.row_start, rank * plan.block_rows + grp.row_end)
            assert (band[rank] == want).all()
    # Tile order: each group a consecutive run that covers its band in every block.
    order = plan.tile_order()
    for grp in plan.groups:
        run = order[grp.tile_start : grp.tile_start + grp.tile_count] // plan.tiles_n
        assert sorted(set((run % plan.tiles_per_block).tolist())) == list(
            range(grp.row_start // block_m, -(-grp.row_end // block_m)))
        assert len(set((run // plan.tiles_per_block).tolist())) == world_size


def test_reduce_scatter_needs_m_divisible_by_world_size():
    with pytest.raises(ValueError, match="divisible by world_size"):
        Plan("reduce_scatter", 10, 16, 16, 4, SMALL, (1,), num_programs=1)
    plan = default_plan("reduce_scatter", 8192, 8192, 8192, 2, comm_ratio=0.7)
    assert plan.tiles_per_block == 32 and plan.tiles_m == 64 and sum(plan.group_row_tiles) == 32


def test_all_reduce_rows_are_the_identity():
    plan = default_plan("all_reduce", 100, 70, 30, 2, tile=SMALL, allow_sequential=False)
    a_row, out_row, valid = plan.tile_rows()
    assert (a_row == out_row).all() and (a_row == np.arange(plan.tiles_m) * 16).all()
    assert valid.tolist() == [16] * 6 + [4]


@pytest.mark.parametrize("m,world_size,block_m,rows", [(96, 2, 16, (1, 2)), (54, 3, 16, (1, 1)), (32, 4, 16, (1,))])
def test_all_gather_layout_and_order(m, world_size, block_m, rows):
    """The gathered workspace, as per-group all_gather_into_tensor calls leave it, holds at the rows each tile
    reads exactly the rows of the full A that the tile's C rows need; each rank's own shard comes first."""
    tile = TileConfig(block_m, 16, 16, 2, 1, 4)
    plan = Plan("all_gather", m, 40, 8, world_size, tile, rows, num_programs=3)
    shard = plan.block_rows
    a_full = np.arange(m)
    workspace = np.concatenate([
        np.concatenate([a_full[src * shard + g.row_start : src * shard + g.row_end] for src in range(world_size)])
        for g in plan.groups])
    a_row, out_row, valid = plan.tile_rows()
    for p in range(plan.tiles_m):
        assert (workspace[a_row[p] : a_row[p] + valid[p]] == a_full[out_row[p] : out_row[p] + valid[p]]).all()
    for rank in range(world_size):
        order, owner = plan.tile_order(rank), plan.tile_groups(rank)
        assert sorted(order.tolist()) == list(range(plan.num_tiles))
        local = order[: plan.local_tiles] // plan.tiles_n // plan.tiles_per_block
        assert (local == rank).all() and (owner[: plan.local_tiles] == -1).all()
        for grp in plan.groups:
            run = order[grp.tile_start : grp.tile_start + grp.tile_count] // plan.tiles_n // plan.tiles_per_block
            assert rank not in set(run.tolist()) and (owner[grp.tile_start : grp.tile_start + grp.tile_count]
                                                      == grp.index).all()
    with pytest.raises(ValueError, match="rank must be"):
        plan.tile_order(world_size)


def test_all_gather_default_plans_leave_sms_for_nccl():
    for ratio in (None, 0.7, 3.0):
        plan = default_plan("all_gather", 8192, 8192, 8192, 2, num_sms=132, comm_ratio=ratio,
                            allow_sequential=False)
        assert plan.comm_ctas >= 1 and plan.grid_size + plan.comm_ctas <= 132
    # The GEMM leaves 32 SMs free, not just the NCCL CTAs' 16, whatever the ratio.
    for ratio in (3.0, 0.7):
        assert default_plan("all_gather", 8192, 8192, 8192, 2, num_sms=132, comm_ratio=ratio).grid_size == 100
    assert default_plan("all_gather", 8192, 8192, 8192, 2, comm_ratio=0.1).sequential
    # Reduce-scatter overlaps from a lower ratio than all-reduce.
    assert not default_plan("reduce_scatter", 16384, 8192, 4096, 2, comm_ratio=0.44).sequential
    assert default_plan("all_reduce", 16384, 8192, 4096, 2, comm_ratio=0.44).sequential


def test_rates_estimate_each_collective():
    from flashoverlap.tune.rates import Rates

    rates = Rates(gemm_tflops=500.0, allreduce_busbw_gbs=100.0)
    assert rates.gemm_ms(1000, 1000, 1000) == pytest.approx(2e9 / 500e12 * 1e3)  # 2 GFLOP at 500 TFLOP/s, in ms
    all_reduce = rates.collective_ms("all_reduce", 1 << 30, 2)
    assert all_reduce == pytest.approx((1 << 30) / 100e9 * 1e3)
    # Half the bytes, but measured at about 0.7 of the all-reduce's time on 2x H200.
    assert rates.collective_ms("reduce_scatter", 1 << 30, 2) == pytest.approx(all_reduce * 0.7)
    assert rates.collective_ms("all_gather", 1 << 30, 2) == pytest.approx(all_reduce * 0.7)


def test_all_gather_plans_leave_nccl_its_sms_and_the_op_checks_it():
    from flashoverlap.comm.tp.nccl import check_leaves_nccl_sms
    from flashoverlap.plan import nccl_free_sms

    assert nccl_free_sms(132, 16) == 32  # the CTAs plus a margin on an H200
    assert nccl_free_sms(132, 48) == 48
    assert nccl_free_sms(40, 8) == 10  # small GPUs keep three quarters for the GEMM
    for sms, ratio in ((132, 3.0), (132, 0.7), (40, 0.7), (20, 3.0)):
        plan = default_plan("all_gather", 4096, 4096, 4096, 2, num_sms=sms, comm_ratio=ratio, allow_sequential=False)
        check_leaves_nccl_sms(plan, sms)  # default plans always pass
    greedy = default_plan("all_gather", 4096, 4096, 4096, 2, num_sms=132, num_programs=116, allow_sequential=False)
    with pytest.raises(ValueError, match="deadlock rule 2"):
        check_leaves_nccl_sms(greedy, 132)  # only the CTAs' 16 SMs left
    no_ctas = default_plan("all_gather", 4096, 4096, 4096, 2, num_sms=132, num_programs=64, comm_ctas=0,
                           allow_sequential=False)
    with pytest.raises(ValueError, match="comm_ctas >= 1"):
        check_leaves_nccl_sms(no_ctas, 132)


def test_p2p_plans():
    ag = default_plan("all_gather", 8192, 8192, 8192, 2, num_sms=132, comm_ratio=0.05, path="p2p")
    assert (ag.path, ag.sequential, ag.num_groups, ag.gemm) == ("p2p", False, 4, "cublas")
    rs = default_plan("reduce_scatter", 8192, 8192, 8192, 2, num_sms=132, comm_ratio=0.05, path="p2p")
    assert (rs.path, rs.sequential, rs.num_groups, rs.gemm) == ("p2p", False, 2, "cublas")
    assert default_plan("reduce_scatter", 256, 256, 256, 2, path="p2p").sequential  # too small to overlap
    ar = default_plan("all_reduce", 8192, 8192, 8192, 2, num_sms=132, path="p2p")
    assert (ar.path, ar.sequential, ar.num_groups, ar.sub_bands) == ("p2p", False, 8, 4)  # W blocks of 4
    ar8 = default_plan("all_reduce", 8192, 8192, 8192, 8, path="p2p", num_groups=3)
    assert (ar8.num_groups, ar8.sub_bands) == (24, 3)
    # Few tile rows: as many sub-bands per rank block as there are, else sequential.
    assert default_plan("all_reduce", 384, 16384, 8192, 2, path="p2p").sub_bands == 1
    assert default_plan("all_reduce", 4096, 8192, 8192, 2, path="p2p").sub_bands == 4
    assert default_plan("all_reduce", 2048, 8192, 8192, 2, path="p2p").sub_bands == 2  # sub-bands of >= 512 rows
    with pytest.raises(ValueError, match="path must be one of"):
        default_plan("all_gather", 8192, 8192, 8192, 2, path="nvshmem")
    with pytest.raises(ValueError, match="multiple of world_size"):
        Plan("all_reduce", 8192, 8192, 8192, 2, group_row_tiles=(20, 22, 22), path="p2p", gemm="cublas")
    with pytest.raises(ValueError, match="must be 'cublas' on the p2p path"):
        Plan("reduce_scatter", 8192, 8192, 8192, 2, group_row_tiles=(32,), path="p2p")
    with pytest.raises(ValueError, match="up to 8 ranks"):
        Plan("reduce_scatter", 8192 * 2, 8192, 8192, 16, group_row_tiles=(8,), path="p2p", gemm="cublas")
    assert "copy engines" in ag.describe()


def test_cublas_band_plans():
    plan = default_plan("reduce_scatter", 4096, 4096, 4096, 2, gemm="cublas", num_groups=3, allow_sequential=False)
    assert (plan.gemm, plan.num_groups, plan.path) == ("cublas", 3, "nccl")
    assert "bands computed by cuBLAS" in plan.describe()
    assert Plan.from_dict(plan.to_dict()) == plan
    legacy = {key: value for key, value in plan.to_dict().items() if key != "gemm"}
    assert Plan.from_dict(legacy).gemm == "triton"  # cache entries written before the field existed
    with pytest.raises(ValueError, match="Plan.gemm must be one of"):
        default_plan("all_reduce", 4096, 4096, 4096, 2, gemm="cutlass", allow_sequential=False)


def test_only_a_reductions_signalling_gemm_counts_tiles():
    # What the NCCL communicator waits on follows from it: counters (and, in a graph, the wait kernel it loads first),
    # else events, flags or nothing.
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        for gemm in ("triton", "cublas"):
            plan = default_plan(op, 4096, 4096, 4096, 2, gemm=gemm, allow_sequential=False)
            assert plan.counts_tiles == (op != "all_gather" and gemm == "triton"), (op, gemm)
        sequential = dataclasses.replace(default_plan(op, 4096, 4096, 4096, 2, allow_sequential=False),
                                         sequential=True)
        assert not sequential.counts_tiles, op
