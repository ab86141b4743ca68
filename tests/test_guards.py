"""The cross-cutting helpers of ``flashoverlap.guards`` that run without a GPU: debug mode's event polling, on a
fake clock (no timing in the test)."""

import pytest

from flashoverlap import guards


class Clock:
    """``time.monotonic`` and ``time.sleep`` for ``guards``: sleeping moves the clock on, nothing waits."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class Event:
    """A recorded event that completes once the clock reaches ``at`` (never, for None)."""

    def __init__(self, clock, at):
        self.clock, self.at = clock, at

    def query(self):
        return self.at is not None and self.clock.now >= self.at


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(guards, "time", fake)
    return fake


def test_poll_events_passes_when_every_wait_ends(clock):
    guards.poll_events([(Event(clock, 100.1), "a"), (Event(clock, 100.3), "b")], 0.5, lambda what: f"{what}")
    assert 100.3 <= clock.now < 100.31


def test_poll_events_names_the_first_wait_that_never_ends_at_one_deadline_for_all(clock):
    waited = [(Event(clock, 100.3), "a"), (Event(clock, None), "b"), (Event(clock, None), "c")]
    with pytest.raises(RuntimeError, match="stuck on b"):
        guards.poll_events(waited, 0.5, lambda what: f"stuck on {what}")
    # The deadline is 0.5 s after the check began for every wait, not 0.5 s after the previous wait ended.
    assert 100.5 < clock.now < 100.51
