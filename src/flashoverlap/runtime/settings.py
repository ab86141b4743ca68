"""What the environment says about calls, read once (``current``; ``refresh`` to read it again) and handed down as
values: the debug deadline, whether repeated calls may be replayed from CUDA graphs, whether NCCL's peer-to-peer
transport is off.

| variable | effect |
| --- | --- |
| ``FLASHOVERLAP_DEBUG_TIMEOUT=S`` | every wait is bounded by about ``S`` seconds (debug mode; no replay) |
| ``FLASHOVERLAP_REPLAY=0`` | repeated P2P calls are issued eagerly, never replayed from a graph |
| ``CUDA_DEVICE_MAX_CONNECTIONS=1`` | no replay either (a graph launch does not keep the issue order on one queue) |
| ``NCCL_P2P_DISABLE=1`` | ``path="auto"`` never takes the P2P path (NCCL moves bytes through host memory) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flashoverlap import guards


@dataclass(frozen=True)
class Settings:
    timeout: float | None  # the debug deadline in seconds; None: waits are not bounded
    replay: bool  # repeated calls may be replayed from CUDA graphs (before the capture check of the call itself)
    nccl_p2p_disabled: bool


_current: Settings | None = None


def current() -> Settings:
    """The settings in force: read from the environment at the first call, then kept (reading the environment costs
    microseconds a call). A program that changes these variables while it runs calls ``refresh()`` after."""
    global _current
    if _current is None:
        _current = read()
    return _current


def refresh() -> None:
    """Read the environment again at the next call."""
    global _current
    _current = None


def read(environ: os._Environ | dict = os.environ) -> Settings:
    """The settings the environment ``environ`` gives."""
    timeout = guards.debug_timeout(environ)
    replay = (timeout is None and environ.get("FLASHOVERLAP_REPLAY", "1") != "0"
              and environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1")
    return Settings(timeout, replay, environ.get("NCCL_P2P_DISABLE") == "1")
