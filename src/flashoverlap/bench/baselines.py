"""What users run today, and the decomposition baseline: the GEMM cut into row chunks with cuBLAS, each chunk's
collective issued on a second stream as soon as the chunk is computed."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
