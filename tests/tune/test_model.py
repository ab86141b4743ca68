"""The performance model and the plan search on made-up machines and curves, with exact expected answers."""

import math

import pytest

from flashoverlap.plan import TileConfig
from flashoverlap.tune.defaults import default_plan
from flashoverlap.tune.model import Curve, Machine, predict, sequential_ms
from flashoverlap.tune.search import candidates, rank

TILE = TileConfig(16, 16, 16, 2, 1, 4)
FLAT = Curve((1, 10**12), (0.3, 0.3))  # every collective 0.3 ms


def test_curve_interpolates_log_log_and_extrapolates_at_the_last_bandwidth():
    curve = Curve((100, 10000), (1.0, 100.0))
    assert curve.time_ms(100) == 1.0 and curve.time_ms(10000) == 100.0
    assert curve.time_ms(1000) == pytest.approx(10.0)  # halfway in log-log
    assert curve.time_ms(10) == 1.0  # latency-bound below the first point
    assert curve.time_ms(20000) == pytest.approx(100.0 + 10000 * 99.0 / 9900)
    assert Curve.from_dict(curve.to_dict()) == curve
    for sizes, ms in (((1,), (1.0,)), ((2, 1), (1.0, 2.0)), ((1, 2), (1.0, 0.0))):
        with pytest.raises(ValueError):
            Curve(sizes, ms)


def _plan(groups, op="all_reduce", **kw):
    m = 256 * (2 if op != "all_reduce" else 1)
    return default_plan(op, m, 256, 64, 2, tile=TILE, num_groups=groups, allow_sequential=False, **kw)


def test_reduction_timeline_by_hand():
    plan = _plan(2)  # 16 x 16 = 256 tiles, 128 per group, one program per tile
    machine = Machine(num_sms=256, wave_ms=1.0, cublas_ms=0.9)  # one wave: the GEMM takes 1 ms
    p = predict(plan, machine, FLAT)
    assert p.group_done_ms == (0.5, 1.0) and p.comm_done_ms == pytest.approx((0.8, 1.3)) and p.total_ms == 1.3
    # Beside the GEMM the collective runs at half speed: group 0 does 0.25 ms of its 0.3 by the GEMM's end.
    slow = predict(plan, Machine(256, 1.0, 0.9, comm_slowdown=2.0), FLAT)
    assert slow.comm_done_ms == pytest.approx((1.05, 1.35))
    # The GEMM at half speed while a collective runs: group 1 does 0.15 ms of its 0.5 beside collective 0
    # (0.5-0.8), the rest alone; collective 1 then runs alone.
    both = predict(plan, Machine(256, 1.0, 0.9, gemm_slowdown=2.0), FLAT)
    assert both.group_done_ms == pytest.approx((0.5, 1.15)) and both.comm_done_ms == pytest.approx((0.8, 1.45))
    assert both.total_ms == pytest.approx(1.45)
    assert sequential_ms(plan, machine, FLAT) == pytest.approx(1.2)


def test_all_gather_timeline_by_hand():
    plan = _plan(2, op="all_gather", num_sms=512, num_programs=512)  # NCCL path, gathered M 512: 512 tiles
    machine = Machine(num_sms=512, wave_ms=1.0, cublas_ms=0.9)
    p = predict(plan, machine, FLAT)
    # Bands arrive at 0.3 and 0.6; the local half ends at 0.5; each band's remote tiles take a quarter.
    assert p.comm_done_ms == pytest.approx((0.3, 0.6))
    assert p.group_done_ms == pytest.approx((0.5, 0.75)) and p.total_ms == pytest.approx(1.0)
    # The GEMM at half speed while the bands arrive (0-0.6): 0.3 ms of the local 0.5 done by then, the rest by
    # 0.8; the bands' tiles after that, alone.
    slow = predict(plan, Machine(512, 1.0, 0.9, gemm_slowdown=2.0), FLAT)
    assert slow.comm_done_ms == pytest.approx((0.3, 0.6))
    assert slow.group_done_ms == pytest.approx((0.8, 1.05)) and slow.total_ms == pytest.approx(1.3)
    # A GEMM waiting for its band leaves the band's transfer at full speed (communication slowed 2x only while
    # the GEMM computes): local tiles 0-0.1 (band 0 does 0.05 of its 0.3), band 0 alone to 0.35; its tiles
    # 0.35-0.4 (band 1 does 0.025), band 1 alone to 0.675, its tiles to 0.725.
    quick = predict(plan, Machine(512, 0.2, 0.9, comm_slowdown=2.0), FLAT)
    assert quick.comm_done_ms == pytest.approx((0.35, 0.675)) and quick.group_done_ms == pytest.approx((0.35, 0.675))
    assert quick.total_ms == pytest.approx(0.725)


