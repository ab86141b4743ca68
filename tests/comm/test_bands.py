"""cuBLAS-band plans write exactly the layout the signalling GEMM writes (checked on the CPU against the plan's
row tables, the same oracle as the kernel's interpreter tests)."""

import pytest
import torch

from flashoverlap.comm.tp.nccl import compute_bands
from flashoverlap.plan import TileConfig
from flashoverlap.tune.defaults import default_plan


@pytest.mark.parametrize("op,m,world_size,groups", [("all_reduce", 77, 2, 3), ("reduce_scatter", 96, 2, 3),
                                                    ("reduce_scatter", 90, 3, 2), ("reduce_scatter", 200, 4, 5)])
def test_bands_land_where_the_plan_puts_them(op, m, world_size, groups):
    plan = default_plan(op, m, 40, 24, world_size, tile=TileConfig(16, 16, 16, 2, 1, 4), num_groups=groups,
                        gemm="cublas", allow_sequential=False)
    a, b = torch.randn(m, 24, dtype=torch.float64), torch.randn(24, 40, dtype=torch.float64)
    out = torch.full((m, 40), float("nan"), dtype=torch.float64)
    assert compute_bands(a, b, plan, out) == []  # no events on the CPU
    want = torch.full_like(out, float("nan"))
    product = a @ b
    for a_row, out_row, rows in zip(*plan.tile_rows()):
        want[out_row : out_row + rows] = product[a_row : a_row + rows]
    torch.testing.assert_close(out, want, equal_nan=True)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("op,mode", [("all_reduce", "tensor"), ("reduce_scatter", "row"), ("reduce_scatter", "block")])
def test_fp8_bands_land_where_the_plan_puts_them_each_scaled_by_its_rows(op, mode):
    from flashoverlap.comm.scaled import Scales
    from tests.ops.test_scaled import expected, quantise

    m, n, k = 96, 40, 256
    plan = default_plan(op, m, n, k, 2, tile=TileConfig(16, 16, 16, 2, 1, 4), num_groups=3, gemm="cublas",
                        allow_sequential=False)
    a, sa = quantise(torch.randn(m, k), mode)
    b, sb = quantise(torch.randn(k, n), mode, operand="b")
    b = b.t().contiguous().t()
    if mode == "row":
        sb = sb.reshape(1, n)
    out = torch.full((m, n), float("nan"), dtype=torch.float32)
    compute_bands(a, b, plan, out, Scales.of(sa, sb, torch.float32))
    product = expected(a, b, sa, sb, mode, torch.float32)
    want = torch.full_like(out, float("nan"))
    for a_row, out_row, rows in zip(*plan.tile_rows()):
        want[out_row : out_row + rows] = product[a_row : a_row + rows]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,k", [("tensor", 40), ("row", 48), ("block", 384)])
def test_packed_rows_keep_each_rows_bytes_and_scales(mode, k):
    """An fp8 all-gather's wire format: rows packed with their scales at 16-byte aligned offsets, read back as views
    (the GEMM reads both in place)."""
    from flashoverlap.comm import scaled
    from tests.ops.test_scaled import quantise

    a, sa = quantise(torch.randn(10, k), mode)
    scales = scaled.Scales.of(sa, torch.ones(()) if mode != "block" else torch.ones(k // 128, 1))
    rows = scales.rows_of_a(slice(0, 10), 10)
    packed = scaled.pack_rows(a, rows)
    assert packed.dtype == torch.uint8 and packed.shape == (10, scaled.row_bytes(k, a.dtype, scales))
    assert packed.shape[1] % 16 == 0 and packed.shape[1] - k < 16 + 4 * scales.scale_columns(k) + 16
    a_view, scale_view = scaled.unpack_rows(packed, k, a.dtype, scales.scale_columns(k))
    assert a_view.data_ptr() == packed.data_ptr() and scale_view.data_ptr() % 16 == 0
    assert torch.equal(a_view.view(torch.uint8), a.view(torch.uint8))
    assert torch.equal(scale_view, rows.float())
