"""The P2P expert path's schedules (``comm/expert/p2p.py``) executed for every rank at once on the CPU
(``tests/comm/expert_sim.py``): W = 2..8, dispatch and combine back to back with changing sizes (exact mode's
packed chunks, bounded mode's whole slots, pairs with no rows, a rank that sends none, one that receives none), in
random interleavings; and every wait, signal and event of a schedule removed in turn is caught (a deadlock, a lost
signal, a wrong result, or copy-stream work outside the call's stream order)."""

import numpy as np
import pytest

from flashoverlap.comm import steps
from flashoverlap.comm.expert import p2p as ep
from tests.comm.expert_sim import WIDTH, Failure, make_call, simulate


def _rows(world, rng, kind):
    """rows[s][d]: skewed random chunks, or whole slots, or a rank that sends none / receives none."""
    if kind == "bounded":
        return [[3] * world for _ in range(world)]
    rows = rng.integers(0, 5, size=(world, world)) * (rng.random((world, world)) < 0.8)
    if kind == "sends_none":
        rows[world - 1, :] = 0
    elif kind == "receives_none":
        rows[:, 0] = 0
    return rows.tolist()


def _weights(world, rng):
    return [rng.standard_normal((WIDTH, WIDTH)) for _ in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_back_to_back_dispatch_and_combine_are_right_in_random_interleavings(world):
    for seed in range(5 if world < 8 else 2):
        rng = np.random.default_rng(seed)
        weights = _weights(world, rng)
        calls = []
        for i, kind in enumerate(["exact", "bounded", "sends_none", "receives_none", "exact", "exact"]):
            rows = _rows(world, rng, kind)
            calls += [make_call("dispatch", rows, i % 2 == 0, weights, rng), make_call("combine", rows, False, weights,
                                                                                      rng)]
        simulate(calls, weights, seed=seed)


def test_schedule_shapes():
    send, recv = (2, 0, 4, 1), (3, 5, 0, 2)
    dispatch = ep.schedule("dispatch", 1, send, recv, True)
    gemms = [op for op in dispatch if isinstance(op, steps.Gemm)]
    # The own chunk first, straight from the send buffer; then each source with rows, in order r-1, r-2, ...
    assert [g.chunk for g in gemms] == [1, 0, 3] and gemms[0].src.space == "send"
    pushes = [op for op in dispatch if isinstance(op, steps.Copy) and op.stream == "X"]
    assert [(p.dst.rank, p.dst.region, p.rows) for p in pushes] == [(2, 1, 4), (3, 1, 1), (0, 1, 2)]
    combine = ep.schedule("combine", 1, send, recv)
    gemms = [op for op in combine if isinstance(op, steps.Gemm)]
    # Destinations in order r+1, r+2, ... (those with rows), the own chunk last, into the returned rows.
    assert [g.chunk for g in gemms] == [3, 0, 1] and gemms[-1].dst.space == "back"
    assert all(op.stream == "C" for op in combine if isinstance(op, (steps.Gemm, steps.Finish, steps.Hook)))
    assert all(op.stream == "X" for op in combine if isinstance(op, steps.Copy) and op.dst.space == "sym")


def _mutations(op, world, rows=None):
    rows = rows or [[2 + (s + d) % 2 for d in range(world)] for s in range(world)]
    send, recv = tuple(rows[0]), tuple(rows[s][0] for s in range(world))
    ops = ep.schedule(op, 0, send, recv, op == "dispatch")
    return rows, ops, [i for i, o in enumerate(ops) if isinstance(o, (steps.Wait, steps.Signal, steps.WaitEvent))]


def _caught(op, world, index, tries=80, rows=None):
    rows, _, _ = _mutations(op, world, rows)
    for seed in range(tries):
        rng = np.random.default_rng(seed)
        weights = _weights(world, rng)
        calls = [make_call(op, rows, op == "dispatch", weights, rng) for _ in range(3)]
        try:
            simulate(calls, weights, seed=seed, drop={0: frozenset({index})})
        except Failure:
            return True
    return False


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_every_wait_signal_and_event_of_the_schedule_is_needed(op, world):
    _, ops, indices = _mutations(op, world)
    assert indices
    missed = [(i, ops[i]) for i in indices if not _caught(op, world, i)]
    assert not missed, f"removing these went unnoticed: {missed}"


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_the_executors_final_join_is_needed(op, world):
    # X reads the send buffer (dispatch) or the products (combine); without the join the next call's C overwrites
    # them while X still pushes.
    assert _caught(op, world, "join")


def test_a_combine_that_returns_nothing_still_joins_its_copy_stream_to_the_call():
    rows = [[0, 2, 3], [0, 1, 2], [0, 3, 1]]  # rank 0 receives none in dispatch: its combine pushes nothing
    _, ops, indices = _mutations("combine", 3, rows)
    joins = [i for i in indices if isinstance(ops[i], steps.WaitEvent) and ops[i].stream == "X"]
    assert len(joins) == 1 and _caught("combine", 3, joins[0], rows=rows)
    missed = [(i, ops[i]) for i in indices if not _caught("combine", 3, i, rows=rows)]
    assert not missed, f"removing these went unnoticed: {missed}"
