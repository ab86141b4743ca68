"""gemm_all_reduce on the reference communicator under gloo, several ranks, odd and round shapes."""

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.plan import TileConfig
from flashoverlap.testing import spawn

SHAPES = [(1, 1, 1), (37, 45, 29), (123, 77, 64), (256, 128, 96), (7, 300, 5)]


def _check_shapes(rank, world_size, dtype_name):
    dtype = getattr(torch, dtype_name)
    results = []
    for i, (m, n, k) in enumerate(SHAPES):
        torch.manual_seed(1000 * i + rank)  # fresh, different inputs on every rank
        a = torch.randn(m, k, dtype=dtype)
        w = torch.randn(n, k, dtype=dtype)
        for b in (w.t(), w.t().contiguous()):
            # A plan with several groups and small tiles, so that group boundaries fall inside the matrix.
            plan = fo.default_plan("all_reduce", m, n, k, world_size, tile=TileConfig(16, 16, 16, 2, 1, 4),
                                   num_groups=3, allow_sequential=False)
            got = fo.gemm_all_reduce(a, b, plan=plan)
            want = (a.float() @ b.float()).to(dtype)
            dist.all_reduce(want)
            # A few units in the last place of a sum of world_size values of size ~sqrt(k): rounding-order
            # differences only; a wrong band or a missing reduction is off by the values themselves.
            eps = torch.finfo(dtype).eps
            tol = dict(atol=4 * eps * (k * world_size) ** 0.5, rtol=4 * eps)
            torch.testing.assert_close(got, want, **tol)
            assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
            # The default plan for the shape (sequential here: too small to overlap) gives the same answer.
            torch.testing.assert_close(fo.gemm_all_reduce(a, b), want, **tol)
            results.append(plan.num_groups)
    return results


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_reference_all_reduce_matches_pytorch(world_size):
    groups = spawn(_check_shapes, world_size, "gloo", args=("float16",))
    assert groups[0] == groups[-1] and max(groups[0]) == 3


def test_reference_all_reduce_bf16():
    spawn(_check_shapes, 2, "gloo", args=("bfloat16",))


def _check_subgroup(rank, world_size):
    # A group of ranks {1, 2} inside a world of 3: rank 0 does not take part.
    sub = dist.new_group([1, 2])
    if rank == 0:
        return None
    torch.manual_seed(rank)
    a = torch.randn(33, 20, dtype=torch.float16)
    b = torch.randn(20, 50, dtype=torch.float16)
    got = fo.gemm_all_reduce(a, b, group=sub)
    want = (a.float() @ b.float()).half()
    dist.all_reduce(want, group=sub)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2e-3)
    return got.shape


def test_reference_all_reduce_subgroup():
    assert spawn(_check_subgroup, 3)[1:] == [(33, 50), (33, 50)]


def _check_float32(rank, world_size):
    """float32 runs the reference path on the CPU (and the sequential plan on CUDA): every op, plain PyTorch's
    answer to float32 rounding."""
    torch.manual_seed(rank)
    a, w = torch.randn(6, 5), torch.randn(7, 5)
    want = a @ w.t()
    dist.all_reduce(want)
    got = torch.full_like(want, float("nan"))
    got.copy_(fo.gemm_all_reduce(a, w.t()))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(fo.gemm_reduce_scatter(a, w.t()), want[3 * rank : 3 * rank + 3])
    shards = [torch.empty(3, 5) for _ in range(world_size)]
    dist.all_gather(shards, a[:3].contiguous())
    torch.testing.assert_close(fo.all_gather_gemm(a[:3], w.t()), torch.cat(shards) @ w.t())
    assert got.dtype == torch.float32


def test_reference_ops_take_float32():
    spawn(_check_float32, 2, "gloo")
