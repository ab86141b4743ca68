"""The three ops against the plain PyTorch code they replace.

    torchrun --nproc-per-node 2 examples/ops.py

NCCL and GPU-sized tensors where every rank has a GPU; else gloo, CPU-sized tensors and the reference path. Prints,
per op, the largest difference from plain PyTorch over every rank, and raises if one exceeds bf16 rounding.
"""

import logging
import os
import sys

import torch
import torch.distributed as dist

import flashoverlap as fo


def main() -> None:
    if not dist.is_initialized():  # under torchrun (the test suite starts its ranks itself)
        gpus = torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
        dist.init_process_group("nccl" if gpus else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if rank == 0 and on_gpu:  # path="auto" logs the path it takes for each op, and why (once per op)
        logging.basicConfig(format="%(message)s")
        logging.getLogger("flashoverlap").setLevel(logging.DEBUG)
    elif rank == 0:
        print("path: reference (CPU tensors: torch.matmul, then blocking gloo collectives, nothing overlapped)")
    T, H = (4096, 8192) if on_gpu else (256, 512)  # tokens, hidden size: GPU-sized, or CPU-sized
    torch.manual_seed(rank)
    x_r = torch.randn(T, H // world, dtype=torch.bfloat16, device=device)  # this rank's K-shard of x
    w_r = torch.randn(H, H // world, dtype=torch.bfloat16, device=device) / H**0.5  # nn.Linear layout [N, K/W]

    y = fo.gemm_all_reduce(x_r, w_r.t())  # x_r @ w_r.t(), then all_reduce: [T, H] on every rank
    y_r = fo.gemm_reduce_scatter(x_r, w_r.t())  # this rank's rows of the same sum: [T/W, H]
    z = fo.all_gather_gemm(y_r, w_r)  # all_gather(y_r) @ w_r: [T, H/W]

    # The plain PyTorch code each op replaces, and the largest difference over every rank.
    want = x_r @ w_r.t()
    dist.all_reduce(want)
    shards = [torch.empty_like(y_r) for _ in range(world)]
    dist.all_gather(shards, y_r)
    gathered = torch.cat(shards)
    for name, got, plain in (("gemm_all_reduce", y, want), ("gemm_reduce_scatter", y_r, want.chunk(world)[rank]),
                             ("all_gather_gemm", z, gathered @ w_r)):
        diff = (got.float() - plain.float()).abs().max().reshape(1)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        ok = diff.item() <= 1e-2 * plain.float().abs().max().item()  # bf16 rounding of values up to that size
        if rank == 0:
            print(f"{name}: max abs diff vs plain PyTorch {diff.item():.2e}, {'OK' if ok else 'MISMATCH'}")
        assert ok, f"{name} differs from plain PyTorch by {diff.item()}"


if __name__ == "__main__":
    if sys.argv[1:]:  # it takes no options: a misspelt one must not pass for a run of the example
        sys.exit(f"{sys.argv[0]} takes no arguments, got: {' '.join(sys.argv[1:])}")
    if "RANK" not in os.environ:  # not under torchrun: one line, not torch's traceback
        sys.exit(f"start it under torchrun: torchrun --nproc-per-node 2 {sys.argv[0]}")
    main()
    dist.destroy_process_group()
