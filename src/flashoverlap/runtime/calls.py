"""One call of a tensor-parallel op, from the public op to its communicator: ``execute`` checks the operands and
the group, resolves the path (``policy``) and the plan (given, tuned, or the default for the shape), and runs the
call through the communicator the table names (``context.COMMUNICATORS``). A repeated call of one signature skips
the group checks and the plan lookup: host time before the first launch is GPU idle time when the GPU has nothing
queued. In debug mode (``FLASHOVERLAP_DEBUG_TIMEOUT``) the ranks first check that they agree on the call.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import zlib

import torch
import torch.distributed as dist

from flashoverlap import guards
from flashoverlap.comm.collectives import all_gather_into_tensor
from flashoverlap.comm.protocol import Call, Hook
from flashoverlap.plan import OPS, Plan
from flashoverlap.runtime import policy, settings
from flashoverlap.runtime.checks import check_group, check_operands
from flashoverlap.runtime.context import GroupContext, context_of, existing_context
from flashoverlap.tune import cache, rates
from flashoverlap.tune.defaults import default_plan, sequential_plan

_LOG = logging.getLogger("flashoverlap")


def execute(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
            plan: Plan | None, path: str, return_gathered: bool = False,
            hook: Hook | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every tensor-parallel op's body: check, resolve, run. Returns the result, and all-gather's gathered input
    where ``return_gathered``. ``hook()``: independent work for the caller's stream that the call may overlap with
    its communication (``comm/protocol.Hook``)."""
    env = settings.current()
    if env.timeout is not None:  # before any collective of the call (plan lookups may run some)
        check_agreement(name, op, a, b, group, plan, path)
    path, context, plan = resolve(name, op, a, b, group, plan, path, env.nccl_p2p_disabled)
    capturing = guards.capturing()
    call = Call(name, plan, a, b, return_gathered, hook, None if capturing else env.timeout,
                env.replay and not capturing)
    communicator = context.communicator("gemm", "sequential" if plan.sequential and path != "reference" else path)
    if a.device.type != "cuda" or a.device.index == torch.cuda.current_device():
        return communicator.run(call)
    with torch.cuda.device(a.device):  # the communicator's streams and allocations on the tensors' device
        return communicator.run(call)


def resolve(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
            plan: Plan | None, path: str, nccl_p2p_disabled: bool = False) -> tuple[str, GroupContext, Plan]:
    """Check a call of op ``name`` (plan kind ``op``) and return its path, group context and plan."""
    m, n, k = check_operands(name, a, b)  # for all-gather, m is this rank's shard
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"{name}: plan must be a flashoverlap.Plan, got {type(plan).__name__}")
    resolved = group if group is not None or not dist.is_initialized() else dist.group.WORLD
    context = existing_context(resolved, a.device)
    if context is None:  # the group's first call on this device: check it once
        context = context_of(check_group(name, group, a.device), a.device)
    key = (op, a.dtype, m, n, k, path, plan is None)
    seen = context.calls.get(key)
    world_size = context.world_size
    if op == "all_gather":
        m *= world_size  # a is this rank's shard: the plan is for the gathered M
    if seen is not None:
        default, path = seen
        if plan is not None:  # a given plan is checked against the path on every call (plans may differ)
            path = policy.explicit_path(name, key[5], _request(context, a, plan, nccl_p2p_disabled))
    else:
        if op == "reduce_scatter" and m % world_size:
            raise ValueError(
                f"{name}: a has M = {m} rows, which the {world_size} ranks of group cannot share evenly: "
                "reduce-scatter gives each rank M / world_size rows (pad M to a multiple of the world size)"
            )
        request = _request(context, a, plan, nccl_p2p_disabled)
        path = policy.explicit_path(name, path, request)
        tuned = None
        if path == "auto":
            path, tuned = _automatic_path(op, m, n, k, context, a.dtype, nccl_p2p_disabled)
        if plan is not None:
            default = None
        elif a.dtype not in policy.HALF_DTYPES or path == "reference" and a.device.type == "cuda":
            default = sequential_plan(op, m, n, k, world_size)
        else:
            default = tuned or _plan_for(op, m, n, k, context, a.dtype, path if path in ("p2p", "ring") else "nccl")
        if len(context.calls) > 1024:
            context.calls.clear()
        context.calls[key] = (default, path)
    plan = default if plan is None else plan
    if (plan.op, plan.m, plan.n, plan.k, plan.world_size) != (op, m, n, k, world_size):
        raise ValueError(
            f"{name}: plan is for {plan.op} (m, n, k) = {(plan.m, plan.n, plan.k)} over {plan.world_size} ranks, "
            f"but this call is {op} {(m, n, k)} over {world_size} ranks"
        )
    return path, context, plan


