"""The P2P path's per-call work as data: for one rank, the ordered operations of its streams, in the step types
of ``comm/steps.py``.

Pure Python (no CUDA). ``comm/tp/p2p.py`` issues the list on the GPU (cuBLAS, copy engines, stream memory
operations, CUDA events); ``tests/comm/test_ring_protocol.py`` executes it for every rank at once on the CPU,
in random interleavings, over several back-to-back calls.

Streams: ``C`` is the caller's stream (every multiplication, by cuBLAS); ``X`` is the rank's copy stream (every
byte pulled from a peer, by copy engine: no SM moves or sums data); ``L``, a second copy stream, copies within
the GPU (the own shard into symmetric memory, the own reduced rows into the output), so that those copies never
queue ahead of a pull that the GEMM waits for. One rule makes the protocol simple: **a rank writes data
only into its own memory**; peers *pull* from its symmetric regions with copy engines, and the only writes into a
peer's memory are 32-bit flags.

Handshake of a symmetric region (one *kind* of region per producer: the partial it sends at ring step ``s``, its
reduced block for all-reduce, its shard for all-gather), between its producer and each consumer:

- ``full[producer, kind, j]`` lives with the consumer: the producer sets it once sub-band ``j`` is written; the
  consumer waits for it, resets it to 0, then pulls.
- ``free[kind, consumer]`` lives with the producer and starts at 1: the consumer sets it after its last pull of
  the region in a call; the producer waits for it (and resets it) before it first writes the region in a call.

Every flag is reset by its waiter before anything its next setter depends on, so flags carry no epochs: a captured
CUDA graph of a call replays. Region offsets depend only on the kind and the workspace size (not the shape), so
calls of different shapes, sub-band counts or ops never overlap a region another kind's flags guard.

Reduce-scatter, as a ring: at step ``s = 0 .. W-1`` rank ``r`` computes the partial of block ``q = (r - s - 1) mod
W`` (block ``q``: rank ``q``'s rows), sub-band by sub-band. From step 1 on, ``X`` first pulls the partial that rank
``r - 1`` computed at step ``s - 1`` (the same block) into the destination, and ``C`` adds its own product to it
in place (``addmm_``: cuBLAS sums in its epilogue, beta = 1). Steps before the last write the rank's symmetric
region of kind ``s``, pulled by rank ``r + 1``; the last step's block is the rank's own, fully reduced, in ``out``.
All-reduce is the same over the plan's ``W * S`` groups (block ``q``: groups ``q*S .. q*S+S-1``), except that the
last step writes the region ``RED``, which ``L`` then copies into the rank's own rows of ``out`` and every peer
pulls into its ``out`` (a direct all-gather of the reduced blocks). All-gather: ``L`` copies the rank's shard into
its region ``SHARD`` sub-band by sub-band and tells every peer of each; ``C`` multiplies the own shard first, then
each sub-band of shard ``r + 1``, ``r + 2``, ... as ``X`` lands it in the (ordinary) gathered tensor.

Why it cannot deadlock. Order the work of all ranks by (call, step, sub-band). Every wait of a call is on work of
an earlier position: ``C`` of rank ``r`` at (s, j) waits on its ``X``'s pull of (s - 1, j) of rank ``r - 1``,
which waited only on that rank's ``C`` at (s - 1, j); a ``free`` wait is on pulls of the previous call; the
all-reduce's final pulls are on the peers' last step. On every rank the list is issued in that order, and each
stream runs its part in list order, so the earliest unfinished position can always proceed, also when one
hardware queue serves all streams (``CUDA_DEVICE_MAX_CONNECTIONS=1``: the list order is the queue order).
Copies and stream memory operations need no SM, and cuBLAS waits on nothing but its own stream. Inside a CUDA graph a
``Wait`` is a one-warp spinning kernel instead (``comm/tp/p2p.py``): it holds no SM its producer needs, since the
producer is a peer's copy after the peer's own work (on another GPU, or in another process's time slice of a
shared one), and it blocks its stream exactly as the memory operation does.

fp8 calls add no step: the same list runs with rows of another width (the all-gather's packed rows, fp8 bytes and
their scales moved together, a shard's scales in the same ``Copy`` as its rows; the reductions' rows of the output
dtype). An ``Mm`` of an fp8 call is a scaled product on ``C``, and an accumulating one is that product then its add
to the pulled partial, both on ``C``: two kernels in the step's place in ``C``'s order, waiting on nothing but
``C``, so the argument above holds unchanged. The all-gather's packing of the own shard runs on ``C`` before
event 0, like the caller's earlier work that writes ``a``.
"""

