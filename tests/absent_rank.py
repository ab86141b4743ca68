"""A rank that stays away from a call while its peers wait for it, for the tests of what the peers raise: it stays
alive and out of the call until the peers have given up (``gave_up``), so the test takes the peers' timeout and no
fixed margin (a fixed sleep had to outlast the timeout, and every run paid for the margin)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def stay_away(done: str, at_most: float = 60.0) -> None:
    """Return once ``done`` exists (a peer's ``gave_up``), or after ``at_most`` seconds."""
    end = time.monotonic() + at_most
    while not os.path.exists(done) and time.monotonic() < end:
        time.sleep(0.05)


def gave_up(done: str) -> None:
    """Tell the absent rank that this rank's wait is over (call it whatever the wait's outcome)."""
    Path(done).touch()