def test_p2p_ring_timelines_by_hand():
    # Reduce-scatter, W = 2, M 512 (two rank blocks of 256 rows), 2 sub-bands of 128 rows; a 128-row matmul takes
    # 0.2 ms, a pull 0.3 ms (FLAT). Step 0: C 0-0.2, 0.2-0.4; pulls 0.2-0.5, 0.5-0.8; step 1: C 0.5-0.7, 0.8-1.0.
    machine = Machine(num_sms=132, wave_ms=1.0, cublas_ms=0.8, band_ms=((128, 0.2), (256, 0.4)))
    rs = default_plan("reduce_scatter", 512, 64, 64, 2, tile=TileConfig(128, 64, 64, 8, 3, 8), num_groups=2,
                      path="p2p", allow_sequential=False)
    p = predict(rs, machine, FLAT)
    assert p.comm_done_ms == pytest.approx((0.5, 0.8)) and p.group_done_ms == pytest.approx((0.4, 1.0))
    assert p.total_ms == pytest.approx(1.0)
    # All-reduce: the same ring, then each peer's two reduced sub-bands (written at 0.7 and 1.0) pulled once X is
    # free (0.8): 0.8-1.1 and 1.1-1.4.
    ar = default_plan("all_reduce", 512, 64, 64, 2, tile=TileConfig(128, 64, 64, 8, 3, 8), num_groups=2,
                      path="p2p", allow_sequential=False)
    assert ar.sub_bands == 2 and [g.rows for g in ar.groups] == [128] * 4
    assert predict(ar, machine, FLAT).comm_done_ms == pytest.approx((0.5, 0.8, 1.1, 1.4))
    # All-gather, one sub-band: the own shard (0.4) beside the pull of the peer's (0.6), then its matmul.
    ag = default_plan("all_gather", 512, 64, 64, 2, tile=TileConfig(128, 64, 64, 8, 3, 8), path="p2p",
                      allow_sequential=False)
    p = predict(ag, machine, Curve((1, 10**12), (0.6, 0.6)))
    assert p.comm_done_ms == pytest.approx((0.6,)) and p.total_ms == pytest.approx(1.0)
    assert sorted(c.sub_bands for c in candidates("reduce_scatter", 8192, 8192, 8192, 2, 132, path="p2p")
                  if not c.sequential) == [1, 2, 3, 4, 6, 8]


def test_search_runs_sequentially_when_the_collective_is_negligible():
    tiny = Curve((1, 10**12), (1e-6, 1e-6))
    machine = Machine(num_sms=132, wave_ms=0.2, cublas_ms=0.5)  # our GEMM (4-6 waves) slower than cuBLAS
    best = rank(candidates("all_reduce", 4096, 4096, 4096, 2, 132), machine, tiny)[0][1]
    assert best.sequential


def test_search_starts_communication_as_early_as_possible_when_it_dominates():
    linear = Curve((1, 10**12), (1e-6, 1e6))  # pure bandwidth, no latency, 1 GB/s: communication-bound
    machine = Machine(num_sms=132, wave_ms=0.1, cublas_ms=1.0)
    plans = candidates("all_reduce", 8192, 8192, 8192, 2, 132)
    best = rank(plans, machine, linear)[0][1]
    smallest_first = min(p.group_row_tiles[0] for p in plans if not p.sequential)
    # The total is the first group's GEMM time plus all the communication: the smallest first group, computed
    # on the most SMs (one program per tile).
    assert best.group_row_tiles[0] == smallest_first
    assert best.grid_size == best.num_tiles and best.comm_ctas == 0
    assert not math.isclose(predict(best, machine, linear).total_ms, 0.0)


