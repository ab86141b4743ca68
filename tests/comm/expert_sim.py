"""A CPU simulator of the P2P expert path's schedules (``comm/expert/p2p.py``) on every rank at once.

Each rank has the streams ``C`` and ``X``, fed in host order with what the executor issues for each call: the
user's producer of the call's input (``Produce``), the schedule, the executor's final join of ``X`` into ``C``
(``Record``/``WaitEvent`` of ``JOIN``) and the user's consumer of the results (``Consume``). A scheduler runs one
runnable stream at a time, chosen at random with per-stream speeds that differ by up to a thousand times; a data
operation reads when it starts and writes when it ends, so another stream may run in between. Flags and the
symmetric slots are shared memory kept across calls; as the caching allocator would, every call's temporaries (the
send buffer, combine's products) and results reuse the memory of the previous call's, so a stream running ahead of
the caller overwrites what someone still reads. The "GEMM" is ``rows @ B[rank]``: the schedule's data movement,
not the experts, is what is checked.

It raises ``Failure`` on a deadlock (no stream can run), a signal that finds its flag still set (a lost signal), a
wrong result, or copy-stream work of a call before that stream waited for an event of the call (inside a CUDA-graph
capture such work would not belong to the graph).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from flashoverlap.comm import steps
from flashoverlap.comm.expert import p2p as ep

JOIN = -1
STREAMS = ("C", "X")
WIDTH = 3


@dataclass(frozen=True)
class Produce:
    stream: str = "C"


@dataclass(frozen=True)
class Consume:
    stream: str = "C"


class Failure(AssertionError):
    pass


@dataclass
class Call:
    """One call on every rank: ``rows[s][d]`` rows from rank s to rank d (dispatch's direction; combine returns
    them), the inputs per rank and the expected results per rank (by buffer name)."""

    op: str
    rows: list
    gathered: bool
    inputs: list
    want: list

    def sizes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        world = len(self.rows)
        return tuple(self.rows[rank][d] for d in range(world)), tuple(self.rows[s][rank] for s in range(world))


def _offsets(sizes) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def make_call(op: str, rows: list, gathered: bool, weights: list, rng: np.random.Generator) -> Call:
    """A call with random inputs; ``weights[r]``: rank r's ``B`` (``WIDTH x WIDTH``)."""
    world = len(rows)
    send = [tuple(rows[r][d] for d in range(world)) for r in range(world)]
    recv = [tuple(rows[s][r] for s in range(world)) for r in range(world)]
    if op == "dispatch":  # the input is the send buffer's content (Gather copies it)
        inputs = [rng.standard_normal((sum(send[r]), WIDTH)) for r in range(world)]
        want = []
        for r in range(world):
            got = np.concatenate([inputs[s][_offsets(send[s])[r] :][: rows[s][r]] for s in range(world)])
            want.append({"recv": got, "h": got @ weights[r]} if gathered else {"h": got @ weights[r]})
        return Call(op, rows, gathered, inputs, want)
    inputs = [rng.standard_normal((sum(recv[r]), WIDTH)) for r in range(world)]
    want = []
    for r in range(world):
        back = np.concatenate([inputs[s][_offsets(recv[s])[r] :][: rows[r][s]] @ weights[s] for s in range(world)])
        want.append({"back": back, "out": back})
    return Call(op, rows, gathered, inputs, want)


def host_order(call: Call, rank: int, drop: frozenset = frozenset()) -> list:
    """What the executor issues for one call on ``rank``; ``drop`` removes those schedule indices (and ``"join"``
    the executor's final wait of ``C`` for ``X``)."""
    send, recv = call.sizes(rank)
    ops = [op for i, op in enumerate(ep.schedule(call.op, rank, send, recv, call.gathered)) if i not in drop]
    joins = [steps.Record("X", JOIN)] + ([] if "join" in drop else [steps.WaitEvent("C", JOIN)])
    return [Produce(), *ops, *joins, Consume()]


class Rank:
    def __init__(self, world: int, slot_rows: int) -> None:
        self.flags = np.zeros(ep.FREE_BASE + ep.MAX_RANKS, dtype=np.int64)
        self.flags[ep.FREE_BASE : ep.FREE_BASE + world] = 1
        self.slots = np.full((world, slot_rows, WIDTH), np.nan)
        self.queues: dict[str, list] = {name: [] for name in STREAMS}
        self.pending: dict[str, object] = {name: None for name in STREAMS}
        self.recorded: dict[int, int] = {}
        self.issued: dict[int, int] = {}


