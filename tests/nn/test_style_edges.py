"""The styles and ``parallelize`` where their fast path must not apply, on two gloo ranks: an ``nn.Linear`` subclass
with a forward of its own runs as PyTorch's style runs it (values equal to PyTorch's style; ``parallelize`` refuses
it), ranks whose inputs send one to the op and the other to PyTorch's path raise on every rank (none returns, none
hangs), a ``Replicate`` DTensor under ``input_layouts=Shard(1)`` gets PyTorch's gradient placement, tied linears
become one shard under both names, and a misspelt ``path`` is refused where the layer or style is built."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flashoverlap.testing import spawn


class Scaled(nn.Linear):
    """A linear with a forward of its own (the style must run it, not ``nn.Linear``'s)."""

    def forward(self, x):
        return super().forward(x) * 2 + 1


def _edges(rank, world):
    import torch.distributed.tensor.parallel as tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import flashoverlap.nn as fnn

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(8, 4 * world), nn.GELU(), Scaled(4 * world, 8))
    x = torch.randn(2, 5, 8)
    outs = []
    for styles in (tp, fnn):
        sharded = parallelize_module(copy.deepcopy(model), mesh, {"0": styles.ColwiseParallel(),
                                                                  "2": styles.RowwiseParallel()})
        outs.append(sharded(x))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="an nn.Linear with a forward of its own"):
        fnn.parallelize(copy.deepcopy(model), {"0": "colwise"})

    # Ranks whose inputs take different branches: rank 0's divides (the op), rank 1's does not (PyTorch's path);
    # then rank 1 has no rows while rank 0 has some. Every rank raises; the group is usable after.
    for style, shape, said in ((fnn.RowwiseParallel(output_layouts=Shard(1)), (1, 4 + rank, 4), "the kind of call"),
                               (fnn.RowwiseParallel(), (0 if rank else 4, 4), "the kind of call"),
                               (fnn.ColwiseParallel(), (0 if rank else 4, 4 * world), "branch")):
        # (the colwise op's forward is local: its rank agrees on the branch, as the falling-back rank does)
        linear = parallelize_module(nn.Linear(4 * world, 8) if isinstance(style, fnn.RowwiseParallel)
                                    else nn.Linear(4 * world, 4 * world), mesh, style)
        with pytest.raises(ValueError, match=f"the ranks disagree on {said}"):
            linear(torch.randn(*shape))
    dist.barrier()

    # A Replicate DTensor under input_layouts=Shard(1): PyTorch's redistribute reduces its gradient.
    grads, plain = [], nn.Linear(8, 4 * world)
    for styles in (tp, fnn):
        linear = parallelize_module(copy.deepcopy(plain), mesh,
                                    styles.ColwiseParallel(input_layouts=Shard(1)))
        xr = distribute_tensor(torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1)), mesh,
                               [Replicate()]).requires_grad_()
        linear(xr).sum().backward()
        grads.append(xr.grad)
    assert grads[1].placements == grads[0].placements == (Replicate(),), [g.placements for g in grads]
    torch.testing.assert_close(grads[1].to_local(), grads[0].to_local())

    # Tied linears: one shard under both names; sharding the two names two ways is refused.
    tied = nn.Module()
    tied.a = tied.b = nn.Linear(8, 4 * world)
    fnn.parallelize(tied, {"a": "colwise"})
    assert isinstance(tied.a, fnn.ColumnParallelLinear) and tied.b is tied.a
    tied = nn.Module()
    tied.a = tied.b = nn.Linear(8, 4 * world)
    with pytest.raises(ValueError, match="the same nn.Linear as 'a'"):
        fnn.parallelize(tied, {"a": "colwise", "b": "rowwise"})

    # A misspelt path: refused where the layer or style is built.
    for build in (lambda: fnn.ColumnParallelLinear(8, 4 * world, path="bogus"),
                  lambda: fnn.ColwiseParallel(path="bogus"), lambda: fnn.RowwiseParallel(path="bogus"),
                  lambda: fnn.ExpertParallelMLP(8, 8, 2 * world, 1, path="bogus")):
        with pytest.raises(ValueError, match="path must be one of .* got 'bogus'"):
            build()
    return True


def test_the_styles_fast_path_stands_aside_where_it_must():
    assert spawn(_edges, 2) == [True, True]
