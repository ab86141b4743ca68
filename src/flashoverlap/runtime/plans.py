"""The path and plan of a call that gives none (or gives only part): the call's facts gathered once, here
(``call_facts``: the call's device, dtype, shape and scaling; the group's size, backend and SMs; its P2P verdict,
plan-cache entries and measured rates, which the group's context asks once and keeps), and the decision taken in
one pass by the policy (``runtime/policy.decide``, with the plans of ``tune/``)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from flashoverlap import settings
from flashoverlap.comm import scaled
from flashoverlap.plan import Plan
from flashoverlap.runtime import policy
from flashoverlap.runtime.context import GroupContext, context_of

_LOG = logging.getLogger("flashoverlap")


def path_and_plan(spec, shape: tuple[int, int, int], context: GroupContext,
                  nccl_p2p_disabled: bool) -> tuple[str, Plan | None]:
    """The path a call (``calls.GemmSpec``, of ``shape``: all-gather's gathered ``(M, N, K)``) takes, and its plan
    where none is given (None where one is): ``policy.decide`` on the call's facts."""
    path, plan, why = policy.decide(spec.name, spec.path, call_facts(spec, shape, context, nccl_p2p_disabled))
    if why is not None:
        log_auto_choice(context, spec.op, path, why)
    return path, plan


def log_auto_choice(context: GroupContext, what: str, path: str, why: str) -> None:
    """``path="auto"``'s choice for ``what`` (an op, or the expert ops) and why, at debug level (logger
    ``flashoverlap``), once per group's context (again after ``release``, which forgets what was logged)."""
    if ("auto", what) not in context.logged:
        context.logged.add(("auto", what))
        _LOG.debug("flashoverlap: path='auto' uses %s for %s on %s: %s", path, what, context.name, why)


def given_plan_path(name: str, path: str, context: GroupContext, a: torch.Tensor, plan: Plan,
                    nccl_p2p_disabled: bool) -> str:
    """The path of a call given ``plan`` (checked on every call: plans may differ from call to call)."""
    return policy.explicit_path(name, path, _request(context, a.device, a.dtype, plan, nccl_p2p_disabled))


def call_facts(spec, shape: tuple[int, int, int], context: GroupContext, nccl_p2p_disabled: bool) -> policy.Facts:
    """What ``policy.decide`` looks at for a call (``calls.GemmSpec`` of ``shape``), gathered once; the group's
    answers that cost a collective are handed over as the context's questions, asked only where a rule needs them."""
    a, scales = spec.a, spec.scales
    fp8 = None
    if scales is not None:
        fp8 = policy.Fp8Call(scales.mode, scales.out_dtype.itemsize, scaled.row_bytes(shape[2], a.dtype, scales),
                             scaled.cublas_takes(a, spec.b, "block"))
    return _facts(spec.op, shape, context, _request(context, a.device, a.dtype, spec.plan, nccl_p2p_disabled), fp8)


def _request(context: GroupContext, device: torch.device, dtype: torch.dtype, plan: Plan | None,
             nccl_p2p_disabled: bool) -> policy.Request:
    return policy.Request(device, dtype, context.world_size, plan, context.p2p_reason, nccl_p2p_disabled,
                          context.backend)


def _facts(op: str, shape: tuple[int, int, int], context: GroupContext, request: policy.Request,
           fp8: policy.Fp8Call | None = None) -> policy.Facts:
    tuned = functools.partial(context.tuned_plan, op, shape, request.dtype, request.nccl_p2p_disabled)
    return policy.Facts(op, shape, request, context.num_sms, tuned, context.rates_of, fp8)


def plan_for(op: str, shape: tuple[int, int, int], group: dist.ProcessGroup, device: torch.device,
             dtype: torch.dtype, path: str = "nccl", tuned: bool = True) -> Plan:
    """The plan a call of ``op`` at ``shape`` ``(M, N, K)`` (all-gather: the gathered M) uses when none is given:
    on CUDA, the tuned plan from the plan cache (``tune/cache.py``: this shape's, or the nearest tuned M's) where
    there is one (and ``tuned``); otherwise the default plan. For that, the first NCCL-path call for a group
    measures the machine's GEMM and all-reduce rates (collectively) to choose between overlap and sequential (the
    P2P path needs no rates: its transfers take no SM). ``tuned=False``: the default plan regardless of the cache
    (the benchmark's hand-set comparison)."""
    context = context_of(group, device)
    request = _request(context, device, dtype, None, settings.current().nccl_p2p_disabled)
    return policy.plan_of(path, _facts(op, shape, context, request), tuned)
