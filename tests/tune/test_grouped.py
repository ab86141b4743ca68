"""The grouped-GEMM policy (``tune/grouped.py``): the cost model's reading of a call (segments, kernels, host calls),
its arithmetic, which ways may run, the choice it makes with coefficients passed in, and the plan-level choice
(the hybrid, and no Triton). The coefficients' fit and its check on unseen configs are device diagnostics
(``benchmarks/diagnostics/grouped_gemm_fit.py``, ``grouped_gemm_validate.py``)."""

import pytest
import torch

from flashoverlap.tune import grouped
from flashoverlap.tune.grouped import GroupedCall, WayCosts, choose_grouped_gemm, cost_ms, expert_gemm, gpu_ms


def _costs(**per_way) -> dict[str, WayCosts]:
    """Coefficients for the three ways: one rate for all, changed per way as given."""
    base = {"tflops": 500.0, "tbps": 2.0, "pad_rows": 128, "kernel_us": 0.0, "tile_us": 0.0, "host_us": 0.0}
    return {way: WayCosts(**{**base, **per_way.get(way, {})}) for way in grouped.WAYS}


def test_a_call_as_the_model_reads_it():
    call = GroupedCall.balanced(4, 10, 8, 16, chunks=2)
    assert call.rows_per_expert == (3, 3, 2, 2) and call.rows == 10
    assert call.segments() == [[2, 2, 1, 1], [1, 1, 1, 1]]  # each expert's rows split over the chunks
    skewed = GroupedCall((7, 0, 1), 8, 16, chunks=2)
    assert skewed.segments() == [[4, 0, 1], [3, 0, 0]]
    assert grouped.host_calls("triton", skewed) == grouped.host_calls("cublas", skewed) == 2
    assert grouped.host_calls("loop", skewed) == 3  # one torch.mm per non-empty segment
    # Per kernel: padded FLOPs, bytes (each multiplied expert's weights once, the rows in and out), output tiles.
    fused = grouped.kernels("triton", skewed, 4)
    assert fused == [(2.0 * 8 * 16 * 8, 2.0 * (2 * 8 * 16 + 5 * (8 + 16)), 2),
                     (2.0 * 8 * 16 * 4, 2.0 * (8 * 16 + 3 * 24), 1)]
    assert [k[0] for k in grouped.kernels("loop", skewed, 4)] == [2.0 * 8 * 16 * 4] * 3


def test_gpu_time_is_a_roofline_per_kernel_plus_launches_and_tiles():
    call = GroupedCall((256,), 1024, 1024, chunks=1)  # 0.537 GFLOP, 2.6 MB
    costs = WayCosts(tflops=1000.0, tbps=1.0, pad_rows=128, kernel_us=5.0, tile_us=0.5, host_us=10.0)
    flops, nbytes = 2.0 * 256 * 1024 * 1024, 2.0 * (1024 * 1024 + 256 * 2048)
    memory_ms = nbytes / 1e9  # 1 TB/s: the bytes bind
    assert memory_ms > flops / 1e12
    tiles = 2 * 4  # 256 rows in 128-row tiles, 1024 columns in 256-column tiles
    assert gpu_ms("triton", call, costs) == pytest.approx(memory_ms + (5.0 + 0.5 * tiles) / 1e3)
    # The host time, where it is the larger, is the cost.
    slow_host = WayCosts(**{**costs.__dict__, "host_us": 5000.0})
    assert cost_ms("triton", call, slow_host) == pytest.approx(5.0)


def test_the_cheapest_allowed_way_is_chosen():
    call = GroupedCall.balanced(8, 8192, 4096, 4096, chunks=2)
    fast = {"tflops": 900.0}
    for way in grouped.WAYS:
        others = [w for w in grouped.WAYS if w != way]
        costs = _costs(**{way: fast})
        assert choose_grouped_gemm(call, torch.bfloat16, host_counts=True, costs=costs) == way
        if way == "loop":  # bounded mode: no host sizes, no loop
            assert choose_grouped_gemm(call, torch.bfloat16, costs=costs) in others
        if way == "cublas":  # bf16 rows of 16-byte multiples, on sm90 where the capability is known
            assert choose_grouped_gemm(call, torch.float16, host_counts=True, costs=costs) != "cublas"
            assert choose_grouped_gemm(call, torch.bfloat16, host_counts=True, device_capability=(8, 0),
                                       costs=costs) != "cublas"
            odd = GroupedCall.balanced(8, 8192, 4100, 4096, chunks=2)
            assert choose_grouped_gemm(odd, torch.bfloat16, host_counts=True, costs=costs) != "cublas"
            assert choose_grouped_gemm(call, torch.bfloat16, host_counts=True, device_capability=(9, 0),
                                       costs=costs) == "cublas"
    for host_counts in (False, True):  # fp32: fitted on 16-bit types only, Triton (tf32) as before the model
        assert choose_grouped_gemm(call, torch.float32, host_counts=host_counts, costs=_costs(loop=fast)) == "triton"


