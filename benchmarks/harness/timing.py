"""Timing on the GPU: CUDA events around each call, ranks aligned before each call, median per rank, maximum
over ranks."""

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


def host_us(fn: Callable[[], object], calls: int = 20, sleep_cycles: int = QUEUE_AHEAD_CYCLES) -> float:
    """This rank's median host time (microseconds) to issue one call of ``fn`` while the GPU is busy ahead of it
    (``sleep_cycles`` of GPU sleep), the ranks aligned before each call where a process group exists."""
    times = []
    for _ in range(calls):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def host_us_interleaved(fns: dict[str, Callable[[], object]], calls: int = 40,
                        sleep_cycles: int = QUEUE_AHEAD_CYCLES,
                        pairs: tuple[tuple[str, str], ...] = ()) -> dict[str, float]:
    """``host_us`` of several callables measured side by side: each round times one call of each, in the order
    ``round_order`` gives, so that slow and fast spells of the host fall on all of them alike (one call's host
    time, right after the ranks align and the GPU is given work, varies by 2x from run to run), and so does the
    warmth one call leaves for the next (a call right after another that ran the same torch and NCCL code is
    cheaper: over whole cycles of ``round_order`` each callable runs right after each other equally often, and
    ``calls`` is rounded up to whole cycles).

    For each ``(name, baseline)`` in ``pairs`` the result also holds, under ``"name - baseline"``, the median over
    rounds of the two calls' difference in the same round (microseconds), and under ``"name / baseline"`` the median
    of their ratio: paired figures, which a slow spell that lasts a round moves less than the medians apart."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    cycle = cycle_rounds(len(names))
    for round_ in range(-(-calls // cycle) * cycle):
        for name in round_order(names, round_):
            if dist.is_initialized():
                dist.barrier()
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return {**{name: 1e6 * statistics.median(values) for name, values in times.items()}, **paired_figures(times, pairs)}


def round_order(names: list[str], round_: int) -> list[str]:
    """The order of round ``round_`` (from 0): a row of a Williams design, the Latin square balanced for carry-over.
    Over every ``cycle_rounds(len(names))`` rounds each name is first equally often and runs right after each other
    name equally often, so no callable is always timed warm behind another (a rotation keeps its neighbours: with
    one, the baseline listed after ours ran right after it in every round but one)."""
    count = len(names)
    base, low, high = [0], 1, count - 1  # 0, 1, n-1, 2, n-2, ...: consecutive differences cover every residue once
    while len(base) < count:
        base.append(low)
        low += 1
        if len(base) < count:
            base.append(high)
            high -= 1
    row = round_ % cycle_rounds(count)
    order = [names[(index + row) % count] for index in base]
    return order[::-1] if row >= count else order  # an odd count needs each row reversed too


def cycle_rounds(count: int) -> int:
    """The rounds after which ``round_order`` has balanced ``count`` names: ``count`` if even, else twice it."""
    return count if count % 2 == 0 else 2 * count


def paired_figures(times: dict[str, list[float]], pairs: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """Per ``(name, baseline)``: the median over rounds of ``name``'s time minus ``baseline``'s (microseconds) and of
    their ratio, ``times`` holding each callable's seconds round by round."""
    figures = {}
    for name, baseline in pairs:
        rounds = list(zip(times[name], times[baseline]))
        figures[f"{name} - {baseline}"] = 1e6 * statistics.median(ours - base for ours, base in rounds)
        figures[f"{name} / {baseline}"] = statistics.median(ours / base for ours, base in rounds)
    return figures


def time_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 5,
    iters: int = 20,
    group: dist.ProcessGroup | None = None,
    before: Callable[[], object] | None = None,
) -> float:
    """Median milliseconds of ``fn()`` on this rank, maximum over the ranks of ``group``.

    Before each call the ranks synchronise (so that a collective inside ``fn`` does not time another rank's
    lateness), ``before()`` runs untimed (e.g. to reset state), and the call is queued behind a short GPU sleep
    (``QUEUE_AHEAD_CYCLES``) so that the time is the GPU's, not the launching host's.
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        if before is not None:
            before()
        if dist.is_initialized():
            dist.barrier(group=group)
        torch.cuda.synchronize()
        start_behind_sleep(start)
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device="cuda")
    if dist.is_initialized():
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median.item())


def time_side_by_side(
    fns: dict[str, Callable[[], object]],
    *,
    warmup: int = 5,
    iters: int = 20,
    group: dist.ProcessGroup | None = None,
    before: dict[str, Callable[[], object]] | None = None,
    host_us: dict[str, float] | None = None,
) -> dict[str, float]:
    """Like :func:`time_ms` for several functions, interleaved call by call, so that all of them see the same
    clocks: under load these GPUs reach their power limit and their clocks move by up to 30%. The order is
    shuffled every round (the same way on every rank), so that no function always follows the same one: a call
    right after a light one (a collective alone) runs with more power headroom than one after a GEMM.

    ``host_us``, if given, receives each function's median host time per call (microseconds, maximum over ranks):
    where it exceeds the queued-ahead sleep, the GPU waited for the host."""
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