from __future__ import annotations

import functools

from flashoverlap.comm.steps import Copy, Hook, Loc, Mm, Record, Signal, Wait, WaitEvent
from flashoverlap.plan import P2P_MAX_RANKS, P2P_MAX_SUB_BANDS, Plan

MAX_RANKS = P2P_MAX_RANKS  # the flag layout is sized for the plan's limits
MAX_SUB = P2P_MAX_SUB_BANDS
RED, SHARD = MAX_RANKS - 1, MAX_RANKS  # region kinds beside the ring partials 0 .. W-2
KINDS = MAX_RANKS + 1
FREE_BASE = MAX_RANKS * KINDS * MAX_SUB  # first flag slot of the free flags
FLAG_SLOTS_USED = FREE_BASE + KINDS * MAX_RANKS


def full_slot(producer: int, kind: int, sub: int) -> int:
    return (producer * KINDS + kind) * MAX_SUB + sub


def free_slot(kind: int, consumer: int) -> int:
    return FREE_BASE + kind * MAX_RANKS + consumer


def region_index(kind: int, world: int) -> int:
    """Where a kind's region lies in a rank's symmetric data: partials 0 .. W-2, then RED, then SHARD."""
    return kind if kind < world - 1 else world - 1 if kind == RED else world


def regions(world: int) -> int:
    return world + 1


def blocks(plan: Plan) -> list[list[tuple[int, int]]]:
    """Per rank block ``q``: its sub-bands as ``(first row, rows)``, rows of ``a``/``out`` for reduce-scatter and
    all-gather (block ``q`` starts at ``q * M / W``), of ``C`` for all-reduce (groups ``q*S .. q*S+S-1``)."""
    world = plan.world_size
    if plan.op == "all_reduce":
        per = plan.num_groups // world
        return [[(g.row_start, g.rows) for g in plan.groups[q * per : (q + 1) * per]] for q in range(world)]
    return [[(q * plan.block_rows + g.row_start, g.rows) for g in plan.groups] for q in range(world)]


def _block_start(plan: Plan, q: int) -> int:
    return blocks(plan)[q][0][0]


@functools.lru_cache(maxsize=256)  # built once per (plan, rank): calls of a shape reuse it
def schedule(plan: Plan, rank: int, gathered_own: bool = True) -> tuple:
    """The ordered operations of one call of ``plan`` on ``rank`` (all-gather: ``gathered_own`` copies the own
    shard into the gathered tensor as well, for callers that return it). Event 0 is the call's start on ``C``;
    the caller records it before the list and joins ``X`` back into ``C`` after it."""
    if plan.world_size > MAX_RANKS:
        raise ValueError(f"the P2P path supports up to {MAX_RANKS} ranks, got {plan.world_size}")
    # X starts after the caller's earlier work on C: it reads ``a`` (all-gather), or writes ``out`` on a peer's
    # signal alone (reduce-scatter's last step), where ``out``'s memory may still be in use by that work (the
    # caching allocator hands out memory freed on C); and inside a CUDA-graph capture, X's work belongs to the
    # graph only if X joined the capturing stream before it.
    ops: list = [WaitEvent("X", 0)]
    if plan.op != "reduce_scatter":
        ops.append(WaitEvent("L", 0))
    if plan.op == "all_gather":
        _all_gather(ops, plan, rank, gathered_own)
    else:
        _ring_reduce(ops, plan, rank)
    return tuple(ops)


