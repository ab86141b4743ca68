"""The one state object per (process group, device), and its registry: ``context_of``, ``release``.

A ``GroupContext`` owns everything kept between calls on one group: its communicators (built on first use from
the table ``COMMUNICATORS``), the group's facts (size, rank, backend, the device's SMs and name), its answers that
cost a collective, each asked once and kept (the P2P verdict, the plan-cache entries the ranks agreed on, the
measured rates by dtype), the resolved calls by signature, the calls the ranks agreed on and what was logged once.
Lower layers never see it: communicators get a ``CommGroup`` (values), the tuner gets the group, device and dtype
and returns values, which the context keeps. The registry holds a reference to the group itself and checks
identity: a group that was destroyed and re-created gets a fresh context, never another group's rates, verdict or
buffers.
"""

from __future__ import annotations

import atexit
import gc
from typing import Any

import torch
import torch.distributed as dist

from flashoverlap import guards
from flashoverlap.comm.expert.nccl import ExpertNcclCommunicator
from flashoverlap.comm.expert.p2p import ExpertP2PCommunicator
from flashoverlap.comm.expert.reference import ExpertReferenceCommunicator
from flashoverlap.comm.protocol import CommGroup, Communicator
from flashoverlap.comm.tp.nccl import NcclCommunicator
from flashoverlap.comm.tp.p2p import P2PCommunicator
from flashoverlap.comm.tp.reference import ReferenceCommunicator
from flashoverlap.comm.tp.ring_nccl import RingNcclCommunicator
from flashoverlap.comm.tp.sequential import SequentialCommunicator
from flashoverlap.plan import Plan
from flashoverlap.runtime.checks import check_group, refuse_non_group
from flashoverlap.tune import cache, rates

# The dispatch table: (kind of call, path) -> how to build its communicator. "gemm": the tensor-parallel ops
# (``flashoverlap.plan.Plan`` calls); "expert": the all-to-all ops of expert parallelism.
COMMUNICATORS: dict[tuple[str, str], type[Communicator]] = {
    ("gemm", "reference"): ReferenceCommunicator,
    ("gemm", "sequential"): SequentialCommunicator,
    ("gemm", "nccl"): NcclCommunicator,
    ("gemm", "p2p"): P2PCommunicator,
    ("gemm", "ring"): RingNcclCommunicator,
    ("expert", "reference"): ExpertReferenceCommunicator,
    ("expert", "nccl"): ExpertNcclCommunicator,
    ("expert", "p2p"): ExpertP2PCommunicator,
}
# Communicators whose construction allocates or creates streams (refused inside a CUDA-graph capture).
_HOLD_NOTHING = {("gemm", "reference"), ("gemm", "sequential"), ("expert", "reference")}
_UNSET = object()