def simulate(calls: list[Call], weights: list, seed: int, drop: dict[int, frozenset] | None = None,
             max_steps: int = 400000) -> int:
    """Run ``calls`` back to back on every rank; ``drop``: per rank, schedule indices removed (mutations)."""
    world = len(calls[0].rows)
    slot_rows = max(max(max(row) for row in call.rows) for call in calls) or 1
    ranks = [Rank(world, slot_rows) for _ in range(world)]
    # Per rank: one block of memory per kind of buffer, shared by every call (views of its first rows).
    most = max(sum(sum(row) for row in call.rows) for call in calls) + 1
    memory = [{name: np.full((most, WIDTH), np.nan) for name in ("send", "recv", "h", "y", "back", "out")}
              for _ in range(world)]
    local = []
    for r in range(world):
        per_call = []
        for call in calls:
            send, recv = call.sizes(r)
            sizes = {"send": sum(send), "recv": sum(recv), "h": sum(recv), "y": sum(recv), "back": sum(send),
                     "out": sum(send)}
            buffers = {name: memory[r][name][:n] for name, n in sizes.items()}
            buffers["a"] = np.full(call.inputs[r].shape, np.nan)
            per_call.append(buffers)
        local.append(per_call)
    for r, rank in enumerate(ranks):
        for i, call in enumerate(calls):
            for op in host_order(call, r, (drop or {}).get(r, frozenset())):
                if isinstance(op, steps.WaitEvent):  # waits for the latest record issued before it
                    op = (op, rank.issued.get(op.event, 0))
                elif isinstance(op, steps.Record):
                    rank.issued[op.event] = rank.issued.get(op.event, 0) + 1
                stream = op[0].stream if isinstance(op, tuple) else op.stream
                rank.queues[stream].append((i, op))
    rng = random.Random(seed)
    speed = {(r, name): 10 ** rng.uniform(-3, 0) for r in range(world) for name in STREAMS}
    joined: set[tuple[int, int]] = set()  # (rank, call) whose X waited for an event of the call

    def view(r: int, i: int, loc: steps.Loc, rows: int) -> np.ndarray:
        if loc.space == "sym":
            return ranks[loc.rank].slots[loc.region][loc.row : loc.row + rows]
        return local[r][i][loc.space][loc.row : loc.row + rows]

    def ready(r: int, item) -> bool:
        _, op = item
        if isinstance(op, tuple):
            return ranks[r].recorded.get(op[0].event, 0) >= op[1]
        if isinstance(op, steps.Wait):
            return ranks[op.flag.rank].flags[op.flag.row] == 1
        return True

    def start(r: int, item, stream: str):
        """Run a control op at once; for a data op return what it will write."""
        i, op = item
        call = calls[i]
        if stream == "X":
            if isinstance(op, tuple):
                joined.add((r, i))
            elif (r, i) not in joined:
                raise Failure(f"rank {r}, call {i}: X runs {op} before waiting for an event of the call")
        if isinstance(op, Produce):
            local[r][i]["a"][:] = call.inputs[r]
            return None
        if isinstance(op, Consume):
            for name, want in call.want[r].items():
                if not np.allclose(local[r][i][name], want, rtol=1e-9, atol=1e-9):
                    raise Failure(f"rank {r}, call {i} ({call.op}): wrong {name}")
            return None
        if isinstance(op, (tuple, steps.Hook)):
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
        buffers = local[r][i]
        if isinstance(op, steps.Gather):
            return (buffers["send"], buffers["a"].copy())
        if isinstance(op, steps.Finish):
            return (buffers["out"], buffers["back"].copy())
        if isinstance(op, steps.Copy):
            return (view(r, i, op.dst, op.rows), view(r, i, op.src, op.rows).copy())
        assert isinstance(op, steps.Gemm)
        return (view(r, i, op.dst, op.rows), view(r, i, op.src, op.rows) @ weights[r])

    taken = 0
    while True:
        runnable = [(r, name) for r, rank in enumerate(ranks) for name in STREAMS
                    if rank.pending[name] is not None or (rank.queues[name] and ready(r, rank.queues[name][0]))]
        if not runnable:
            stuck = {(r, s): rank.queues[s][0] for r, rank in enumerate(ranks) for s in STREAMS if rank.queues[s]}
            if stuck:
                raise Failure(f"deadlock: {stuck}")
            return taken
        r, name = rng.choices(runnable, weights=[speed[s] for s in runnable])[0]
        rank = ranks[r]
        taken += 1
        if taken > max_steps:
            raise Failure("too many steps")
        if rank.pending[name] is not None:  # a data op ends: its write lands
            target, value = rank.pending[name]
            target[:] = value
            rank.pending[name] = None
            rank.queues[name].pop(0)
            continue
        write = start(r, rank.queues[name][0], name)
        if write is None:
            rank.queues[name].pop(0)
        else:
            rank.pending[name] = write
