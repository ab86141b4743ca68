"""Host-time measurement for the benchmarks and diagnostics: the host time to issue one call while the GPU is busy
ahead of it, alone or several callables side by side in balanced rounds. (The GPU times are
``flashoverlap.tune.timing``'s: ``time_ms``, ``time_side_by_side``.)"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from flashoverlap.tune.timing import QUEUE_AHEAD_CYCLES


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


def loop_host_us(fn: Callable[[], object], calls: int, sleep_cycles: int = QUEUE_AHEAD_CYCLES) -> float:
    """Host time per call (microseconds) of ``calls`` calls of ``fn`` issued back to back while the GPU is busy ahead
    (``sleep_cycles`` of GPU sleep): one sample of the loop a model runs, no synchronisation inside it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    per_call = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return per_call


def profiled(fn: Callable[[], object], calls: int, sleep_cycles: int = QUEUE_AHEAD_CYCLES,
             orders: tuple[str, ...] = ("tottime",), limit: int = 25) -> str:
    """cProfile of ``calls`` calls of ``fn`` issued while the GPU is busy ahead: the ``limit`` functions first in
    each of ``orders`` (``pstats`` sort keys), as text."""
    import io
    import pstats

    profile = profile_of(fn, calls, sleep_cycles)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    for order in orders:
        stats.sort_stats(order).print_stats(limit)
    return text.getvalue()


def profile_of(fn: Callable[[], object], calls: int, sleep_cycles: int = QUEUE_AHEAD_CYCLES):
    """A ``cProfile.Profile`` of ``calls`` calls of ``fn`` issued while the GPU is busy ahead (``sleep_cycles``)."""
    import cProfile

    profile = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    return profile


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
