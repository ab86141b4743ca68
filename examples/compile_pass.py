"""A model sharded with PyTorch's own styles, compiled with flashoverlap's pass on: the compiled graph gets the ops.

    torchrun --nproc-per-node 2 examples/compile_pass.py

A torchtitan-style feed-forward layer (``x + feed_forward(ffn_norm(x))``, SwiGLU) sharded by torchtitan's
sequence-parallel plan with ``torch.distributed.tensor.parallel``'s styles, nothing of flashoverlap's; then
``flashoverlap.compile.enable()`` and ``torch.compile``. Prints how many matmul + collective patterns the pass
rewrote into the library's ops, forward and backward together: the all-gather before ``w1``/``w3`` and the
reduce-scatter after ``w2`` in the forward, the all-gather before ``w2``'s input gradient in the backward (the
backward's reduce-scatter after ``w1``/``w3`` sums two matmuls' outputs: left to PyTorch, as ``docs/migration.md``
says), and the largest relative difference of the output and every gradient from the same model run eagerly,
over every rank; raises if nothing was rewritten or beyond bf16 rounding. NCCL and GPU-sized tensors where every
rank has a GPU; else gloo, CPU-sized tensors and the reference path (Inductor's CPU code generation: a minute or so).
"""

import copy
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import flashoverlap.compile


class _ProcessGroupNotCached(logging.Filter):
    """Drops one known-harmless warning, with its traceback: Inductor's and AOTAutograd's on-disk caches cannot
    pickle a compiled graph that holds a ``ProcessGroup`` ("cannot pickle 'torch._C._distributed_c10d.ProcessGroup'
    object"). Since torch 2.12 DTensor hands the mesh's process group to the compiled graph as an opaque object,
    which has no pickle form (pytorch/pytorch#189541); the graph is compiled and runs all the same, it is only not
    cached on disk, with or without flashoverlap's pass. Every other message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return not ("unable to serialize compiled graph" in text and "ProcessGroup" in text)


def _quiet_process_group_cache_warnings() -> None:
    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
        logging.getLogger(name).addFilter(_ProcessGroupNotCached())


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
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # the same layer and tokens on every rank
    model = Layer(H, FFN, dtype=torch.bfloat16, device=device)
    parallelize_module(model, mesh["tp"], {
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    x_r = torch.randn(1, S, H, dtype=torch.bfloat16, device=device).chunk(world, dim=1)[rank]  # this rank's tokens
    eager = copy.deepcopy(model)
    want = eager(x_r)
    want.float().square().sum().backward()

    _quiet_process_group_cache_warnings()  # torch's on-disk caches, not the pass: see the filter
    # (was, for PyTorch's async TP: torch._inductor.config._micro_pipeline_tp = True and symmetric memory)
    flashoverlap.compile.enable()  # before the first call of the compiled model
    model = torch.compile(model)
    y_r = model(x_r)
    y_r.float().square().sum().backward()

    rewrote = dict(flashoverlap.compile.rewrite_counts())
    pairs = [(y_r, want)] + [(p.grad.full_tensor(), q.grad.full_tensor())
                             for p, q in zip(model.parameters(), eager.parameters())]
    worst = max(float((got.detach().float() - ref.detach().float()).norm() / ref.detach().float().norm())
                for got, ref in pairs)
    worst = torch.tensor([worst], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = bool(rewrote) and worst.item() <= 2e-2
    if rank == 0:
        print(f"flashoverlap.compile rewrote {rewrote}; output and {len(pairs) - 1} gradients, max relative diff vs "
              f"eager {worst.item():.1e}, {'OK' if ok else 'MISMATCH'}")
    flashoverlap.compile.disable()
    assert ok, f"rewrote {rewrote}, difference from eager {worst.item()}"


if __name__ == "__main__":
    if sys.argv[1:]:  # it takes no options: a misspelt one must not pass for a run of the example
        sys.exit(f"{sys.argv[0]} takes no arguments, got: {' '.join(sys.argv[1:])}")
    if "RANK" not in os.environ:  # not under torchrun: one line, not torch's traceback
        sys.exit(f"start it under torchrun: torchrun --nproc-per-node 2 {sys.argv[0]}")
    main()
    dist.destroy_process_group()
