"""Every environment variable the library reads, read here once (``current``; ``refresh`` to read them again) and
handed down as values: the debug deadline, whether the ranks check that they agree on every call (without a
switch, on the first call of each new call only, and on every call of the reference path: ``runtime/agreement.py``),
whether repeated calls may be replayed from CUDA graphs, whether NCCL's peer-to-peer transport is off, where the plan
cache lives, and whether Triton interprets its kernels (on a Triton too old to say so itself).

| variable | effect |
| --- | --- |
| ``FLASHOVERLAP_DEBUG_TIMEOUT=S`` | every wait bounded by about ``S`` s (no replay); agreement on every call |
| ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` | PyTorch's mismatch switch: agreement on every call (the group's timeout) |
| ``FLASHOVERLAP_REPLAY=0`` | repeated calls (P2P, NCCL, sequential) issued eagerly, never replayed (default ``1``) |
| ``CUDA_DEVICE_MAX_CONNECTIONS=1`` | no replay; in a user's capture, NCCL-path reductions in cuBLAS bands (one queue) |
| ``FLASHOVERLAP_CACHE_DIR=D`` | the plan cache's directory (default ``~/.cache/flashoverlap``) |
| ``FLASHOVERLAP_NO_CACHE=1`` | no plan cache: no lookups, no writes (default ``0``; switches take ``0`` or ``1``) |
| ``NCCL_P2P_DISABLE=1`` | ``path="auto"`` never takes the P2P path (NCCL moves bytes through host memory) |
| ``TRITON_INTERPRET=1`` | Triton's interpreter (the CPU tests): asked of Triton itself where it has ``triton.knobs`` |
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

AGREEMENT_TIMEOUT = 300.0  # the agreement check's deadline where a group's backend does not say its own timeout
DEBUG_TIMEOUT_VARIABLE = "FLASHOVERLAP_DEBUG_TIMEOUT"


@dataclass(frozen=True)
class Settings:
    timeout: float | None  # the debug deadline in seconds; None: waits are not bounded
    replay: bool  # repeated calls may be replayed from CUDA graphs (before the capture check of the call itself)
    nccl_p2p_disabled: bool
    # Not None: the agreement check on every call (debug mode), its value the debug deadline or, under DETAIL alone,
    # AGREEMENT_TIMEOUT (the calls then wait as long as the group's own timeout: runtime/agreement.group_timeout).
    agreement: float | None = None
    cache_dir: Path | None = None  # the plan cache's directory; None: no plan cache
    triton_interpret: bool = False  # TRITON_INTERPRET=1 (guards.triton_interpreted asks Triton first)
    single_queue: bool = False  # CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue serves every stream


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
    timeout = debug_timeout(environ)
    single_queue = environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    replay = timeout is None and switch(environ, "FLASHOVERLAP_REPLAY", True) and not single_queue
    detail = environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    agreement = timeout if timeout is not None else AGREEMENT_TIMEOUT if detail else None
    cache = None if switch(environ, "FLASHOVERLAP_NO_CACHE", False) else Path(  # ~ as a shell would expand it
        environ.get("FLASHOVERLAP_CACHE_DIR") or Path.home() / ".cache" / "flashoverlap").expanduser()
    return Settings(timeout, replay, environ.get("NCCL_P2P_DISABLE") == "1", agreement, cache,
                    environ.get("TRITON_INTERPRET") == "1", single_queue)


def switch(environ: os._Environ | dict, name: str, default: bool) -> bool:
    """A library switch's value: ``1`` on, ``0`` off, unset or empty ``default``; anything else (``true``, ``no``)
    raises, naming the variable, instead of being read one way or the other."""
    value = environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def debug_timeout(environ: os._Environ | dict = os.environ) -> float | None:
    """Seconds any wait may take before it raises, from ``FLASHOVERLAP_DEBUG_TIMEOUT`` (unset or <= 0: no bound)."""
    value = environ.get(DEBUG_TIMEOUT_VARIABLE)
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds):  # nan compares false both ways: it would turn the bound off silently
        raise ValueError(f"{DEBUG_TIMEOUT_VARIABLE} must be a number of seconds, got {value!r}")
    return seconds if seconds > 0 else None
