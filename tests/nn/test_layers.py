"""ColumnParallelLinear and RowParallelLinear on two gloo ranks (reference path, bf16): an MLP of a column then a
row layer, with and without sequence parallelism, against the unsharded MLP: output, loss and every gradient
(input, weights, biases); ``from_linear`` and ``parallelize`` shard existing layers; construction errors."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flashoverlap.testing import spawn

LIMIT = 2e-2


class MLP(nn.Module):
    def __init__(self, hidden=32, inner=48):
        super().__init__()
        self.up = nn.Linear(hidden, inner, dtype=torch.bfloat16)
        self.down = nn.Linear(inner, hidden, dtype=torch.bfloat16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


def _mlp(rank, world_size, sequence_parallel):
    import flashoverlap.nn as fnn

    torch.manual_seed(0)
    full = MLP()
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)  # [batch, tokens, hidden]
    x_full = x.clone().requires_grad_(True)
    full(x_full).float().pow(2).sum().backward()
    want = full(x_full.detach())
    tp = fnn.parallelize(MLP(), {"up": "colwise", "down": "rowwise"}, sequence_parallel=sequence_parallel)
    tp.up.weight.data.copy_(full.up.weight[rank * 24 : (rank + 1) * 24])
    tp.up.bias.data.copy_(full.up.bias[rank * 24 : (rank + 1) * 24])
    tp.down.weight.data.copy_(full.down.weight[:, rank * 24 : (rank + 1) * 24])
    tp.down.bias.data.copy_(full.down.bias)
    assert isinstance(tp.up, fnn.ColumnParallelLinear) and isinstance(tp.down, fnn.RowParallelLinear)
    if sequence_parallel:  # this rank's batch rows (the outermost token dimension)
        x_r = x[rank : rank + 1].clone().requires_grad_(True)
        want_y, want_gx = want[rank : rank + 1], x_full.grad[rank : rank + 1]
    else:
        x_r = x.clone().requires_grad_(True)
        want_y, want_gx = want, x_full.grad
    y = tp(x_r)
    y.float().pow(2).sum().backward()
    fnn.sync_sequence_parallel_grads(tp)
    return {"y": _rel(y, want_y), "x": _rel(x_r.grad, want_gx),
            "up.weight": _rel(tp.up.weight.grad, full.up.weight.grad[rank * 24 : (rank + 1) * 24]),
            "up.bias": _rel(tp.up.bias.grad, full.up.bias.grad[rank * 24 : (rank + 1) * 24]),
            "down.weight": _rel(tp.down.weight.grad, full.down.weight.grad[:, rank * 24 : (rank + 1) * 24]),
            "down.bias": _rel(tp.down.bias.grad, full.down.bias.grad)}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_mlp_matches_the_unsharded_one(sequence_parallel):
    for rank, errors in enumerate(spawn(_mlp, 2, args=(sequence_parallel,))):
        bad = {k: v for k, v in errors.items() if not v < LIMIT}
        assert not bad, f"rank {rank}, sequence_parallel={sequence_parallel}: {bad}"


def _errors(rank, world_size):
    import flashoverlap.nn as fnn

    with pytest.raises(ValueError, match="out_features = 33 must be divisible"):
        fnn.ColumnParallelLinear(8, 33)
    with pytest.raises(ValueError, match="in_features = 9 must be divisible"):
        fnn.RowParallelLinear(9, 8)
    with pytest.raises(ValueError, match="style must be one of"):
        fnn.parallelize(MLP(), {"up": "diagonal"})
    with pytest.raises(ValueError, match=r"no nn.Linear matches \['gate'\]"):
        fnn.parallelize(MLP(), {"up": "colwise", "gate": "colwise"})
    with pytest.raises(ValueError, match="is a MLP, not an nn.Linear"):
        fnn.parallelize(nn.Sequential(MLP()), {"0": "colwise"})
    row = fnn.RowParallelLinear(8, 8, sequence_parallel=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="3 tokens .* cannot be split over 2 ranks"):
        row(torch.randn(3, 4, dtype=torch.bfloat16))
    layer = fnn.ColumnParallelLinear.from_linear(nn.Linear(6, 4, dtype=torch.bfloat16), sequence_parallel=True)
    assert layer.weight.shape == (2, 6) and "shard" in repr(layer)
    return dist.get_rank()


def test_layer_errors_name_the_argument():
    assert spawn(_errors, 2) == [0, 1]


def _weight_grad_layouts(rank, world_size):
    from flashoverlap.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    seen = {}
    for cls in (ColumnParallelLinear, RowParallelLinear):
        for sequence_parallel in (True, False):
            layer = cls(16 * world_size, 24 * world_size, bias=False, sequence_parallel=sequence_parallel,
                        dtype=torch.float16)
            name = f"{cls.__name__} sequence_parallel={sequence_parallel}"
            layer.weight.register_hook(lambda g, name=name: seen.__setitem__(name, g.stride()))
            width = 16 * world_size if cls is ColumnParallelLinear else 16  # a row layer's input is sharded
            layer(torch.randn(8, width, dtype=torch.float16, requires_grad=True)).float().sum().backward()
            seen[name] = (seen[name], layer.weight.stride())
    return seen


def test_weight_gradients_reach_autograd_in_the_weights_layout():
    # A weight gradient in the transposed layout costs a strided copy into w.grad, and a strided add each time
    # gradients accumulate (6 ms of a 4096-token training step of the block on one H200).
    for layouts in spawn(_weight_grad_layouts, 2):
        for name, (grad_stride, weight_stride) in layouts.items():
            assert grad_stride == weight_stride, f"{name}: gradient strides {grad_stride}, weight {weight_stride}"
