"""Everything flashoverlap keeps for one (process group, device): one ``GroupState``, found by ``state_of``.

It holds the communicators (created on first use), the measured rates, the plan-cache entries the ranks agreed
on, the P2P verdict, the per-shape call preparations and what was logged once. Nothing else in the package
keeps per-group state. The registry holds a reference to the group itself and checks identity: a group that was
destroyed and re-created gets a fresh state, never another group's rates, verdict or workspaces.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

_STATES: dict[tuple[int, str, int | None], GroupState] = {}
_UNSET = object()


def group_name(group: dist.ProcessGroup) -> str:
    """A name for error messages: the group's registered name and its ranks."""
    name = getattr(group, "group_name", None) or "?"
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        ranks = []
    return f"group {name!r} (ranks {ranks})"


class GroupState:
    """The state of one (process group, device); see the module docstring."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.name = group_name(group)
        self.rates: dict[torch.dtype, Any] = {}  # tune.rates.Rates by dtype
        self.agreed_cache: dict[tuple, dict] = {}  # tune.cache: rank 0's plan-cache entries, by (gpu, world)
        self.calls: dict[tuple, tuple] = {}  # ops._common: a shape's checked path and plan
        self.logged: set = set()
        self._p2p_reason: Any = _UNSET
        self._nccl = None
        self._p2p = None
        self._ring = None

    @property
    def nccl(self):
        """The NCCL communicator (``comm/nccl.py``), created on first use."""
        return self._communicator("_nccl", "nccl", "NcclCommunicator", "creates NCCL state and buffers")

    @property
    def p2p(self):
        """The P2P communicator (``comm/p2p.py``), created on first use."""
        return self._communicator("_p2p", "p2p", "P2PCommunicator", "creates a copy stream and symmetric memory")

    @property
    def ring(self):
        """The ring over NCCL send/recv (``comm/ring_nccl.py``), created on first use."""
        return self._communicator("_ring", "ring_nccl", "RingNcclCommunicator", "creates a communication stream")

    def _communicator(self, attr: str, module: str, cls: str, what: str):
        """The communicator held in ``attr``; on first use imported from ``comm/<module>.py`` (the communicators
        import this module) and created, never inside a CUDA-graph capture."""
        comm = getattr(self, attr)
        if comm is None:
            refuse_inside_capture(what)
            comm = getattr(importlib.import_module(f"flashoverlap.comm.{module}"), cls)(self)
            setattr(self, attr, comm)
        return comm

    def p2p_reason(self) -> str | None:
        """Why the P2P path cannot serve this group (None if it can); collective on first use."""
        if self._p2p_reason is _UNSET:
            from flashoverlap.comm.symmetric import p2p_unavailable_reason

            self._p2p_reason = p2p_unavailable_reason(self.group, self.device)
        return self._p2p_reason


def state_of(group: dist.ProcessGroup, device: torch.device) -> GroupState:
    """The state of ``group`` on ``device``, created on first use."""
    key = (id(group), device.type, device.index)
    state = _STATES.get(key)
    if state is None or state.group is not group:
        state = _STATES[key] = GroupState(group, device)
    return state


def existing_state(group: dist.ProcessGroup | None, device: torch.device) -> GroupState | None:
    """The state of ``group`` on ``device`` if it has one (identity-checked), else None."""
    state = _STATES.get((id(group), device.type, device.index))
    return state if state is not None and state.group is group else None


def forget(group: dist.ProcessGroup | None = None) -> None:
    """Drop the state of ``group`` (every group: None), e.g. before destroying it."""
    for key in [key for key, state in _STATES.items() if group is None or state.group is group]:
        del _STATES[key]


def refuse_inside_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"flashoverlap: the first call of an op on a process group {what} and cannot be captured in a CUDA "
            "graph; call the op once, eagerly, before capturing"
        )