def _request(context: GroupContext, a: torch.Tensor, plan: Plan | None, nccl_p2p_disabled: bool) -> policy.Request:
    return policy.Request(a.device, a.dtype, context.world_size, plan, context.p2p_reason, nccl_p2p_disabled)


def _automatic_path(op: str, m: int, n: int, k: int, context: GroupContext, dtype: torch.dtype,
                    nccl_p2p_disabled: bool) -> tuple[str, Plan | None]:
    """The path (and the tuned plan, if one decided it) for a path="auto" call; collective on first use."""
    tuned = _cached_plan(op, m, n, k, context, dtype, "auto")
    # Collective (once per group), and only where the answer can matter; every rank takes the same branch.
    reason = None if nccl_p2p_disabled else context.p2p_reason()
    path, why = policy.automatic_path(reason, context.world_size, nccl_p2p_disabled, tuned)
    if ("auto", op) not in context.logged:
        context.logged.add(("auto", op))
        _LOG.debug("flashoverlap: path='auto' uses %s for %s on %s: %s", path, op, context.name, why)
    return path, tuned if tuned is not None and tuned.path == path else None


@functools.lru_cache(maxsize=512)
def _default_plan(op: str, m: int, n: int, k: int, world_size: int, num_sms: int, element_size: int,
                  comm_ratio: float | None, path: str = "nccl") -> Plan:
    return default_plan(op, m, n, k, world_size, num_sms=num_sms, element_size=element_size, comm_ratio=comm_ratio,
                        path=path)


def _cached_plan(op: str, m: int, n: int, k: int, context: GroupContext, dtype: torch.dtype,
                 path: str) -> Plan | None:
    """The plan cache's plan for this call under ``path`` (``"auto"``: `tune plan --path auto`'s): the shape's
    own, the nearest tuned M's, or None. Collective on a group's first lookup (rank 0's entries are agreed)."""
    device = context.device
    gpu = torch.cuda.get_device_name(device)
    token = (gpu, context.world_size, cache.generation())
    every = context.agreed.get(token)
    if every is None:
        with torch.cuda.device(device):  # the exchange's tensors go to this device
            every = context.agreed[token] = cache.exchange_entries(context.process_group, gpu, context.world_size)
    key = cache.cache_key(gpu, context.world_size, op, path, str(dtype).replace("torch.", ""))
    return cache.select(cache.entries_for(every, key), op, m, n, k, context.world_size, guards.sm_count(device))


def _plan_for(op: str, m: int, n: int, k: int, context: GroupContext, dtype: torch.dtype, path: str,
              tuned: bool = True) -> Plan:
    world_size = context.world_size
    if context.device.type != "cuda":  # the reference path, or the ring over gloo
        return _default_plan(op, m, n, k, world_size, guards.DEFAULT_SMS, dtype.itemsize, None,
                             "ring" if path == "ring" else "nccl")
    num_sms = guards.sm_count(context.device)
    cached = _cached_plan(op, m, n, k, context, dtype, path) if tuned else None
    if cached is not None:
        return cached
    if path in ("p2p", "ring"):  # no rates needed: the ring's transfers take no SM
        return _default_plan(op, m, n, k, world_size, num_sms, dtype.itemsize, None, path)
    measured = context.rates.get(dtype)
    if measured is None:
        measured = context.rates[dtype] = rates.measure(context.process_group, context.device, dtype)
    moved = m * (k if op == "all_gather" else n) * dtype.itemsize  # all-gather moves A, the others C
    comm_ms = measured.collective_ms(op, moved, world_size)
    # Rounded so that nearby ratios share a cached plan; identical on every rank (the rates are agreed).
    return _default_plan(op, m, n, k, world_size, num_sms, dtype.itemsize,
                         round(comm_ms / measured.gemm_ms(m, n, k), 2))


