"""What the environment says about calls, read once (``current``; ``refresh`` to read it again) and handed down as
values: the debug deadline, whether the ranks check that they agree on each call, whether repeated calls may be
replayed from CUDA graphs, whether NCCL's peer-to-peer transport is off.

| variable | effect |
| --- | --- |
| ``FLASHOVERLAP_DEBUG_TIMEOUT=S`` | every wait bounded by about ``S`` s (no replay); the agreement check on |
| ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` | PyTorch's switch for mismatches: the agreement check on (``AGREEMENT_TIMEOUT``) |
| ``FLASHOVERLAP_REPLAY=0`` | repeated P2P calls are issued eagerly, never replayed from a graph |
| ``CUDA_DEVICE_MAX_CONNECTIONS=1`` | no replay either (a graph launch does not keep the issue order on one queue) |
| ``NCCL_P2P_DISABLE=1`` | ``path="auto"`` never takes the P2P path (NCCL moves bytes through host memory) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flashoverlap import guards

AGREEMENT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Settings:
    timeout: float | None  # the debug deadline in seconds; None: waits are not bounded
    replay: bool  # repeated calls may be replayed from CUDA graphs (before the capture check of the call itself)
    nccl_p2p_disabled: bool
    agreement: float | None = None  # the agreement check's deadline in seconds; None: no check


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
    detail = environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    agreement = timeout if timeout is not None else AGREEMENT_TIMEOUT if detail else None
    return Settings(timeout, replay, environ.get("NCCL_P2P_DISABLE") == "1", agreement)
