"""all_gather_gemm on the reference path under gloo: the product and the gathered input match plain PyTorch."""

import pytest
import torch
import torch.distributed as dist

from flashoverlap.ops.all_gather_gemm import all_gather_gemm
from flashoverlap.plan import TileConfig
from flashoverlap.testing import spawn
from flashoverlap.tune.defaults import default_plan


def _check(rank, world_size):
    for i, (rows, n, k) in enumerate([(1, 1, 1), (37, 45, 29), (64, 77, 16)]):
        torch.manual_seed(10 * i + rank)
        a_shard = torch.randn(rows, k, dtype=torch.float16)
        b = torch.randn(n, k, dtype=torch.float16).t()
        a_full = torch.empty(rows * world_size, k, dtype=torch.float16)
        dist.all_gather_into_tensor(a_full, a_shard)
        want = torch.matmul(a_full, b)
        plan = default_plan("all_gather", rows * world_size, n, k, world_size,
                            tile=TileConfig(16, 16, 16, 2, 1, 4), num_groups=3, allow_sequential=False)
        for given in (None, plan):
            c, gathered = all_gather_gemm(a_shard, b, plan=given, return_gathered=True)
            assert c.shape == (rows * world_size, n) and torch.equal(gathered, a_full)
            torch.testing.assert_close(c, want, atol=4e-3 * k**0.5, rtol=4e-3)
        assert all_gather_gemm(a_shard, b, plan=plan).shape == (rows * world_size, n)
    with pytest.raises(ValueError, match="plan is for all_gather"):
        all_gather_gemm(a_shard, b, plan=default_plan("all_gather", (rows + 1) * world_size, n, k, world_size))
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_all_gather_gemm_matches_pytorch(world_size):
    assert all(spawn(_check, world_size))