def _ring_reduce(ops: list, plan: Plan, rank: int) -> None:
    world, bands = plan.world_size, blocks(plan)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    peers = [(rank + step) % world for step in range(1, world)]
    event = 1
    for s in range(world):
        q = (rank - s - 1) % world
        base = _block_start(plan, q)
        last = s == world - 1
        reduced = last and plan.op == "all_reduce"  # all-reduce's own block: published for every peer
        kind = RED if reduced else s
        writes_sym = not (last and plan.op == "reduce_scatter")  # else: this rank's [M/W, N] output

        def dst(row: int, base: int = base, kind: int = kind, writes_sym: bool = writes_sym) -> Loc:
            return Loc("sym", rank, row - base, kind) if writes_sym else Loc("out", rank, row - base)

        consumers = peers if reduced else [nxt]
        if writes_sym:  # the first write of this region in the call: its consumers are done with the last call's
            stream = "C" if s == 0 else "X"
            ops += [Wait(stream, Loc("flag", rank, free_slot(kind, c)), f"region {kind} free at rank {c}")
                    for c in consumers]
        if s == 1:
            ops.append(Hook())
        published = []  # all-reduce's last step: (sub-band, the event of its reduced rows)
        for j, (row, rows) in enumerate(bands[q]):
            if s > 0:  # the partial of this sub-band from rank - 1 (its step s - 1) lands in place, then C adds
                ops += [Wait("X", Loc("flag", rank, full_slot(prv, s - 1, j)), f"partial {s - 1}.{j} from {prv}"),
                        Copy(dst(row), Loc("sym", prv, row - base, s - 1), rows)]
                if j == len(bands[q]) - 1:
                    ops.append(Signal("X", Loc("flag", prv, free_slot(s - 1, rank))))
                ops += [Record("X", event), WaitEvent("C", event)]
                event += 1
            ops.append(Mm(dst(row), Loc("a", rank, row), rows, accumulate=s > 0))
            if writes_sym:
                ops += [Signal("C", Loc("flag", c, full_slot(rank, kind, j))) for c in consumers]
            if reduced:
                ops.append(Record("C", event))
                published.append((j, event))
                event += 1
        # All-reduce: each reduced sub-band j, the own rows into out (L), and every peer's rows j into out (X, once
        # it has queued every pull of the last step: none waits behind a reduced sub-band).
        for j, ev in published:
            row, rows = bands[q][j]
            ops += [WaitEvent("L", ev), Copy(Loc("out", rank, row), Loc("sym", rank, row - base, RED), rows, "L")]
        for j, _ in published:
            for p in peers:
                p_row, p_rows = bands[p][j]
                ops += [Wait("X", Loc("flag", rank, full_slot(p, RED, j)), f"reduced {j} from {p}"),
                        Copy(Loc("out", rank, p_row), Loc("sym", p, p_row - _block_start(plan, p), RED), p_rows)]
        if published:
            ops += [Signal("X", Loc("flag", p, free_slot(RED, rank))) for p in peers]


def _all_gather(ops: list, plan: Plan, rank: int, gathered_own: bool) -> None:
    world, bands = plan.world_size, blocks(plan)
    peers = [(rank + step) % world for step in range(1, world)]
    own = plan.block_rows * rank
    # L publishes the own shard sub-band by sub-band; X pulls the peers' as they are published.
    ops += [Wait("L", Loc("flag", rank, free_slot(SHARD, c)), f"shard free at rank {c}") for c in peers]
    for j, (row, rows) in enumerate(bands[rank]):
        ops.append(Copy(Loc("sym", rank, row - own, SHARD), Loc("a", rank, row - own), rows, "L"))
        ops += [Signal("L", Loc("flag", c, full_slot(rank, SHARD, j))) for c in peers]
    if gathered_own:
        ops.append(Copy(Loc("gathered", rank, own), Loc("a", rank, 0), plan.block_rows, "L"))
    ops.append(Mm(Loc("out", rank, own), Loc("a", rank, 0), plan.block_rows, accumulate=False))
    ops.append(Hook())
    event = 1
    for q in peers:
        base = plan.block_rows * q
        for j, (row, rows) in enumerate(bands[q]):
            ops += [Wait("X", Loc("flag", rank, full_slot(q, SHARD, j)), f"shard {j} of {q}"),
                    Copy(Loc("gathered", rank, row), Loc("sym", q, row - base, SHARD), rows)]
            if j == len(bands[q]) - 1:
                ops.append(Signal("X", Loc("flag", q, free_slot(SHARD, rank))))
            ops += [Record("X", event), WaitEvent("C", event),
                    Mm(Loc("out", rank, row), Loc("gathered", rank, row), rows, accumulate=False)]
            event += 1


def region_rows(plan: Plan) -> int:
    """Rows of the largest region this plan's calls write (its largest block)."""
    return max(sum(rows for _, rows in block) for block in blocks(plan))

