"""PyTorch's tensor parallelism (``parallelize_module``) with flashoverlap's styles, against the unsharded model.

    torchrun --nproc-per-node 2 examples/styles.py

A torchtitan-style feed-forward layer (``x + feed_forward(ffn_norm(x))``, SwiGLU), sharded by two plans that differ
from PyTorch's only in the import of ``ColwiseParallel`` and ``RowwiseParallel``: the default layouts (every token on
every rank; ``w2`` runs ``gemm_all_reduce``), and torchtitan's sequence-parallel plan (``w2`` runs
``gemm_reduce_scatter``). NCCL and GPU-sized tensors where every rank has a GPU; else gloo, CPU-sized tensors and the
reference path. Prints the largest relative difference of the output and every parameter's gradient from the
unsharded layer over every rank, and raises beyond bf16 rounding.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module

from flashoverlap.nn import ColwiseParallel, RowwiseParallel  # was: from torch.distributed.tensor.parallel


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int, dtype=None, device=None):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(hidden, ffn, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    """torchtitan's names: ``x + feed_forward(ffn_norm(x))``."""

    def __init__(self, hidden: int, ffn: int, dtype=None, device=None):
        super().__init__()
        self.ffn_norm = nn.RMSNorm(hidden, dtype=dtype, device=device)
        self.feed_forward = FeedForward(hidden, ffn, dtype=dtype, device=device)

    def forward(self, x):
        return x + self.feed_forward(self.ffn_norm(x))


def check(what: str, model: nn.Module, out: torch.Tensor, plain: nn.Module, want: torch.Tensor) -> None:
    """The largest relative difference of the output and of every parameter's gradient (gathered where sharded)
    over every rank; raises beyond bf16 rounding."""
    pairs = [(out, want)] + [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad, q.grad)
                             for p, q in zip(model.parameters(), plain.parameters())]
    pairs = [(got.detach().float(), ref.detach().float()) for got, ref in pairs]
    worst = max(float((got - ref).norm() / ref.norm()) for got, ref in pairs)
    worst = torch.tensor([worst], device=want.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.item() <= 2e-2
    if dist.get_rank() == 0:
        print(f"{what}: output and {len(pairs) - 1} gradients, max relative diff vs the unsharded layer "
              f"{worst.item():.1e}, {'OK' if ok else 'MISMATCH'}")
    assert ok, f"{what} differs from the unsharded layer by {worst.item()}"


def main() -> None:
    if not dist.is_initialized():  # under torchrun (the test suite starts its ranks itself)
        gpus = torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
        dist.init_process_group("nccl" if gpus else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    S, H, FFN = (8192, 4096, 14336) if on_gpu else (64, 64, 128)  # tokens (batch 1), hidden, FFN: GPU or CPU-sized
    torch.manual_seed(0)  # the same layer and tokens on every rank
    plain = Layer(H, FFN, dtype=torch.bfloat16, device=device)
    x = torch.randn(1, S, H, dtype=torch.bfloat16, device=device)
    model, sp_model = copy.deepcopy(plain), copy.deepcopy(plain)
    want = plain(x)
    want.float().square().sum().backward()

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    parallelize_module(model.feed_forward, mesh["tp"], {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                                        "w2": RowwiseParallel()})
    y = model(x)  # every token on every rank: w1 and w3 shard the output features, w2 runs gemm_all_reduce
    y.float().square().sum().backward()
    check("default layouts", model, y, plain, want)

    parallelize_module(sp_model, mesh["tp"], {
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),  # gemm_reduce_scatter; backward all_gather_gemm
    })
    x_r = x.chunk(world, dim=1)[rank]  # this rank's tokens [1, S/W, H]
    y_r = sp_model(x_r)
    y_r.float().square().sum().backward()
    check("torchtitan's sequence-parallel plan", sp_model, y_r, plain, want.chunk(world, dim=1)[rank])

if __name__ == "__main__":
    if sys.argv[1:]:  # it takes no options: a misspelt one must not pass for a run of the example
        sys.exit(f"{sys.argv[0]} takes no arguments, got: {' '.join(sys.argv[1:])}")
    if "RANK" not in os.environ:  # not under torchrun: one line, not torch's traceback
        sys.exit(f"start it under torchrun: torchrun --nproc-per-node 2 {sys.argv[0]}")
    main()
    dist.destroy_process_group()