def plan_for(op: str, m: int, n: int, k: int, group: dist.ProcessGroup, device: torch.device,
             dtype: torch.dtype, path: str = "nccl", tuned: bool = True) -> Plan:
    """The plan a call of ``op`` at this shape uses when none is given: on CUDA, the tuned plan from the plan cache
    (``tune/cache.py``: this shape's, or the nearest tuned M's) where there is one (and ``tuned``); otherwise the
    default plan. For that, the first NCCL-path call for a group measures the machine's GEMM and all-reduce rates
    (collectively) to choose between overlap and sequential (the P2P path needs no rates: its transfers take no
    SM). ``tuned=False``: the default plan regardless of the cache (the benchmark's hand-set comparison)."""
    return _plan_for(op, m, n, k, context_of(group, device), dtype, path, tuned)


_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def check_agreement(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                    plan: Plan | None, path: str) -> None:
    """Debug mode (``FLASHOVERLAP_DEBUG_TIMEOUT`` set), before anything else of the call: every rank of the group
    calls the same op with the same shapes, dtype, path and plan, or every rank raises before any collective or
    launch (one small all-gather; a first call's plan lookup can itself be collective). A rank that never comes to
    the call (it skipped it, or raised before it) makes the others raise when the timeout passes, naming the rank,
    the op and the group, instead of hanging; the group is unusable after that (its collective is still pending):
    destroy it."""
    m, n, k = check_operands(name, a, b)
    if path not in policy.CALL_PATHS:
        return  # resolve raises the clear error
    context = existing_context(group if group is not None or not dist.is_initialized() else dist.group.WORLD,
                               a.device) or context_of(check_group(name, group, a.device), a.device)
    if guards.capturing():
        return
    mine = [OPS.index(op), m, n, k, _DTYPE_CODES[a.dtype], policy.CALL_PATHS.index(path),
            0 if plan is None else _digest(plan)]
    device = context.device if context.device.type == "cuda" else torch.device("cpu")
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    everyone = torch.empty(context.world_size * len(mine), dtype=torch.int64, device=device)
    work = all_gather_into_tensor(everyone, local, context.process_group, async_op=True)
    timeout = settings.current().timeout
    guards.poll_until(work.is_completed, time.monotonic() + timeout, lambda: (
        f"flashoverlap: rank {context.rank}: {name} on {context.name} waited more than {timeout:g} s "
        "(FLASHOVERLAP_DEBUG_TIMEOUT) for the other ranks to reach the call: a rank skipped it, raised "
        "before it, or is stuck elsewhere; the group is unusable now"))
    work.wait()
    rows = everyone.view(context.world_size, len(mine)).tolist()
    for rank, row in enumerate(rows):
        if row != rows[0]:
            fields = ("op", "M", "N", "K", "dtype", "path", "plan")  # M: all-gather's shard rows
            differ = [f for f, x, y in zip(fields, row, rows[0]) if x != y]
            raise ValueError(
                f"{name}: rank {context.rank} of {context.name}: the ranks disagree on {', '.join(differ)} (rank "
                f"{rank} differs from rank 0): every rank must call the op with the same shapes, dtype and path"
            )


@functools.lru_cache(maxsize=256)
def _digest(plan: Plan) -> int:
    """The same number for the same plan on every rank (``hash`` of a str is salted per process)."""
    return zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode())


