"""The agreement check's edges (runtime/agreement.py): with no switch set it waits as long as the group's own
timeout (not a deadline of its own), it names a missing rank after ``release`` as before it, its message mentions
unchecked repeated calls only where repeated calls go unchecked, and ``release`` on a rank outside a subgroup holds
nothing to free."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap import settings
from flashoverlap.runtime import agreement
from flashoverlap.runtime.context import context_of
from flashoverlap.testing import spawn
from tests.absent_rank import gave_up, stay_away


def _group_timeout(rank: int, world: int) -> tuple[float, float]:
    short = dist.new_group(timeout=datetime.timedelta(seconds=40))
    dist.barrier(short)  # both ranks' meshes connected before either leaves
    return (agreement.group_timeout(context_of(short, torch.device("cpu"))),
            agreement.group_timeout(context_of(dist.group.WORLD, torch.device("cpu"))))


def test_the_check_without_a_switch_waits_as_long_as_the_groups_own_timeout():
    # A rank kept 5 minutes elsewhere (a checkpoint) failed the call on its peers at 300 s, though the group's own
    # collectives (gloo: 30 minutes by default) would have waited for it.
    # A little less (a tenth, at most 30 s) than the group's own, so that this error comes before the backend's.
    assert spawn(_group_timeout, 2, timeout=60) == [(36.0, 1770.0)] * 2


def _late_rank_on_a_short_group(rank: int, world: int, detail: bool, done: str) -> tuple[str, float]:
    os.environ.pop("FLASHOVERLAP_DEBUG_TIMEOUT", None)
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    if detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    settings.refresh()
    short = dist.new_group(timeout=datetime.timedelta(seconds=5))
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    if rank == 1:
        stay_away(done)  # never makes the call within the group's timeout
        return "absent", 0.0
    start = time.monotonic()
    try:
        fo.gemm_all_reduce(a, b, group=short)
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    finally:
        gave_up(done)
    return "returned", time.monotonic() - start


@pytest.mark.parametrize("detail", [False, True])
def test_a_rank_absent_past_the_groups_timeout_is_named_at_that_timeout(detail, tmp_path):
    # Under TORCH_DISTRIBUTED_DEBUG=DETAIL alone too (it waited a fixed 300 s).
    (message, seconds), _ = spawn(_late_rank_on_a_short_group, 2, args=(detail, str(tmp_path / "done")), timeout=120)
    assert "rank 1 did not reach the call within 4.5 s" in message, message  # before gloo's own 5 s
    assert seconds < 30, seconds
    # The check of every call of the reference path (CPU tensors) checks repeated calls too: no such hint.
    assert "not checked again" not in message


def _absent_after_release(rank: int, world: int, done: str) -> str:
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    for _ in range(3):
        fo.gemm_all_reduce(a, b)
    fo.release()
    if rank == 1:
        stay_away(done)  # released like its peer, then never comes to the next call
        return "absent"
    try:
        fo.gemm_all_reduce(a, b)
    except RuntimeError as exc:
        return str(exc)
    finally:
        gave_up(done)
    return "returned"


def test_a_rank_absent_after_release_is_named(tmp_path):
    # After release the exchanges counted from 1 again, and the keys the released context wrote passed for
    # arrivals: "every rank reached the call, but its agreement exchange did not end".
    message, _ = spawn(_absent_after_release, 2, args=(str(tmp_path / "done"),),
                       env={"FLASHOVERLAP_DEBUG_TIMEOUT": "3"}, timeout=120)
    assert "rank 1 did not reach the call within 3 s" in message, message


def _release_outside_a_subgroup(rank: int, world: int) -> str:
    sub = dist.new_group([0])
    if rank == 0:
        fo.gemm_all_reduce(torch.randn(4, 8), torch.randn(8, 6), group=sub)
    fo.release(sub)  # rank 1 holds nothing for a group it is not in
    dist.barrier()
    return "released"


def test_release_on_a_rank_outside_the_group_frees_nothing_and_raises_nothing():
    assert spawn(_release_outside_a_subgroup, 2, timeout=60) == ["released"] * 2


@pytest.mark.parametrize("once", [True, False])
def test_the_late_message_mentions_unchecked_repeated_calls_only_where_they_are(once, monkeypatch):
    class Context:
        rank, name = 0, "group WORLD"

    monkeypatch.setattr(agreement, "_absent", lambda context, arrival: [1])
    text = agreement._late("gemm_all_reduce", Context(), None, 5.0, once)
    assert ("a repeated call is not checked again" in text) is once
    assert "rank 1 did not reach the call within 5 s" in text


def test_a_rank_that_arrives_after_the_exchange_failed_is_not_named_with_the_one_that_left():
    """A peer that left breaks the exchange at once for the ranks already in it; a rank still on its way (slower, not
    absent) then marked its arrival a moment later, and was named with the one that left ("ranks [1, 2] never
    reached it", seen under load in CI). The ranks get ``ARRIVAL_GRACE`` to arrive before the error names them."""
    import threading

    class Context:
        world_size, arrival_generation = 3, 1

    mark = agreement._arrival_mark(1, 5)
    store = dist.HashStore()
    store.set(agreement._arrival_key(5, 0), mark)  # rank 0, the one asking
    late = threading.Timer(0.3, lambda: store.set(agreement._arrival_key(5, 1), mark))  # rank 1, a little later
    late.start()
    try:
        assert agreement._absent(Context(), (store, 5)) == [1, 2]  # asked at once: rank 1 not there yet
        assert agreement._absent(Context(), (store, 5), grace=agreement.ARRIVAL_GRACE) == [2]
    finally:
        late.join()
    assert agreement._absent(Context(), (store, 5), grace=0.2) == [2]
    assert agreement.ARRIVAL_GRACE <= 5  # an error path's wait: bounded well within the debug timeout's margin


def test_a_store_that_dies_during_the_grace_leaves_its_last_answer():
    """The group's store lived on rank 0, which raised and ended during a slower survivor's grace: its next question
    failed, and the error said that the store could not say which rank was absent, though it had said so a moment
    before. The last answer stands; a store that never answered still says nothing (None)."""

    class Context:
        world_size, arrival_generation = 3, 1

    mark = agreement._arrival_mark(1, 5)

    class Dying:
        def __init__(self, answers: int) -> None:
            self.answers = answers

        def check(self, keys):
            if self.answers == 0:
                raise RuntimeError("Connection reset by peer")
            self.answers -= 1
            return keys[0] != agreement._arrival_key(5, 2)  # ranks 0 and 1 arrived, rank 2 left

        def get(self, key):
            return mark.encode()

    assert agreement._absent(Context(), (Dying(3), 5), grace=agreement.ARRIVAL_GRACE) == [2]
    assert agreement._absent(Context(), (Dying(0), 5), grace=agreement.ARRIVAL_GRACE) is None