class GroupContext:
    """The state of one (process group, device); see the module docstring."""

    def __init__(self, process_group: dist.ProcessGroup, device: torch.device) -> None:
        self.process_group = process_group
        self.device = device
        self.group = CommGroup.of(process_group, device)
        self.communicators: dict[tuple[str, str], Communicator] = {}
        self.backend = str(dist.get_backend(process_group))
        self.nccl = "nccl" in self.backend.lower()  # the backend moves CUDA tensors
        self.num_sms = guards.sm_count(device)
        self.gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.rates: dict[torch.dtype, Any] = {}  # tune.rates.Rates by dtype
        self.agreed: dict[tuple, dict] = {}  # tune.cache.exchange_entries' answers, by (gpu, world, generation)
        self.calls: dict[tuple, tuple] = {}  # runtime.calls: a call signature's path and plan
        self.agreed_rows: set[tuple] = set()  # runtime.agreement: the calls the ranks agreed on (``once``)
        self.exchanges = 0  # runtime.agreement: the agreement exchanges so far (in step on every rank; never reset)
        self.arrival_generation: int | None = None  # runtime.agreement: this context's arrival keys' generation
        self.logged: set = set()
        self._p2p_reason: Any = _UNSET

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def name(self) -> str:
        return self.group.name

    def communicator(self, kind: str, path: str) -> Communicator:
        """The communicator for ``(kind, path)``, built on first use (never inside a CUDA-graph capture where it
        allocates)."""
        key = (kind, path)
        comm = self.communicators.get(key)
        if comm is None:
            if key not in _HOLD_NOTHING:
                guards.refuse_inside_capture(f"the first {path}-path call on {self.name} creates its streams and "
                                             "buffers")
            comm = self.communicators[key] = COMMUNICATORS[key](self.group)
        return comm

    def p2p_reason(self) -> str | None:
        """Why the P2P path cannot serve this group (None if it can); collective on first use."""
        if self._p2p_reason is _UNSET:
            from flashoverlap.comm.symmetric import p2p_unavailable_reason

            self._p2p_reason = p2p_unavailable_reason(self.process_group, self.device)
        return self._p2p_reason

    def tuned_plan(self, op: str, shape: tuple[int, int, int], dtype: torch.dtype, nccl_p2p_disabled: bool,
                   path: str) -> Plan | None:
        """The plan cache's plan for a call of ``op`` at ``shape`` (all-gather: the gathered M) in ``dtype`` under
        ``path`` (``"auto"``: `tune plan --path auto`'s): the shape's own, the nearest tuned M's, or None (always
        off CUDA). The entries are rank 0's, exchanged on the group's first ask (per cache generation and NCCL
        transport: collective), then kept."""
        if self.device.type != "cuda":
            return None
        token = (self.gpu, self.world_size, cache.generation(), nccl_p2p_disabled)
        every = self.agreed.get(token)
        if every is None:
            with torch.cuda.device(self.device):  # the exchange's tensors go to this device
                every = self.agreed[token] = cache.exchange_entries(self.process_group, self.gpu, self.world_size,
                                                                    nccl_p2p_disabled)
        key = cache.cache_key(self.gpu, self.world_size, op, path, str(dtype).replace("torch.", ""), nccl_p2p_disabled)
        return cache.select(cache.entries_for(every, key), op, *shape, self.world_size, self.num_sms)

    def rates_of(self, dtype: torch.dtype) -> rates.Rates:
        """The group's measured GEMM and collective rates in ``dtype`` (measured, collectively, on first use)."""
        measured = self.rates.get(dtype)
        if measured is None:
            measured = self.rates[dtype] = rates.measure(self.process_group, self.device, dtype)
        return measured

    def release(self) -> None:
        """Release every communicator's buffers, clones and graphs, and forget what was measured and resolved."""
        for comm in self.communicators.values():
            comm.release()
        self.communicators.clear()
        self.rates.clear()
        self.agreed.clear()
        self.calls.clear()
        self.agreed_rows = set()
        self.logged.clear()
        self._p2p_reason = _UNSET


