"""gemm_reduce_scatter on the reference path under gloo, and its argument errors."""

import tempfile

import pytest
import torch
import torch.distributed as dist

from flashoverlap.ops.gemm_reduce_scatter import gemm_reduce_scatter
from flashoverlap.plan import TileConfig
from flashoverlap.testing import spawn
from flashoverlap.tune.defaults import default_plan


def _check(rank, world_size):
    shapes = [(1, 1, 1), (37, 45, 29), (64, 77, 16)]  # rows per rank, N, K
    for i, (rows, n, k) in enumerate(shapes):
        m = rows * world_size
        torch.manual_seed(10 * i + rank)
        a = torch.randn(m, k, dtype=torch.float16)
        b = torch.randn(n, k, dtype=torch.float16).t()
        full = torch.matmul(a, b)
        dist.all_reduce(full)
        want = full[rank * rows : (rank + 1) * rows]
        eps = torch.finfo(torch.float16).eps
        tol = dict(atol=4 * eps * (k * world_size) ** 0.5, rtol=4 * eps)
        torch.testing.assert_close(gemm_reduce_scatter(a, b), want, **tol)  # the default (sequential) plan
        plan = default_plan("reduce_scatter", m, n, k, world_size, tile=TileConfig(16, 16, 16, 2, 1, 4),
                            num_groups=3, allow_sequential=False)
        got = gemm_reduce_scatter(a, b, plan=plan)
        assert got.shape == (rows, n) and got.is_contiguous()
        torch.testing.assert_close(got, want, **tol)
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_reduce_scatter_matches_pytorch(world_size):
    assert all(spawn(_check, world_size))


def test_reduce_scatter_errors():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            a = torch.randn(6, 4, dtype=torch.float16)
            b = torch.randn(4, 5, dtype=torch.float16)
            with pytest.raises(ValueError, match="K differ"):
                gemm_reduce_scatter(a, b.t())
            with pytest.raises(ValueError, match="plan is for all_reduce"):
                gemm_reduce_scatter(a, b, plan=default_plan("all_reduce", 6, 5, 4, 1))
            torch.testing.assert_close(gemm_reduce_scatter(a, b), torch.matmul(a, b))
        finally:
            dist.destroy_process_group()


def _uneven(rank, world_size):
    a = torch.randn(7, 4, dtype=torch.float16)
    b = torch.randn(4, 5, dtype=torch.float16)
    with pytest.raises(ValueError, match="M = 7 rows"):
        gemm_reduce_scatter(a, b)
    return True


def test_reduce_scatter_needs_m_divisible_by_world_size():
    assert all(spawn(_uneven, 2))
