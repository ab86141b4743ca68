"""One call of a tensor-parallel op, from the public op to its communicator: ``execute`` checks the operands and
the group, resolves the path and the plan (``plans``: given, tuned, or the default for the shape), and runs the call
through the communicator the table names (``context.COMMUNICATORS``). A repeated call of one signature skips the
checks, the plan lookup and the communicator lookup: host time before the first launch is GPU idle time when the GPU
has nothing queued. In debug mode (``FLASHOVERLAP_DEBUG_TIMEOUT``) the ranks first check that they agree on the call
(``agreement``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap import guards
from flashoverlap.comm.protocol import Call, Hook
from flashoverlap.plan import Plan
from flashoverlap.runtime import agreement, plans, settings
from flashoverlap.runtime.checks import check_operands
from flashoverlap.runtime.context import RESOLVED, GroupContext, group_context


def execute(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
            plan: Plan | None, path: str, return_gathered: bool = False,
            hook: Hook | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every tensor-parallel op's body: check, resolve, run. Returns the result, and all-gather's gathered input
    where ``return_gathered``. ``hook()``: independent work for the caller's stream that the call may overlap with
    its communication (``comm/protocol.Hook``).

    A call whose whole signature (plain tensors' shapes, dtypes and devices, the group object, plan, path) was run
    before takes its communicator and plan from one lookup (``context.RESOLVED``): its operands pass the same
    checks, its group is the same object. Written for host time: this body is what a repeated call costs."""
    env = settings.current()
    if env.timeout is not None:  # before any collective of the call (plan lookups may run some)
        agreement.check(name, op, a, b, group, plan, path, env.timeout)
    entry = signature = None
    if type(a) is torch.Tensor and type(b) is torch.Tensor and (plan is None or type(plan) is Plan):
        signature = (op, name, a.shape, b.shape, a.dtype, b.dtype, a.device, b.device,
                     group if group is not None or not dist.is_initialized() else dist.group.WORLD, plan, path,
                     env.nccl_p2p_disabled)
        entry = RESOLVED.get(signature)
    if entry is None:
        path, context, plan = resolve(name, op, a, b, group, plan, path, env.nccl_p2p_disabled)
        # The sequential plan waits on nothing and is never replayed (outside the reference, which runs any plan).
        bare = plan.sequential and path != "reference"
        entry = (context.communicator("gemm", "sequential" if bare else path), plan, bare)
        if signature is not None:
            if len(RESOLVED) > 1024:
                RESOLVED.clear()
            RESOLVED[signature] = entry
    communicator, plan, bare = entry
    if bare:  # no capture query, no deadline, no replay verdict (host time, the decode case)
        call = Call(name, plan, a, b, return_gathered, hook)
        if hook is None:  # it names a's device in all it allocates, and has no stream of its own: no device check
            return communicator.run(call)
    else:
        capturing = guards.capturing(a)
        call = Call(name, plan, a, b, return_gathered, hook, None if capturing else env.timeout,
                    env.replay and not capturing)
    if guards.on_current_device(a):
        return communicator.run(call)
    with torch.cuda.device(a.device):  # the communicator's streams and allocations on the tensors' device
        return communicator.run(call)


def resolve(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
            plan: Plan | None, path: str, nccl_p2p_disabled: bool = False) -> tuple[str, GroupContext, Plan]:
    """Check a call of op ``name`` (plan kind ``op``) and return its path, group context and plan (a first call's
    work: ``execute`` runs a repeated call from ``context.RESOLVED`` without it)."""
    m, n, k = check_operands(name, a, b)  # for all-gather, m is this rank's shard
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"{name}: plan must be a flashoverlap.Plan, got {type(plan).__name__}")
    context = group_context(name, group, a.device)
    key = (op, a.dtype, m, n, k, path, plan is None)
    seen = context.calls.get(key)
    world_size = context.world_size
    if op == "all_gather":
        m *= world_size  # a is this rank's shard: the plan is for the gathered M
    if seen is not None:
        default, path = seen
        if plan is not None:  # a given plan is checked against the path on every call (plans may differ)
            path = plans.given_plan_path(name, key[5], context, a, plan, nccl_p2p_disabled)
    else:
        if op == "reduce_scatter" and m % world_size:
            raise ValueError(
                f"{name}: a has M = {m} rows, which the {world_size} ranks of group cannot share evenly: "
                "reduce-scatter gives each rank M / world_size rows (pad M to a multiple of the world size)"
            )
        path, default = plans.path_and_plan(name, op, m, n, k, context, a, plan, path, nccl_p2p_disabled)
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
