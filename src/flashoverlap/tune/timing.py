"""Timing on the GPU, for ``tune plan`` and ``flashoverlap bench``: CUDA events around each call, the ranks aligned
before each call, each call queued behind a GPU sleep, the median per rank, the maximum over ranks."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# Each timed call is queued behind this much GPU sleep, so that the host time spent launching it is hidden as
# it is inside a model (where the GPU is busy with earlier layers, or a CUDA graph launches it) instead of counted
# as GPU idle time. Measured on the H200 machines: 120-240 us of host time for matmul + one NCCL collective, up to
# about 1 ms for an overlapped op issuing 8 collectives (bench rows' host_us), so 100 us did not hide it.
QUEUE_AHEAD_CYCLES = 3_000_000  # about 1.5 ms at H200 clocks


def start_behind_sleep(start: torch.cuda.Event) -> None:
    torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
    start.record()


def inputs(rows: int, n: int, k: int, dtype: torch.dtype, rank: int, device: torch.device | str = "cuda"):
    """Fresh random ``a [rows, K]`` and ``b [K, N]`` (seeded by ``rank``), b as an nn.Linear weight's transposed
    view."""
    gen = torch.Generator(device=device).manual_seed(4321 + rank)
    a = torch.randn(rows, k, dtype=dtype, device=device, generator=gen)
    w = torch.randn(n, k, dtype=dtype, device=device, generator=gen) / k**0.5
    return a, w.t()


def time_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 5,
    iters: int = 20,
    group: dist.ProcessGroup | None = None,
    before: Callable[[], object] | None = None,
) -> float:
    """Median milliseconds of ``fn()`` on this rank, maximum over the ranks of ``group``: ``time_side_by_side`` of
    one function (``before()`` runs untimed before each call, e.g. to reset state)."""
    return time_side_by_side({"fn": fn}, warmup=warmup, iters=iters, group=group,
                             before=None if before is None else {"fn": before})["fn"]


def time_side_by_side(
    fns: dict[str, Callable[[], object]],
    *,
    warmup: int = 5,
    iters: int = 20,
    group: dist.ProcessGroup | None = None,
    before: dict[str, Callable[[], object]] | None = None,
    host_us: dict[str, float] | None = None,
) -> dict[str, float]:
    """Median milliseconds of each function on this rank, maximum over the ranks of ``group``, the functions
    interleaved call by call, so that all of them see the same clocks: under load these GPUs reach their power
    limit and their clocks move by up to 30%. The order is shuffled every round (the same way on every rank), so
    that no function always follows the same one: a call right after a light one (a collective alone) runs with
    more power headroom than one after a GEMM.

    Before each call ``before[name]()`` runs untimed where given, the ranks synchronise (so that a collective inside
    does not time another rank's lateness), and the call is queued behind a GPU sleep (``QUEUE_AHEAD_CYCLES``) so
    that the time is the GPU's, not the launching host's. ``host_us``, if given, receives each function's median host
    time per call (microseconds, maximum over ranks): where it exceeds the queued-ahead sleep, the GPU waited for
    the host."""
    before = before or {}
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            if name in before:
                before[name]()
            fns[name]()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    host: dict[str, list[float]] = {name: [] for name in names}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    shuffler = random.Random(0)  # same seed on every rank: the collectives inside must match
    for _ in range(iters):
        order = names[:]
        shuffler.shuffle(order)
        for name in order:
            if name in before:
                before[name]()
            if dist.is_initialized():
                dist.barrier(group=group)
            torch.cuda.synchronize()
            start_behind_sleep(start)
            t0 = time.perf_counter()
            fns[name]()
            host[name].append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    medians = torch.tensor([statistics.median(times[name]) for name in names]
                           + [1e6 * statistics.median(host[name]) for name in names], dtype=torch.float64,
                           device="cuda")
    if dist.is_initialized():
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    values = medians.tolist()
    if host_us is not None:
        host_us.update(zip(names, values[len(names):]))
    return dict(zip(names, values[: len(names)]))
