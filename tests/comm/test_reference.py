"""The reference communicator's reduce-scatter (the executable specification of gemm_reduce_scatter's layout)
under gloo: rank r gets rows [r*M/W, (r+1)*M/W) of the summed product, as the plain PyTorch code returns them."""

import pytest
import torch
import torch.distributed as dist

from flashoverlap.comm.tp import reference
from flashoverlap.plan import TileConfig
from flashoverlap.testing import spawn
from flashoverlap.tune.defaults import default_plan

SHAPES = [(2, 5, 3), (96, 40, 24), (250, 33, 17), (512, 64, 64)]


def _reduce_scatter(rank, world_size):
    checked = 0
    for i, (m_per_rank, n, k) in enumerate(SHAPES):
        m = m_per_rank * world_size
        torch.manual_seed(100 * i + rank)
        a = torch.randn(m, k, dtype=torch.float16)
        b = torch.randn(n, k, dtype=torch.float16).t()
        full = (a.float() @ b.float()).half()
        dist.all_reduce(full)
        want = full[rank * m_per_rank : (rank + 1) * m_per_rank]
        for groups, profile in ((1, "even"), (3, "small-first"), (5, "small-last")):
            plan = default_plan("reduce_scatter", m, n, k, world_size, tile=TileConfig(16, 16, 16, 2, 1, 4),
                                num_groups=groups, profile=profile, allow_sequential=False)
            got = reference.gemm_reduce_scatter(a, reference.Bands(b, None, a.dtype), plan, None)
            assert got.shape == (m_per_rank, n) and not torch.isnan(got).any()
            eps = torch.finfo(torch.float16).eps
            torch.testing.assert_close(got, want, atol=4 * eps * (k * world_size) ** 0.5, rtol=4 * eps)
            checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_reference_reduce_scatter_matches_pytorch(world_size):
    assert spawn(_reduce_scatter, world_size) == [len(SHAPES) * 3] * world_size