def test_all_gather_candidates_never_starve_nccl():
    for plan in candidates("all_gather", 8192, 8192, 8192, 2, 132):  # only a GEMM spinning on bands could
        assert plan.sequential or plan.gemm == "cublas" or (plan.comm_ctas >= 1 and plan.grid_size <= 100)
    assert all(p.comm_ctas == 0 for p in candidates("all_gather", 8192, 8192, 8192, 2, 132, path="p2p"))


def test_cublas_bands_run_at_cublas_speed_and_are_candidates():
    plan = _plan(2, gemm="cublas")  # two bands of 128 tiles; cuBLAS takes 0.9 ms for all
    p = predict(plan, Machine(num_sms=256, wave_ms=1.0, cublas_ms=0.9), FLAT)
    assert p.group_done_ms == pytest.approx((0.45, 0.9)) and p.total_ms == pytest.approx(1.2)
    plans = candidates("all_reduce", 8192, 8192, 8192, 2, 132)
    assert sorted(p.num_groups for p in plans if p.gemm == "cublas") == [2, 4, 8]
    assert all(p.gemm == "cublas" for p in candidates("all_reduce", 8192, 8192, 8192, 2, 132, path="p2p")
               if not p.sequential)


def test_cublas_bands_take_their_measured_time_per_matmul():
    # Reduce-scatter, gathered M 512 in 2 row blocks, 2 groups of 128 rows: a matmul per group and block.
    plan = _plan(2, op="reduce_scatter", gemm="cublas")
    assert [grp.rows for grp in plan.groups] == [128, 128]
    share = predict(plan, Machine(num_sms=256, wave_ms=1.0, cublas_ms=0.9), FLAT)
    assert share.group_done_ms == pytest.approx((0.45, 0.9)) and share.total_ms == pytest.approx(1.2)
    measured = predict(plan, Machine(num_sms=256, wave_ms=1.0, cublas_ms=0.9, band_ms=((128, 0.5),)), FLAT)
    assert measured.group_done_ms == pytest.approx((1.0, 2.0)) and measured.total_ms == pytest.approx(2.3)
    # All-gather: the own shard's band of each group first (2 x 0.2), then each group's other shard on arrival.
    plan = _plan(2, op="all_gather", gemm="cublas")
    p = predict(plan, Machine(num_sms=256, wave_ms=1.0, cublas_ms=0.9, band_ms=((128, 0.2),)), FLAT)
    assert p.comm_done_ms == pytest.approx((0.3, 0.6))
    assert p.group_done_ms == pytest.approx((0.4, 0.6)) and p.total_ms == pytest.approx(0.8)


def test_tuner_keeps_sequential_unless_a_plan_beats_it_clearly():
    from flashoverlap.tune.tuner import SEQUENTIAL_MARGIN, choose

    seq = {"plan": {"sequential": True}, "measured_ms": 1.0}
    close = {"plan": {"sequential": False}, "measured_ms": 1.0 / (1 + SEQUENTIAL_MARGIN / 2)}
    clear = {"plan": {"sequential": False}, "measured_ms": 0.9}
    assert choose([close, seq]) is seq
    assert choose([close, clear, seq]) is clear
    assert choose([close]) is close  # no sequential timed: the fastest


def test_ranking_uses_each_tile_configurations_own_machine():
    from flashoverlap.tune.search import tile_choices

    (wide,) = tile_choices(8192, 8192, 8192)
    narrow = TileConfig(128, 128, 64, 8, 4, 8)
    plans = [default_plan("all_reduce", 8192, 8192, 8192, 2, tile=tile, num_groups=4, allow_sequential=False)
             for tile in (wide, narrow)]
    tiny = Curve((1, 10**12), (1e-3, 1e-3))
    # Narrow tiles' waves (32 of them) at a third of the wide ones' time (16 waves): 2.1 ms against 3.2.
    machines = {wide: Machine(132, 0.2, 3.0), narrow: Machine(132, 0.2 / 3, 3.0)}
    assert rank(plans, machines, tiny)[0][1].tile == narrow
    machines[narrow] = Machine(132, 0.2, 3.0)  # as slow per wave as the wide ones, with twice the waves
    assert rank(plans, machines, tiny)[0][1].tile == wide


