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


def _gathered_input_read(rank, world_size, dtype_name, compiled):
    """Sequence parallelism's shared input: ``q, x_full = all_gather_gemm(x_r, wq, return_gathered=True)`` and
    ``k = x_full @ wk``. x_r's gradient must carry k's part (the gathered input's own gradient, each rank's rows
    summed over the group), as the plain all-gather's backward gives it; it was dropped (the gathered input was not
    differentiable). Against plain PyTorch: ``all_gather_into_tensor`` in autograd (funcol), then the two products."""
    import torch.distributed._functional_collectives as funcol

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(rank)
    x_r = torch.randn(3, 8, dtype=dtype, requires_grad=True)
    torch.manual_seed(99)
    wq, wk = torch.randn(8, 5, dtype=dtype, requires_grad=True), torch.randn(8, 4, dtype=dtype, requires_grad=True)

    def ours(x_r, wq, wk):
        q, x_full = all_gather_gemm(x_r, wq, return_gathered=True)
        return q.float().pow(2).sum() + (x_full @ wk).float().pow(2).sum()

    def plain(x_r, wq, wk):
        x_full = funcol.all_gather_tensor_autograd(x_r, 0, dist.group.WORLD)
        return (x_full @ wq).float().pow(2).sum() + (x_full @ wk).float().pow(2).sum()

    run = torch.compile(ours, backend="aot_eager", fullgraph=True) if compiled else ours
    grads = torch.autograd.grad(run(x_r, wq, wk), (x_r, wq, wk))
    want = torch.autograd.grad(plain(x_r, wq, wk), (x_r, wq, wk))
    tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.5, "rtol": 2e-2}
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, **tolerance)
    return True


def _gathered_backward_warnings(rank, world_size):
    """The warnings the eager backward of ``return_gathered``'s input raises (none: it used torch's deprecated
    ``funcol.reduce_scatter_tensor``, a FutureWarning on every backward under torch 2.13)."""
    import warnings

    x_r = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, x_full = all_gather_gemm(x_r, w, return_gathered=True)
        x_full.sum().backward()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_the_gathered_inputs_backward_warns_nothing():
    assert spawn(_gathered_backward_warnings, 2) == [[], []]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gathered_input_passes_its_gradient_back(world_size):
    for dtype_name, compiled in (("float32", False), ("bfloat16", False), ("float32", True)):
        assert all(spawn(_gathered_input_read, world_size, args=(dtype_name, compiled)))
