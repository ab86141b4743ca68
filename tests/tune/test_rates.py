"""The rates' estimates (``tune/rates.py``), without a GPU."""

import pytest

from flashoverlap.tune.defaults import default_plan
from flashoverlap.tune.rates import Rates


def test_a_group_of_one_rank_moves_nothing_and_runs_sequentially():
    # One rank measures an all-reduce bus bandwidth of 0: the estimate must not divide by it (a one-GPU group's
    # first call on CUDA raised ZeroDivisionError), and the plan is sequential.
    rates = Rates(gemm_tflops=700.0, allreduce_busbw_gbs=0.0)
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        assert rates.collective_ms(op, 1 << 30, 1) == 0.0
        ratio = rates.collective_ms(op, 1 << 30, 1) / rates.gemm_ms(8192, 8192, 8192)
        assert default_plan(op, 8192, 8192, 8192, 1, comm_ratio=ratio).sequential


@pytest.mark.parametrize("world", [2, 4, 8])
def test_an_all_reduce_moves_2_w_minus_1_over_w_of_its_bytes_at_the_bus_bandwidth(world):
    rates = Rates(gemm_tflops=700.0, allreduce_busbw_gbs=200.0)
    assert rates.all_reduce_ms(200 * 10**6, world) == pytest.approx(2.0 * (world - 1) / world)
    assert rates.collective_ms("reduce_scatter", 200 * 10**6, world) == pytest.approx(0.7 * 2.0 * (world - 1) / world)