def test_a_persistent_grid_takes_its_measured_time():
    plan = default_plan("all_reduce", 8192, 8192, 8192, 2, num_groups=4, num_programs=100, allow_sequential=False)
    tiny = Curve((1, 10**12), (1e-3, 1e-3))
    # 2048 tiles on 100 programs: 21 whole waves of 0.1 ms unless the grid's time was measured.
    assert predict(plan, Machine(132, 0.1, 3.0), tiny).group_done_ms[-1] == pytest.approx(2.1)
    measured = predict(plan, Machine(132, 0.1, 3.0, grid_ms=((100, 1.8),)), tiny)
    assert measured.group_done_ms == pytest.approx((0.45, 0.9, 1.35, 1.8))
    one_per_tile = default_plan("all_reduce", 8192, 8192, 8192, 2, num_groups=4, allow_sequential=False)
    assert predict(one_per_tile, Machine(132, 0.1, 3.0, grid_ms=((100, 1.8),)), tiny).group_done_ms[-1] == \
        pytest.approx(1.6)  # 2048 tiles, 132 at a time: 16 waves


def test_ranking_charges_cublas_bands_their_measured_time():
    # rank() predicts with each plan's machine figures: the band times must reach the model.
    plans = [p for p in candidates("all_reduce", 8192, 8192, 8192, 2, 132) if p.gemm == "cublas"]
    heights = {grp.rows for p in plans for grp in p.groups}
    slow_bands = Machine(132, 0.1, 1.0, band_ms=tuple((h, 10.0) for h in heights))
    for predicted, plan in rank(plans, slow_bands, FLAT):
        assert predicted >= 10.0 * plan.num_groups


def test_machine_figures_round_trip_through_dicts():
    machine = Machine(132, 0.1, 1.5, 1.07, 1.6, 0.01, ((512, 0.2), (1024, 0.35)), ((100, 1.3),))
    assert Machine.from_dict(machine.to_dict()) == machine
    assert Machine.from_dict({**machine.to_dict(), "comm_sms": 16}) == machine  # older files' extra field


def test_slowdowns_come_from_the_curve_file_else_the_defaults(tmp_path, monkeypatch):
    from flashoverlap import settings
    from flashoverlap.tune import cache, tuner

    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    key = cache.cache_key("NVIDIA H200", 2, "all_reduce", "nccl", "bfloat16")
    assert tuner.load_slowdowns(key) == tuner.SLOWDOWNS["nvlink"]  # nothing measured yet
    tuner.store_curve(key, FLAT, (1.04, 1.5))
    assert tuner.load_curve(key) == FLAT and tuner.load_slowdowns(key) == (1.04, 1.5)
    tuner.store_curve(key, FLAT)  # a curve without slowdowns (written before they were measured)
    assert tuner.load_slowdowns(key) == tuner.SLOWDOWNS["nvlink"]
    tuner.curve_file(key).write_text("{not json")
    assert tuner.load_curve(key) is None and tuner.load_slowdowns(key) == tuner.SLOWDOWNS["nvlink"]
    assert tuner.load_slowdowns({**key, "path": "p2p"}) == tuner.SLOWDOWNS["p2p"]
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    settings.refresh()  # the environment is read once: read it again
    assert tuner.load_slowdowns(cache.cache_key("NVIDIA H200", 2, "all_reduce", "nccl", "bfloat16")) == \
        tuner.SLOWDOWNS["pcie-like"]


def test_nccl_reduction_candidates_try_nccls_own_cta_count_and_eight():
    from flashoverlap.tune.search import REDUCTION_NCCL_CTAS

    plans = candidates("reduce_scatter", 8192, 8192, 8192, 2, 132)
    assert {p.comm_ctas for p in plans if p.gemm == "triton" and not p.sequential} == set(REDUCTION_NCCL_CTAS)
    twins = [p for p in plans if p.group_row_tiles == plans[1].group_row_tiles and p.grid_size == plans[1].grid_size]
    assert len({p.comm_ctas for p in twins}) == 2  # tie in the model; the timed top few decide