def test_host_time_decides_where_the_gpu_time_is_short():
    """Triton's GPU time is the shortest, but its calls take longer to issue than small calls take to run: the way
    with the cheaper calls wins there, and Triton where the GPU time is long."""
    costs = _costs(triton={"tflops": 800.0, "host_us": 150.0}, cublas={"tflops": 600.0, "host_us": 25.0},
                   loop={"tflops": 100.0})
    small = GroupedCall.balanced(8, 1024, 1024, 1024, chunks=2)
    large = GroupedCall.balanced(8, 65536, 4096, 4096, chunks=2)
    assert choose_grouped_gemm(small, torch.bfloat16, costs=costs) == "cublas"
    assert choose_grouped_gemm(large, torch.bfloat16, costs=costs) == "triton"
    # Each chunk is a call: over more chunks the host time of the small call grows.
    assert cost_ms("triton", GroupedCall.balanced(8, 1024, 1024, 1024, chunks=4), costs["triton"]) == \
        pytest.approx(0.6)


def test_skewed_routing_changes_the_cost():
    """The same rows, skewed: the small segments of the unpopular experts cost a fused kernel padding (each rounded
    up to a tile), and the loop a launch each; rows on few experts cost the loop few launches. The model sees both
    through the row counts, not their total."""
    costs = _costs(triton={"kernel_us": 0.0}, loop={"kernel_us": 30.0, "host_us": 0.0})
    balanced = GroupedCall.balanced(64, 64 * 200, 2048, 2048, chunks=1)
    skewed = GroupedCall((64 * 200 - 63 * 2,) + (2,) * 63, 2048, 2048, chunks=1)
    assert balanced.rows == skewed.rows
    assert gpu_ms("triton", skewed, costs["triton"]) > gpu_ms("triton", balanced, costs["triton"])  # padding
    assert gpu_ms("loop", GroupedCall((64 * 200,) + (0,) * 63, 2048, 2048), costs["loop"]) < \
        gpu_ms("loop", balanced, costs["loop"])  # one launch instead of 64


def test_the_fitted_coefficients_load():
    assert set(grouped.COSTS) == set(grouped.WAYS)
    for costs in grouped.COSTS.values():
        assert costs.tflops > 0 and costs.tbps > 0 and costs.pad_rows >= 1
        assert min(costs.kernel_us, costs.tile_us, costs.host_us) >= 0
    assert grouped.grouped_costs.FITTED_FROM


def test_the_plans_choice():
    deepseek = GroupedCall.balanced(128, 32768, 7168, 4096, chunks=2)
    assert expert_gemm(deepseek, torch.bfloat16, mode="exact", device_capability=(9, 0)) == ("hybrid",
                                                                                            grouped.HYBRID_CUT)
    gemm, cut = expert_gemm(deepseek, torch.bfloat16, mode="bounded", device_capability=(9, 0))
    assert gemm in ("triton", "cublas") and cut is None
    # Without Triton: exact mode loops where the policy would run Triton, bounded mode takes cuBLAS.
    odd = GroupedCall.balanced(4, 4096, 1000, 1004, chunks=2)  # cuBLAS's grouped GEMM refuses these rows
    assert expert_gemm(odd, torch.bfloat16, mode="exact", device_capability=(9, 0), triton=False) != ("triton", None)
    assert expert_gemm(odd, torch.bfloat16, mode="bounded", device_capability=(9, 0), triton=False) == ("cublas",
                                                                                                        None)
    assert expert_gemm(deepseek, torch.bfloat16, mode="exact", device_capability=(9, 0), triton=False)[0] != "hybrid"
