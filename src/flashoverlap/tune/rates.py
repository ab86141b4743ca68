"""The two rates a default plan depends on, measured once per (process group, device, dtype): the GEMM's
throughput and the all-reduce's bus bandwidth. Every rank takes the minimum over the group, so all ranks derive
the same plan (a plan that differs between ranks would issue different collectives and hang)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashoverlap import guards


@dataclass(frozen=True)
class Rates:
    gemm_tflops: float
    allreduce_busbw_gbs: float

    def gemm_ms(self, m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / (self.gemm_tflops * 1e9)

    def all_reduce_ms(self, nbytes: int, world_size: int) -> float:
        if world_size == 1:  # nothing moves (and the measured bus bandwidth is 0)
            return 0.0
        return 2.0 * (world_size - 1) / world_size * nbytes / (self.allreduce_busbw_gbs * 1e6)

    def collective_ms(self, op: str, nbytes: int, world_size: int) -> float:
        """Estimated time of ``op``'s collective on ``nbytes`` (the GEMM's output, or for all-gather the gathered
        input): reduce-scatter and all-gather move half an all-reduce's bytes but, measured on 2x H200 (NVLink),
        take 0.67-0.74 of its time at the benchmark sizes."""
        factor = 0.7 if op in ("reduce_scatter", "all_gather") else 1.0
        return factor * self.all_reduce_ms(nbytes, world_size)


def _best_ms(fn, iters: int = 5, warmup: int = 3) -> float:
    """The fastest of ``iters`` timed calls: the rate the hardware can reach, robust to a slow first use or a
    neighbour's burst, so that the plan a shape gets does not flip from one process to the next."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def measure(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> Rates:
    """This machine's rates for ``group`` on ``device`` (tens of ms; collective over the group). The runtime keeps
    the answer per (group, device, dtype)."""
    guards.refuse_inside_capture("the first call for a process group measures the GEMM and all-reduce rates")
    size = 4096
    a = torch.randn(size, size, dtype=dtype, device=device)
    gemm_ms = _best_ms(lambda: torch.matmul(a, a))
    buf = torch.randn(32 << 20, dtype=dtype, device=device)  # 64 MiB in 2-byte dtypes
    comm_ms = _best_ms(lambda: dist.all_reduce(buf, group=group))
    world_size = dist.get_world_size(group)
    busbw = 2.0 * (world_size - 1) / world_size * buf.numel() * buf.element_size() / (comm_ms * 1e6)
    agreed = torch.tensor([2.0 * size**3 / (gemm_ms * 1e9), busbw], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return Rates(float(agreed[0]), float(agreed[1]))
