"""The fp8 plan policy (``tune/fp8.py``): fp8 tiles under the overlap rules, block-wise cuBLAS bands only where
torch's block-wise kernel serves, and the output dtype's size in the overlap rule's byte count."""

import pytest

from flashoverlap.tune.fp8 import fp8_plan, fp8_tiles


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_fp8_plans_take_fp8_tiles_and_block_wise_cublas_bands_only_where_torch_serves(scaling):
    plan = fp8_plan("all_reduce", 8192, 8192, 4096, 2, scaling, cublas_block=True)
    assert not plan.sequential and plan.tile.block_k == 128
    assert plan.tile == fp8_tiles(8192, 8192, 4096, scaling, "all_reduce").tile_config()
    assert plan.gemm == ("cublas" if scaling == "block" else "triton")
    assert fp8_plan("all_reduce", 8192, 8192, 4096, 2, scaling).gemm == "triton"  # torch's block kernel absent
    assert fp8_plan("all_reduce", 8192, 8192, 4096, 2, scaling, path="p2p", cublas_block=True).path == "p2p"


def test_fp8_plans_follow_the_overlap_rules():
    assert fp8_plan("all_reduce", 64, 64, 256, 2, "row").sequential  # too small to hide anything
    assert fp8_plan("reduce_scatter", 8192, 8192, 4096, 2, "row", comm_ratio=0.1).sequential  # GEMM-bound
    assert not fp8_plan("reduce_scatter", 8192, 8192, 4096, 2, "row", comm_ratio=0.8).sequential
    # The overlap rule counts output bytes in the output dtype: fp32 output doubles them.
    m = 1024
    assert fp8_plan("all_reduce", m, 1024, 4096, 2, "row", out_size=2).sequential
    assert not fp8_plan("all_reduce", m, 1024, 4096, 2, "row", out_size=4, num_sms=8).sequential
    with pytest.raises(ValueError, match="scaling must be one of"):
        fp8_plan("all_reduce", 64, 64, 64, 2, "blocks")


def test_fp8_tiles_take_a_deeper_pipeline_where_the_sweep_found_it_paid():
    """logs/issue35's sweep: 4 stages for K loops 7168 deep under one program per tile and for the persistent
    all-gather, 3 for shorter K loops; block-wise one 128-deep slab per step."""
    assert fp8_tiles(2048, 8192, 7168, "row").num_stages == 4
    assert fp8_tiles(8192, 8192, 4096, "tensor").num_stages == 3
    assert fp8_tiles(4096, 4096, 4096, "row", "all_gather").num_stages == 4
    assert fp8_plan("all_gather", 8192, 8192, 4096, 2, "row").tile.num_stages == 4
    assert fp8_tiles(8192, 8192, 4096, "block").block_k == 128
