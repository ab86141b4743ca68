"""What users run today, and the decomposition baseline: the GEMM cut into row chunks with cuBLAS, each chunk's
collective issued on a second stream as soon as the chunk is computed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm.collectives import all_gather_into_tensor


def sequential_all_reduce(a: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
    c = torch.matmul(a, b)
    dist.all_reduce(c, group=group)
    return c


class DecomposedAllReduce:
    """``chunks`` row chunks of ``a @ b``; chunk i's all-reduce on ``comm_stream`` overlaps chunk i+1's GEMM."""

    def __init__(self, chunks: int, device: torch.device) -> None:
        self.chunks = chunks
        self.comm_stream = torch.cuda.Stream(device=device, priority=-(1 << 10))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
        m = a.shape[0]
        c = torch.empty((m, b.shape[1]), dtype=a.dtype, device=a.device)
        main = torch.cuda.current_stream()
        self.comm_stream.wait_stream(main)
        bounds = [m * i // self.chunks for i in range(self.chunks + 1)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi <= lo:
                continue
            torch.matmul(a[lo:hi], b, out=c[lo:hi])
            self.comm_stream.wait_stream(main)
            with torch.cuda.stream(self.comm_stream):
                dist.all_reduce(c[lo:hi], group=group)
        main.wait_stream(self.comm_stream)
        return c


class DecomposedReduceScatter:
    """``chunks`` row chunks of ``a @ b`` (each inside one rank's block, so ``chunks`` is a multiple of the world
    size); chunk i is reduced to the rank that owns its rows on ``comm_stream`` while chunk i+1 is computed."""

    def __init__(self, chunks: int, device: torch.device) -> None:
        self.chunks = chunks
        self.comm_stream = torch.cuda.Stream(device=device, priority=-(1 << 10))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        m = a.shape[0]
        block = m // world_size
        c = torch.empty((m, b.shape[1]), dtype=a.dtype, device=a.device)
        main = torch.cuda.current_stream()
        self.comm_stream.wait_stream(main)
        bounds = [m * i // self.chunks for i in range(self.chunks + 1)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            torch.matmul(a[lo:hi], b, out=c[lo:hi])
            self.comm_stream.wait_stream(main)
            with torch.cuda.stream(self.comm_stream):
                dist.reduce(c[lo:hi], dst=dist.get_global_rank(group or dist.group.WORLD, lo // block), group=group)
        main.wait_stream(self.comm_stream)
        return c[rank * block : (rank + 1) * block]


class DecomposedAllGather:
    """The shard cut into ``chunks`` row chunks: chunk i's all-gather on ``comm_stream`` while the rows gathered
    for chunk i-1 are multiplied."""

    def __init__(self, chunks: int, device: torch.device) -> None:
        self.chunks = chunks
        self.comm_stream = torch.cuda.Stream(device=device, priority=-(1 << 10))

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
        world_size = dist.get_world_size(group)
        rows, k = a_shard.shape
        c = torch.empty((rows * world_size, b.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
        main = torch.cuda.current_stream()
        self.comm_stream.wait_stream(main)
        bounds = [rows * i // self.chunks for i in range(self.chunks + 1)]
        gathered, ready = [], []
        with torch.cuda.stream(self.comm_stream):
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                part = torch.empty((world_size * (hi - lo), k), dtype=a_shard.dtype, device=a_shard.device)
                all_gather_into_tensor(part, a_shard[lo:hi].contiguous(), group)
                gathered.append(part)
                ready.append(self.comm_stream.record_event())
        for (lo, hi), part, event in zip(zip(bounds[:-1], bounds[1:]), gathered, ready):
            main.wait_event(event)
            c.view(world_size, rows, -1)[:, lo:hi] = torch.matmul(part, b).view(world_size, hi - lo, -1)
        main.wait_stream(self.comm_stream)
        return c


def async_tp_ops(group=None):
    """PyTorch's async TP (``torch.ops.symm_mem.fused_matmul_reduce_scatter`` / ``fused_all_gather_matmul``) as
    two callables, or ``None`` with the reason where this torch or machine cannot run them."""
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        name = (group or dist.group.WORLD).group_name
        enable_symm_mem_for_group(name)
        ops = torch.ops.symm_mem

        def reduce_scatter(a, b):
            return ops.fused_matmul_reduce_scatter(a, b, "sum", 0, name)

        def all_gather(a_shard, b):
            return ops.fused_all_gather_matmul(a_shard, [b], 0, name)[1][0]

        return reduce_scatter, all_gather, None
    except Exception as exc:  # an older torch, or symmetric memory unavailable here
        return None, None, f"{type(exc).__name__}: {exc}"
