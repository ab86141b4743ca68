"""A CPU simulator of the P2P path's schedules (``comm/tp/ring_schedule.py``) on every rank at once.

Each rank has the streams ``C``, ``X`` and ``L``, fed in host order with what ``comm/tp/p2p.py`` issues for each call:
the user's producer of ``a`` (``Produce``), event 0 recorded on ``C``, the schedule, the joins of ``X`` and ``L`` into
``C`` (``Record``/``WaitEvent`` of ``JOIN``) and the user's consumer of the result (``Consume``). A scheduler runs one
runnable stream at a time, chosen at random; a data operation reads when it starts and writes when it ends, so
another stream may run in between. Flags and symmetric regions are shared memory, kept across calls; a region is a
flat store whose rows are laid out by the call's width, so calls of different shapes reuse (and may overwrite)
the same memory as on the GPU. It reports a deadlock (no stream can run), a signal that finds its flag still set
(a lost signal), every call's result that differs from the plain sum, and work on a copy stream before it joined
the call's start on ``C`` (inside a CUDA-graph capture that work would not belong to the graph). Streams run at
random speeds, some far slower than others, so that one rank or stream runs calls ahead of another.

fp8 calls (``make_call(..., columns=S)``): a row of ``a`` is a packed row, its K values and then its S scales
(``comm/scaled.pack_rows``: one unit, which the all-gather's copies move whole), and every ``Mm`` multiplies the
rows' values times their scales (S > 1: one scale per block of ``ceil(K / S)`` columns, as block-wise scaling) and
adds the rank's bias, the result of the fp8 executor's scaled band (``comm/tp/p2p._scaled_band``; accumulating: its
explicit add of the pulled partial). The own shard's packing, on ``C`` before event 0, is ``Produce``'s write.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from flashoverlap.comm import steps
from flashoverlap.comm.tp import ring_schedule as rs

JOIN = -1  # the executor's final joins of X (-1) and L (-2) into C
STREAMS = ("C", "X", "L")


@dataclass(frozen=True)
class Produce:
    """On ``C``: the user's earlier work writes this call's ``a``."""

    stream: str = "C"


@dataclass(frozen=True)
class Consume:
    """On ``C``: the user's later work reads this call's result."""

    stream: str = "C"


class Failure(AssertionError):
    pass


@dataclass
class Call:
    plan: object
    a: list  # per rank: this call's input (all-gather: the shard)
    b: list  # per rank
    want: list  # per rank: the expected result
    want_gathered: np.ndarray | None
    columns: int = 0  # fp8: the scales at the end of each packed row of ``a``; 0: not fp8
    bias: list | None = None  # fp8: per rank, added to each rank's product


def dequantised(rows: np.ndarray, k: int, columns: int) -> np.ndarray:
    """Packed rows' values times their scales (``columns`` 0: plain rows)."""
    if not columns:
        return rows
    per = -(-k // columns)
    return rows[:, :k] * np.repeat(rows[:, k:], per, axis=1)[:, :k]


def make_call(plan, rng: np.random.Generator, columns: int = 0) -> Call:
    """One call's inputs and expected results on every rank; ``columns`` > 0: an fp8 call whose rows of ``a``
    carry that many scales (and whose ranks add a bias each)."""
    world = plan.world_size
    rows = plan.block_rows if plan.op == "all_gather" else plan.m
    a = [rng.standard_normal((rows, plan.k)) for _ in range(world)]
    if columns:  # packed rows: values and their (positive) scales
        a = [np.concatenate([x, rng.uniform(0.5, 2.0, (rows, columns))], axis=1) for x in a]
    b = [rng.standard_normal((plan.k, plan.n)) for _ in range(world)]
    bias = [rng.standard_normal(plan.n) for _ in range(world)] if columns else None

    def product(x, r):
        return dequantised(x, plan.k, columns) @ b[r] + (bias[r] if columns else 0)

    if plan.op == "all_gather":
        full = np.concatenate(a)
        return Call(plan, a, b, [product(full, r) for r in range(world)], full, columns, bias)
    total = sum(product(a[r], r) for r in range(world))
    if plan.op == "all_reduce":
        return Call(plan, a, b, [total] * world, None, columns, bias)
    per = plan.block_rows
    return Call(plan, a, b, [total[r * per : (r + 1) * per] for r in range(world)], None, columns, bias)


def a_width(call: Call) -> int:
    """A row of ``a`` (and of the gathered buffer and the all-gather's regions): its values and its scales."""
    return call.plan.k + call.columns


def host_order(call: Call, rank: int, drop: set = frozenset()) -> list:
    """What the executor issues for one call on ``rank``: ``drop`` removes those indices of the schedule (and
    ``"join"`` the executor's final wait of ``C`` for ``X``)."""
    schedule = rs.schedule(call.plan, rank)
    ops = [op for i, op in enumerate(schedule) if i not in drop]
    joins = []
    for n, stream in enumerate(steps.streams_used(schedule)):
        joins.append(steps.Record(stream, JOIN - n))
        if "join" not in drop:
            joins.append(steps.WaitEvent("C", JOIN - n))
    return [Produce(), steps.Record("C", 0), *ops, *joins, Consume()]


class Rank:
    def __init__(self, world: int, region_size: int) -> None:
        self.flags = np.zeros(rs.FLAG_SLOTS_USED, dtype=np.int64)
        self.flags[rs.FREE_BASE :] = 1
        self.regions = np.full((rs.regions(world), region_size), np.nan)
        self.queues: dict[str, list] = {name: [] for name in STREAMS}
        self.pending: dict[str, object] = {name: None for name in STREAMS}
        self.recorded: dict[int, int] = {}  # event -> completions
        self.issued: dict[int, int] = {}  # event -> records issued so far (host order)


def simulate(calls: list[Call], seed: int, drop: dict[int, set[int]] | None = None, max_steps: int = 200000):
    """Run ``calls`` back to back on every rank; ``drop``: per rank, schedule indices removed (mutations).
    Raises ``Failure`` on a deadlock, a lost signal or a wrong result."""
    world = calls[0].plan.world_size
    widths = [a_width(c) if c.plan.op == "all_gather" else c.plan.n for c in calls]
    region_size = max(rs.region_rows(c.plan) * w for c, w in zip(calls, widths))
    ranks = [Rank(world, region_size) for _ in range(world)]
    # The host allocates every buffer of a call when it issues the call; ``a`` holds garbage until Produce. As
    # the caching allocator would, each call's result reuses the memory of the last one, which the user freed
    # after Consume: a stream that runs ahead of the caller's can overwrite a result the user still reads.
    local = []
    for r in range(world):
        outs = np.full(max(call.want[r].size for call in calls), np.nan)
        gathered = np.full(max(call.plan.m * a_width(call) for call in calls), np.nan)
        local.append([{"a": np.full(call.a[r].shape, np.nan),
                       "out": outs[: call.want[r].size].reshape(call.want[r].shape),
                       "gathered": gathered[: call.plan.m * a_width(call)].reshape(call.plan.m, a_width(call))}
                      for call in calls])
    for r, rank in enumerate(ranks):
        for i, call in enumerate(calls):
            for op in host_order(call, r, (drop or {}).get(r, set())):
                if isinstance(op, steps.WaitEvent):  # waits for the latest record issued before it
                    op = (op, rank.issued.get(op.event, 0))
                elif isinstance(op, steps.Record):
                    rank.issued[op.event] = rank.issued.get(op.event, 0) + 1
                rank.queues[(op[0] if isinstance(op, tuple) else op).stream].append((i, op))
    rng = random.Random(seed)
    # Each stream runs at its own speed, some of them a thousand times slower than others: races that need one
    # stream far ahead of another show up in few tries.
    speed = {(r, name): 10 ** rng.uniform(-3, 0) for r in range(world) for name in STREAMS}

    def buffer(r: int, i: int, loc: steps.Loc, rows: int, width: int) -> tuple[np.ndarray, slice]:
        if loc.space == "sym":
            region = ranks[loc.rank].regions[rs.region_index(loc.region, world)]
            view = region[: (region_size // width) * width].reshape(-1, width)
            return view, slice(loc.row, loc.row + rows)
        return local[r][i][loc.space], slice(loc.row, loc.row + rows)

    def ready(r: int, item) -> bool:
        i, op = item
        if isinstance(op, tuple):
            wait, target = op
            return ranks[r].recorded.get(wait.event, 0) >= target
        if isinstance(op, steps.Wait):
            return ranks[op.flag.rank].flags[op.flag.row] == 1
        return True

    joined: set[tuple[int, int, str]] = set()  # (rank, call, stream) that waited for the call's start on C

    def start(r: int, item, stream: str):
        """Run a control op at once; for a data op return what it will write."""
        i, op = item
        call = calls[i]
        if stream != "C":
            if isinstance(op, tuple) and op[0].event == 0:
                joined.add((r, i, stream))
            elif (r, i, stream) not in joined:
                raise Failure(f"rank {r}, call {i}: {stream} runs {op} before joining the call's start on C (outside a "
                              "CUDA-graph capture)")
        if isinstance(op, Produce):
            local[r][i]["a"][:] = call.a[r]
            return None
        if isinstance(op, Consume):
            got = local[r][i]["out"]
            if not np.allclose(got, call.want[r], rtol=1e-9, atol=1e-9):
                raise Failure(f"rank {r}, call {i} ({call.plan.op}): wrong result")
            return None
        if isinstance(op, (tuple, steps.WaitEvent, steps.Hook)):
            return None
        if isinstance(op, steps.Record):
            ranks[r].recorded[op.event] = ranks[r].recorded.get(op.event, 0) + 1
            return None
        if isinstance(op, steps.Wait):
            ranks[op.flag.rank].flags[op.flag.row] = 0
            return None
        if isinstance(op, steps.Signal):
            flags = ranks[op.flag.rank].flags
            if flags[op.flag.row] != 0:
                raise Failure(f"rank {r}, call {i}: signal to rank {op.flag.rank} slot {op.flag.row} found it set "
                              "(a lost signal)")
            flags[op.flag.row] = 1
            return None
        if isinstance(op, steps.Copy):
            w = a_width(call) if call.plan.op == "all_gather" else call.plan.n
            src, rows = buffer(r, i, op.src, op.rows, w)
            return (op.dst, op.rows, w, src[rows].copy(), False)
        assert isinstance(op, steps.Mm)
        w_dst = call.plan.n
        src, rows = buffer(r, i, op.src, op.rows, a_width(call))
        value = dequantised(src[rows], call.plan.k, call.columns) @ call.b[r]
        if call.columns:
            value = value + call.bias[r]
        if op.accumulate:
            dst, drows = buffer(r, i, op.dst, op.rows, w_dst)
            value = value + dst[drows]
        return (op.dst, op.rows, w_dst, value, True)

    taken = 0
    while True:
        runnable = []
        for r, rank in enumerate(ranks):
            for name in STREAMS:
                if rank.pending[name] is not None or (rank.queues[name] and ready(r, rank.queues[name][0])):
                    runnable.append((r, name))
        if not runnable:
            if any(rank.queues[s] for rank in ranks for s in STREAMS):
                stuck = {(r, s): rank.queues[s][0] for r, rank in enumerate(ranks) for s in STREAMS
                         if rank.queues[s]}
                raise Failure(f"deadlock: {stuck}")
            return taken
        r, name = rng.choices(runnable, weights=[speed[s] for s in runnable])[0]
        rank = ranks[r]
        taken += 1
        if taken > max_steps:
            raise Failure("too many steps")
        if rank.pending[name] is not None:  # a data op ends: its write lands
            i, (dst, rows, w, value, _) = rank.pending[name]
            view, sl = buffer(r, i, dst, rows, w)
            view[sl] = value
            rank.pending[name] = None
            rank.queues[name].pop(0)
            continue
        item = rank.queues[name][0]
        write = start(r, item, name)
        if write is None:
            rank.queues[name].pop(0)
        else:
            rank.pending[name] = (item[0], write)
