"""``flashoverlap.testing.spawn``, which every multi-process test stands on: fresh ranks per call, the caller's
environment at the call, the ranks' output on the caller's streams, a rank's failure raised in the caller."""

import os
import sys

import pytest

from flashoverlap.testing import spawn

_touched = None  # a module global a rank sets: a rank of a later call must not see it


def _report(rank, world_size, name):
    global _touched
    before, _touched = _touched, rank
    print(f"rank {rank} of {world_size} says hello")
    print(f"rank {rank} warns", file=sys.stderr)
    return before, os.environ.get(name), os.environ.get("FLASHOVERLAP_TEST_GONE"), "PATH" in os.environ


def _fail(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")


def test_ranks_see_the_callers_environment_at_the_call_and_start_fresh(monkeypatch, capfd):
    monkeypatch.setenv("FLASHOVERLAP_TEST_SET", "set after the session began")
    monkeypatch.setenv("FLASHOVERLAP_TEST_GONE", "removed before the call")
    monkeypatch.delenv("FLASHOVERLAP_TEST_GONE")
    assert "PATH" in os.environ  # set when the session (and the forkserver) began; removed for this call
    monkeypatch.delenv("PATH")
    first = spawn(_report, 2, args=("FLASHOVERLAP_TEST_SET",))
    assert first == [(None, "set after the session began", None, False)] * 2
    again = spawn(_report, 2, args=("FLASHOVERLAP_TEST_SET",), env={"FLASHOVERLAP_TEST_SET": "given"})
    assert again == [(None, "given", None, False)] * 2  # env wins; no rank of the first call is reused
    out, err = capfd.readouterr()
    assert out.count("rank 0 of 2 says hello") == 2 and out.count("rank 1 of 2 says hello") == 2
    assert err.count("rank 1 warns") == 2


def test_a_failing_rank_is_raised_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*ValueError: rank one refuses"):
        spawn(_fail, 2)
