"""The P2P path's schedules (``comm/tp/ring_schedule.py``) executed for every rank at once on the CPU
(``tests/comm/ring_sim.py``): W = 2..8, the three ops, back-to-back calls of changing shapes and ops that overlap
each other across ranks, in random interleavings; and every wait, signal and event of a schedule removed in turn
is caught (a deadlock, a lost signal, a wrong result, or copy-stream work outside a capture's stream order).
fp8 calls run the same schedules on packed rows (``ring_sim``: a row's values and its scales one unit, a bias per
rank): the same properties are asserted for them, fp8 calls mixed with plain ones in the same regions."""

import numpy as np
import pytest

from flashoverlap.comm import steps
from flashoverlap.comm.tp import ring_schedule as rs
from flashoverlap.plan import TileConfig
from flashoverlap.tune.defaults import default_plan
from tests.comm.ring_sim import Failure, make_call, simulate

TILE = TileConfig(16, 16, 16, 2, 1, 4)


def _plan(op, world, m_blocks, n, k, sub):
    m = 16 * m_blocks * world + (0 if op != "all_reduce" else 16 * (world - 1))
    return default_plan(op, m, n, k, world, tile=TILE, num_groups=sub, path="p2p", allow_sequential=False)


def _calls(world, seed, ops=("reduce_scatter", "all_reduce", "all_gather"), fp8=False):
    """Six back-to-back calls, every op twice; ``fp8``: calls 1, 3, 4 and 5 carry packed rows of 1, 2 or 3 scales
    (tensor- or row-wise, and block-wise), mixed with plain calls in the same regions."""
    rng = np.random.default_rng(seed)
    plans = [_plan(op, world, m_blocks, n, k, sub)
             for op, m_blocks, n, k, sub in [(ops[i % len(ops)], 2 + i % 3, 8 + 4 * i, 6 + i, 1 + i % 3)
                                             for i in range(6)]]  # every op twice
    return [make_call(plan, rng, columns=(0, 1, 0, 3, 2, 1)[i] if fp8 else 0) for i, plan in enumerate(plans)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_back_to_back_calls_of_every_op_are_right_in_random_interleavings(world, fp8):
    for seed in range(6 if world < 8 else 3):
        simulate(_calls(world, seed, fp8=fp8), seed=seed)


@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce", "all_gather"])
def test_schedule_shapes(op):
    plan = _plan(op, 4, 3, 8, 8, 2)
    ops = rs.schedule(plan, 1)
    mms = [o for o in ops if isinstance(o, steps.Mm)]
    if op == "all_gather":  # own shard at once, then each peer's sub-bands, in order rank+1, rank+2, ...
        assert len(mms) == 1 + 3 * plan.num_groups and not any(o.accumulate for o in mms)
        assert [o.dst.row // plan.block_rows for o in mms[1:]][:: plan.num_groups] == [2, 3, 0]
    else:  # W steps of S sub-bands; all but the first step add the pulled partial in cuBLAS
        per = plan.num_groups // 4 if op == "all_reduce" else plan.num_groups
        assert len(mms) == 4 * per and sum(o.accumulate for o in mms) == 3 * per
    # cuBLAS on C; pulls from peers on X; copies within the GPU on L.
    for o in ops:
        if isinstance(o, steps.Mm):
            assert o.stream == "C"
        elif isinstance(o, steps.Copy):
            from_peer = o.src.space == "sym" and o.src.rank != 1
            assert o.stream == ("X" if from_peer else "L"), o


def _mutations(op, world):
    plan = _plan(op, world, 2, 8, 6, 2)
    ops = rs.schedule(plan, 0)
    return plan, [i for i, o in enumerate(ops) if isinstance(o, (steps.Wait, steps.Signal, steps.WaitEvent))]


def _caught(world, op, index, tries=60, columns=0):
    for seed in range(tries):
        rng = np.random.default_rng(seed)
        plan = _plan(op, world, 2, 8, 6, 2)
        calls = [make_call(plan, rng, columns) for _ in range(3)]
        try:
            simulate(calls, seed=seed, drop={0: {index}})
        except Failure:
            return True
    return False


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("op,columns", [("reduce_scatter", 0), ("all_reduce", 0), ("all_gather", 0),
                                        ("all_gather", 1), ("all_gather", 2), ("all_reduce", 1)])
def test_every_wait_signal_and_event_of_the_schedule_is_needed(op, columns, world):
    """``columns`` > 0: fp8 calls (the all-gather's packed rows of 1 scale, tensor- or row-wise, and of 2,
    block-wise, moved as one unit; the all-reduce's scaled bands with a bias and the explicit add)."""
    _, indices = _mutations(op, world)
    assert indices
    missed = [(i, rs.schedule(_plan(op, world, 2, 8, 6, 2), 0)[i]) for i in indices
              if not _caught(world, op, i, columns=columns)]
    assert not missed, f"removing these went unnoticed: {missed}"


@pytest.mark.parametrize("world", [2, 8])
def test_the_executors_final_join_is_needed(world):
    # All-reduce's last writes of the result are X's pulls. (Reduce-scatter's and all-gather's are C's, after
    # events from X; there the join is what a CUDA-graph capture needs, every forked stream joined back.)
    assert _caught(world, "all_reduce", "join")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce", "all_gather"])
def test_only_signals_write_into_a_peers_memory(op, world):
    """The P2P executor's signal is a plain copy with no memory fence (``comm/tp/p2p.py``): sound because what it
    announces lies in this rank's own memory (or was pulled from the peer) and has ended on its stream. So no
    step may write into a peer's memory but a signal, and every signal goes to a peer."""
    for sub in (1, 2, 3):
        plan = _plan(op, world, 3, 8, 8, sub)
        for rank in range(world):
            for gathered_own in (False, True):
                for item in rs.schedule(plan, rank, gathered_own=gathered_own):
                    if isinstance(item, (steps.Copy, steps.Mm)):
                        assert item.dst.space != "sym" or item.dst.rank == rank, item
                    if isinstance(item, steps.Signal):
                        assert item.flag.rank != rank, item
