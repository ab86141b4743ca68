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
