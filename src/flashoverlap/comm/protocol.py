"""The one protocol every communicator follows, and the values it is given.

A communicator is built once per (process group, device) from a :class:`CommGroup` (plain values: it never sees
the runtime's context) and runs one call at a time from a :class:`Call`: ``run(call) -> (result, extra)``, where
``extra`` is all-gather's gathered input (or None). The runtime (``flashoverlap.runtime``) resolves everything a
call needs before it reaches a communicator: operand checks, the path, the plan, the debug deadline, whether a
repeated call may be replayed from a CUDA graph. ``replayer(call)``, asked after a call that may replay: a
function of a later call's spec (the runtime's description of it, ``runtime/calls.py``) that runs that call, which
reads the same tensors (at the same addresses, in the same layouts) as ``call``, by replaying its graph on fresh
outputs, returning ``(result, extra)``, or None where no graph is held for them (then the runtime runs that call);
None where the communicator replays no such call. (A tensor-parallel lane needs nothing of the spec; an expert
combine's gathers the spec's router weights first, as its call does.) The runtime keeps it
by the call's tensors (its replay lane, ``runtime/calls.py``). ``release()`` frees what the communicator holds
(buffers, cloned process groups, graphs); the runtime calls it from ``flashoverlap.release(group)``.

Communicators, by path: ``reference`` (the executable specification, any backend), ``sequential`` (matmul, then
one collective), ``nccl`` (the signalling GEMM and NCCL per group), ``p2p`` (cuBLAS sub-bands and copy engines over
symmetric memory) and ``ring`` (the same ring over NCCL send/recv). The all-to-all (MoE) communicators take an
``ExpertCall`` (``comm/expert/contract.py``) through the same ``run``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommGroup:
    """A process group as a communicator sees it: the group, the device its tensors are on, this rank's index in
    the group, its size, and a name for error messages."""

    process_group: dist.ProcessGroup
    device: torch.device
    rank: int
    world_size: int
    name: str

    @classmethod
    def of(cls, process_group: dist.ProcessGroup, device: torch.device) -> CommGroup:
        return cls(process_group, device, dist.get_rank(process_group), dist.get_world_size(process_group),
                   describe(process_group))


def describe(process_group: dist.ProcessGroup) -> str:
    """A name for error messages: the group's registered name and its ranks."""
    name = getattr(process_group, "group_name", None) or "?"
    try:
        ranks = dist.get_process_group_ranks(process_group)
    except (RuntimeError, ValueError):
        ranks = []
    return f"group {name!r} (ranks {ranks})"


@runtime_checkable
class Hook(Protocol):
    """Independent work for the caller's stream that a call may overlap with its communication (a backward pass's
    weight gradient): a communicator issues it where it would otherwise wait."""

    def __call__(self) -> None: ...


class HeldHook(ABC):
    """A hook whose GPU work is fixed by ``signature`` (what it reads and writes, by address and layout), so that a
    replayed call may hold it in its graph (``comm/replay.py``). A base class, not a structural protocol: the check
    runs on every call, and an ``isinstance`` against a runtime-checkable protocol costs tens of microseconds."""

    @abstractmethod
    def __call__(self) -> None: ...

    @property
    @abstractmethod
    def signature(self) -> tuple: ...


def held_signature(hook: Hook | None) -> tuple | None:
    """``hook``'s signature where a graph may hold it, else None."""
    return hook.signature if isinstance(hook, HeldHook) else None


@dataclass(slots=True, eq=False)  # not frozen: a frozen dataclass's __init__ costs microseconds on every call
class Call:
    """One call, as resolved by the runtime: a value that communicators read and never write.

    ``name``: the public op, for messages ("gemm_all_reduce", "all_gather_gemm backward"); ``plan``: its plan (for
    the GEMM ops a ``flashoverlap.plan.Plan``); ``a``, ``b``: the operands; ``return_gathered``: all-gather also
    returns its gathered input; ``hook``: independent work (``Hook``); ``timeout``: the debug deadline in seconds
    (``FLASHOVERLAP_DEBUG_TIMEOUT``, read once by the runtime; None: waits are not bounded); ``replay``: a repeated
    call may be replayed from a CUDA graph (the runtime's verdict: not switched off, not inside a user's capture,
    not in debug mode); ``scales``: an fp8 call's scales, output dtype and bias (``comm/scaled.Scales``; None
    otherwise: a communicator that does not run fp8 is never handed one, ``runtime/policy.py``). A call of a
    sequential plan, which waits on nothing, always has ``timeout=None``."""

    name: str
    plan: Any
    a: torch.Tensor
    b: torch.Tensor
    return_gathered: bool = False
    hook: Hook | None = None
    timeout: float | None = None
    replay: bool = False
    scales: Any = None


class GroupFields:
    """The group's values that the fast communicators keep as attributes, set from the ``CommGroup`` in one place:
    ``group`` (the ``ProcessGroup``), ``device``, ``rank``, ``world_size`` and ``name`` (for messages)."""

    def __init__(self, group: CommGroup) -> None:
        self.group = group.process_group
        self.device = group.device
        self.rank = group.rank
        self.world_size = group.world_size
        self.name = group.name


class NoLane:
    """A communicator whose calls take no replay lane (``Communicator.replayer``: every call reaches ``run``)."""

    def replayer(self, call: Any) -> None:
        return None


@runtime_checkable
class Communicator(Protocol):
    """What every communicator is (see the module docstring). ``path`` names it in the runtime's table."""

    path: ClassVar[str]

    def __init__(self, group: CommGroup) -> None: ...

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def replayer(self, call: Call) -> Callable[[Any], tuple | None] | None: ...

    def release(self) -> None: ...
