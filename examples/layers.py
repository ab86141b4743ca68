"""The tensor-parallel layers (``flashoverlap.nn``) against the unsharded model: output and every gradient.

    torchrun --nproc-per-node 2 examples/layers.py

A pre-norm MLP block with sequence parallelism, Megatron-LM style, built twice: from ``ColumnParallelLinear`` /
``RowParallelLinear`` directly, and by ``parallelize`` from the plain block. NCCL and GPU-sized tensors where every
rank has a GPU; else gloo, CPU-sized tensors and the reference path. Prints the largest relative difference from the
unsharded block over every rank, and raises beyond bf16 rounding.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashoverlap.nn import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_sequence_parallel,
    parallelize,
    sync_sequence_parallel_grads,
)


class PlainBlock(nn.Module):
    """The unsharded block: ``x + down(silu(up(norm(x))))``."""

    def __init__(self, hidden: int, ffn: int, dtype=None, device=None):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, dtype=dtype, device=device)
        self.up = nn.Linear(hidden, ffn, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(ffn, hidden, bias=True, dtype=dtype, device=device)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class Block(nn.Module):
    """The same block sharded over ``group``: it takes and returns this rank's tokens ``[T/W, H]``."""

    def __init__(self, hidden: int, ffn: int, group=None, dtype=None, device=None):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, dtype=dtype, device=device)
        self.up = ColumnParallelLinear(hidden, ffn, bias=False, group=group, sequence_parallel=True, dtype=dtype,
                                       device=device)  # this rank's [F/W, H]; forward: all_gather_gemm
        self.down = RowParallelLinear(ffn, hidden, bias=True, group=group, sequence_parallel=True, dtype=dtype,
                                      device=device)  # this rank's [H, F/W]; forward: gemm_reduce_scatter
        mark_sequence_parallel(self.norm.weight)  # whole on every rank but applied to this rank's tokens

    def forward(self, x_r):
        return x_r + self.down(F.silu(self.up(self.norm(x_r))))


def check(what: str, pairs: list, device: torch.device) -> None:
    """The largest relative difference of ``pairs`` of (got, want) over every rank; raises beyond bf16 rounding."""
    pairs = [(got.detach().float(), want.detach().float()) for got, want in pairs]
    worst = max(float((got - want).norm() / want.norm()) for got, want in pairs)
    worst = torch.tensor([worst], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.item() <= 2e-2
    if dist.get_rank() == 0:
        print(f"{what}: max relative diff vs the unsharded block {worst.item():.1e}, {'OK' if ok else 'MISMATCH'}")
    assert ok, f"{what} differs from the unsharded block by {worst.item()}"


def main() -> None:
    if not dist.is_initialized():  # under torchrun (the test suite starts its ranks itself)
        gpus = torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
        dist.init_process_group("nccl" if gpus else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    T, H, FFN = (4096, 4096, 14336) if on_gpu else (64, 128, 256)  # GPU-sized, or CPU-sized
    dt = torch.bfloat16  # without dtype= the layers are fp32, as nn.Linear is: correct, not overlapped

    torch.manual_seed(0)  # the same plain block and tokens on every rank
    plain = PlainBlock(H, FFN, dtype=dt, device=device)
    x = torch.randn(T, H, dtype=dt, device=device, requires_grad=True)
    plain(x).float().square().sum().backward()
    x_grad_r = x.grad.chunk(world)[rank]

    block = Block(H, FFN, dtype=dt, device=device)
    with torch.no_grad():  # this rank's shards of the plain block's weights
        block.norm.weight.copy_(plain.norm.weight)
        block.up.weight.copy_(plain.up.weight.chunk(world, dim=0)[rank])
        block.down.weight.copy_(plain.down.weight.chunk(world, dim=1)[rank])
        block.down.bias.copy_(plain.down.bias)

    x_r = x.detach().chunk(world)[rank].clone().requires_grad_()  # this rank's tokens [T/W, H]
    out_r = block(x_r)
    out_r.float().square().sum().backward()  # backward: the same ops, overlapped the other way
    sync_sequence_parallel_grads(block)  # sum the gradients of the norm's weight and the row layer's bias
    check("ColumnParallelLinear / RowParallelLinear, output and gradients", [
        (out_r, plain(x.detach()).chunk(world)[rank]), (x_r.grad, x_grad_r),
        (block.up.weight.grad, plain.up.weight.grad.chunk(world, dim=0)[rank]),
        (block.down.weight.grad, plain.down.weight.grad.chunk(world, dim=1)[rank]),
        (block.down.bias.grad, plain.down.bias.grad), (block.norm.weight.grad, plain.norm.weight.grad)], device)

    model = parallelize(copy.deepcopy(plain), {"up": "colwise", "down": "rowwise"}, sequence_parallel=True)
    mark_sequence_parallel(model.norm.weight)
    model.zero_grad()
    x_r.grad = None
    out_r = model(x_r)
    out_r.float().square().sum().backward()
    sync_sequence_parallel_grads(model)
    check("parallelize(model, {'up': 'colwise', 'down': 'rowwise'}), output and gradients", [
        (out_r, plain(x.detach()).chunk(world)[rank]), (x_r.grad, x_grad_r),
        (model.up.weight.grad, plain.up.weight.grad.chunk(world, dim=0)[rank]),
        (model.down.weight.grad, plain.down.weight.grad.chunk(world, dim=1)[rank]),
        (model.down.bias.grad, plain.down.bias.grad), (model.norm.weight.grad, plain.norm.weight.grad)], device)


if __name__ == "__main__":
    if sys.argv[1:]:  # it takes no options: a misspelt one must not pass for a run of the example
        sys.exit(f"{sys.argv[0]} takes no arguments, got: {' '.join(sys.argv[1:])}")
    if "RANK" not in os.environ:  # not under torchrun: one line, not torch's traceback
        sys.exit(f"start it under torchrun: torchrun --nproc-per-node 2 {sys.argv[0]}")
    main()
    dist.destroy_process_group()
