"""The step types of every schedule: a call's GPU work as data, one step per operation, each on a named stream.

Pure Python (no CUDA). Two schedules are written in these steps: the tensor-parallel P2P ring
(``comm/tp/ring_schedule.py``) and the expert-parallel P2P dispatch and combine (``comm/expert/p2p.py``). Their
executors issue the steps on the GPU (cuBLAS or the grouped GEMM, copy engines, stream memory operations, CUDA
events); the CPU simulators (``tests/comm/ring_sim.py``, ``tests/comm/expert_sim.py``) run them for every rank at
once in random interleavings.

Streams: ``C`` is the caller's stream (every multiplication); ``X`` a copy stream (the bytes that cross to or from a
peer); ``L`` a second copy stream for copies within the GPU (the ring only). Events are numbered per call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """Rows of a buffer, or a flag. ``space``: one of the call's buffers (ring: ``a``, ``out``, ``gathered``;
    expert: ``send``, ``recv``, ``h`` in dispatch, ``a``, ``y``, ``back`` in combine), ``sym`` (rank ``rank``'s
    symmetric data) or ``flag`` (``row`` is then the flag slot of rank ``rank``). ``rank``: whose memory (``sym``
    and ``flag`` may be a peer's). ``region``: the part of the symmetric data (the ring: a region kind,
    ``ring_schedule.region_index`` places it; the expert path: the slot of the source rank)."""

    space: str
    rank: int
    row: int
    region: int = 0


@dataclass(frozen=True)
class Mm:
    """On ``C`` (ring): ``dst[rows] (+)= src[rows] @ b`` (``accumulate``: add to what ``dst`` holds)."""

    dst: Loc
    src: Loc
    rows: int
    accumulate: bool
    stream: str = "C"


@dataclass(frozen=True)
class Gemm:
    """On ``C`` (expert): ``dst[rows] = src[rows]`` times their experts, by the segments of chunk ``chunk``."""

    src: Loc
    dst: Loc
    rows: int
    chunk: int
    stream: str = "C"


@dataclass(frozen=True)
class Copy:
    """On ``stream``: ``rows`` rows from ``src`` to ``dst`` by a copy engine (no SM moves them)."""

    dst: Loc
    src: Loc
    rows: int
    stream: str = "X"


@dataclass(frozen=True)
class Wait:
    """On ``stream``: block until the flag is 1, then reset it to 0; ``what`` it waits for (debug messages)."""

    stream: str
    flag: Loc
    what: str


@dataclass(frozen=True)
class Signal:
    """On ``stream``: set the flag (possibly a peer's) to 1."""

    stream: str
    flag: Loc


@dataclass(frozen=True)
class Record:
    """On ``stream``: record event ``event``."""

    stream: str
    event: int


@dataclass(frozen=True)
class WaitEvent:
    """On ``stream``: wait for event ``event``."""

    stream: str
    event: int


@dataclass(frozen=True)
class Hook:
    """On ``C``: the caller's own independent work, if it gave some (a call's ``hook``), placed where ``C`` would
    otherwise wait for the first rows from a peer, so that the transfers hide behind it. A backward pass puts its
    weight gradient there."""

    stream: str = "C"


@dataclass(frozen=True)
class Gather:
    """On ``C`` (expert dispatch): the send buffer, from the tokens (``comm/expert/rows.py``'s ``send_buffer``)."""

    stream: str = "C"


@dataclass(frozen=True)
class Finish:
    """On ``C`` (expert combine): the weighted sum of the returned rows at the origin."""

    stream: str = "C"


def streams_used(ops: tuple) -> tuple[str, ...]:
    """The streams a schedule uses beside ``C``: ``("X",)`` or ``("X", "L")``."""
    return ("X", "L") if any(op.stream == "L" for op in ops) else ("X",)


def events(ops: tuple) -> int:
    """How many events a schedule uses (0 .. n-1)."""
    return 1 + max((op.event for op in ops if isinstance(op, Record)), default=0)