class Registry:
    """The runtime's registries in one object: the groups' contexts (by group identity and device) and the resolved
    calls (a whole call signature -> what a repeated call runs: ``(communicator, plan, bare)``, so that it skips the
    checks and lookups its first call made). ``release`` empties both; the resolved calls hold contexts'
    communicators, so a communicator put in ``GroupContext.communicators`` by hand is reached only after a
    release."""

    LIMIT = 1024  # resolved signatures (and lanes) kept before the table starts afresh (shapes that never repeat)

    def __init__(self) -> None:
        self.contexts: dict[tuple[int, str, int | None], GroupContext] = {}
        self.resolved: dict[tuple, tuple] = {}
        # The replay lanes (``runtime/calls.execute``): a lane key (a resolved signature and where the call's tensors
        # lie) -> its communicator's ``replayer``. A shortcut past ``resolved``: emptied whenever it is.
        self.lanes: dict[tuple, Any] = {}

    def lookup(self, signature: tuple) -> tuple | None:
        return self.resolved.get(signature)

    def store(self, signature: tuple, entry: tuple) -> None:
        if len(self.resolved) > self.LIMIT:
            self.resolved.clear()
            self.lanes.clear()
        self.resolved[signature] = entry

    def store_lane(self, key: tuple, lane: Any) -> None:
        if len(self.lanes) > self.LIMIT:
            self.lanes.clear()
        self.lanes[key] = lane

    def context(self, process_group: dist.ProcessGroup, device: torch.device) -> GroupContext:
        """The context of ``process_group`` on ``device``, created on first use (identity-checked: a group that
        was destroyed and re-created, whose id may repeat, gets a fresh one)."""
        key = (id(process_group), device.type, device.index)
        context = self.contexts.get(key)
        if context is None or context.process_group is not process_group:
            context = self.contexts[key] = GroupContext(process_group, device)
        return context

    def existing(self, process_group: dist.ProcessGroup | None, device: torch.device) -> GroupContext | None:
        context = self.contexts.get((id(process_group), device.type, device.index))
        return context if context is not None and context.process_group is process_group else None

    def clear(self, group: dist.ProcessGroup | None = None) -> None:
        """Forget every resolved call and lane, and release the contexts of ``group`` (None: of every group)."""
        self.resolved.clear()
        self.lanes.clear()
        for key in [key for key, ctx in self.contexts.items() if group is None or ctx.process_group is group]:
            self.contexts.pop(key).release()

    def forget(self) -> None:
        """Drop every context and resolved call, releasing nothing (no collective: at interpreter exit the peers
        may be gone). What it frees, the process's exit frees. Then collect reference cycles: a layer or an autograd
        graph in a cycle holds its process group until a collection, and one left to the interpreter's final
        teardown ends the process as a reference of ours would (below)."""
        self.resolved.clear()
        self.lanes.clear()
        self.contexts.clear()
        gc.collect()


REGISTRY = Registry()
# At interpreter exit (before torch's own exit handlers, registered earlier), our references to process groups are
# dropped while the interpreter still runs, so that a group the program destroyed is freed then, as it is without
# flashoverlap. Held into the interpreter's final teardown, a gloo group's destruction ended the process with
# std::terminate ("terminate called without an active exception"): 7 of 30 two-rank runs under CPU load of a
# script holding the default group past destroy_process_group, 0 of 30 with the reference dropped at exit; the
# README's example failed so 1 time in 40.
atexit.register(REGISTRY.forget)


def context_of(process_group: dist.ProcessGroup, device: torch.device) -> GroupContext:
    """The context of ``process_group`` on ``device``, created on first use."""
    return REGISTRY.context(process_group, device)


def resolved_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group a call names: ``group``, or for None the default group (None before ``init_process_group``)."""
    return group if group is not None or not dist.is_initialized() else dist.group.WORLD


def group_context(name: str, group: dist.ProcessGroup | None, device: torch.device) -> GroupContext:
    """The context of the group a call of op ``name`` names (None: the default group), checked on its first call on
    ``device`` (``checks.check_group``)."""
    context = existing_context(resolved_group(group), device)
    if context is None:  # the group's first call on this device: check it once
        context = context_of(check_group(name, group), device)
    return context


def existing_context(process_group: dist.ProcessGroup | None, device: torch.device) -> GroupContext | None:
    """The context of ``process_group`` on ``device`` if it has one (identity-checked), else None."""
    return REGISTRY.existing(process_group, device)


def release(group: dist.ProcessGroup | None = None) -> None:
    """Free everything flashoverlap holds for ``group`` (None: every group): the P2P path's symmetric workspace,
    the NCCL path's cloned process groups, replayed CUDA graphs, measured rates and cached plans. Collective where
    the group's communicators hold peer-mapped memory or cloned groups: call it on every rank of the group, after
    its last call (and before ``dist.destroy_process_group``). The next call on the group starts afresh."""
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        return  # dist.new_group's value on a rank outside the group: this rank holds nothing for it
    refuse_non_group("release", group)  # else nothing would match it, and nothing be freed, silently
    REGISTRY.clear(group)
