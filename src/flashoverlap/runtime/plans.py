"""Which path and plan a call takes when the caller gives none (or gives only part): the path rules
(``policy``), the tuned plan from the plan cache (``tune/cache.py``, exchanged once per group), or the default plan
for the shape (``tune/defaults.py``) sized with the machine's measured rates (``tune/rates.py``), kept in the group's
context."""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from flashoverlap import guards, settings
from flashoverlap.comm import scaled
from flashoverlap.plan import Plan
from flashoverlap.runtime import checks, policy
from flashoverlap.runtime.context import GroupContext, context_of
from flashoverlap.tune import cache, fp8, rates
from flashoverlap.tune.defaults import default_plan, sequential_plan

_LOG = logging.getLogger("flashoverlap")


def path_and_plan(spec, shape: tuple[int, int, int], context: GroupContext,
                  nccl_p2p_disabled: bool) -> tuple[str, Plan | None]:
    """The path a call (``calls.GemmSpec``, of ``shape``: all-gather's gathered ``(M, N, K)``) takes, and its plan
    where none is given (None where one is): ``path`` as asked (checked by its rule), the given plan's, or for
    ``"auto"`` the tuned plan's or the rule's; the plan tuned for the shape, else the default."""
    name, op, a, plan, path = spec.name, spec.op, spec.a, spec.plan, spec.path
    m, n, k = shape
    path = policy.explicit_path(name, path, _request(context, a, plan, nccl_p2p_disabled))
    tuned = None
    if path == "auto":
        path, tuned = _automatic_path(op, m, n, k, context, a.dtype, nccl_p2p_disabled)
    if plan is not None:
        return path, None
    if spec.scales is not None and a.device.type == "cuda" and path in policy.FP8_PATHS:
        return path, tuned or _fp8_plan_for(spec, shape, context, path)
    if a.dtype not in policy.HALF_DTYPES or path == "reference" and a.device.type == "cuda":
        return path, sequential_plan(op, m, n, k, context.world_size)
    return path, tuned or _plan_for(op, m, n, k, context, a.dtype, path if path in ("p2p", "ring") else "nccl")


def given_plan_path(name: str, path: str, context: GroupContext, a: torch.Tensor, plan: Plan,
                    nccl_p2p_disabled: bool) -> str:
    """The path of a call given ``plan`` (checked on every call: plans may differ from call to call)."""
    return policy.explicit_path(name, path, _request(context, a, plan, nccl_p2p_disabled))


def _request(context: GroupContext, a: torch.Tensor, plan: Plan | None, nccl_p2p_disabled: bool) -> policy.Request:
    return policy.Request(a.device, a.dtype, context.world_size, plan, context.p2p_reason, nccl_p2p_disabled)


def _automatic_path(op: str, m: int, n: int, k: int, context: GroupContext, dtype: torch.dtype,
                    nccl_p2p_disabled: bool) -> tuple[str, Plan | None]:
    """The path (and the tuned plan, if one decided it) for a path="auto" call; collective on first use."""
    tuned = _cached_plan(op, m, n, k, context, dtype, "auto")
    # Collective (once per group), and only where the answer can matter; every rank takes the same branch.
    reason = None if nccl_p2p_disabled else context.p2p_reason()
    path, why = policy.automatic_path(reason, context.world_size, nccl_p2p_disabled, tuned,
                                      fp8=dtype in checks.FP8_DTYPES)
    if ("auto", op) not in context.logged:
        context.logged.add(("auto", op))
        _LOG.debug("flashoverlap: path='auto' uses %s for %s on %s: %s", path, op, context.name, why)
    return path, tuned if tuned is not None and tuned.path == path else None


@functools.lru_cache(maxsize=512)
def _default_plan(op: str, shape: tuple[int, int, int], world_size: int, num_sms: int, element_size: int,
                  comm_ratio: float | None, path: str = "nccl") -> Plan:
    return default_plan(op, *shape, world_size, num_sms=num_sms, element_size=element_size, comm_ratio=comm_ratio,
                        path=path)


def _cached_plan(op: str, m: int, n: int, k: int, context: GroupContext, dtype: torch.dtype,
                 path: str) -> Plan | None:
    """The plan cache's plan for this call under ``path`` (``"auto"``: `tune plan --path auto`'s): the shape's
    own, the nearest tuned M's, or None. Collective on a group's first lookup (rank 0's entries are agreed)."""
    device = context.device
    gpu = torch.cuda.get_device_name(device)
    transport = settings.current().nccl_p2p_disabled  # read once, as every path rule reads it
    token = (gpu, context.world_size, cache.generation(), transport)
    every = context.agreed.get(token)
    if every is None:
        with torch.cuda.device(device):  # the exchange's tensors go to this device
            every = context.agreed[token] = cache.exchange_entries(context.process_group, gpu, context.world_size,
                                                                   transport)
    key = cache.cache_key(gpu, context.world_size, op, path, str(dtype).replace("torch.", ""), transport)
    return cache.select(cache.entries_for(every, key), op, m, n, k, context.world_size, guards.sm_count(device))


def _plan_for(op: str, m: int, n: int, k: int, context: GroupContext, dtype: torch.dtype, path: str,
              tuned: bool = True) -> Plan:
    world_size = context.world_size
    if context.device.type != "cuda":  # the reference path, or the ring over gloo
        return _default_plan(op, (m, n, k), world_size, guards.DEFAULT_SMS, dtype.itemsize, None,
                             "ring" if path == "ring" else "nccl")
    num_sms = guards.sm_count(context.device)
    cached = _cached_plan(op, m, n, k, context, dtype, path) if tuned else None
    if cached is not None:
        return cached
    if path in ("p2p", "ring"):  # no rates needed: the ring's transfers take no SM
        return _default_plan(op, (m, n, k), world_size, num_sms, dtype.itemsize, None, path)
    measured = _rates(context, dtype)
    moved = m * (k if op == "all_gather" else n) * dtype.itemsize  # all-gather moves A, the others C
    comm_ms = measured.collective_ms(op, moved, world_size)
    # Rounded so that nearby ratios share a cached plan; identical on every rank (the rates are agreed).
    return _default_plan(op, (m, n, k), world_size, num_sms, dtype.itemsize,
                         round(comm_ms / measured.gemm_ms(m, n, k), 2))


def _rates(context: GroupContext, dtype: torch.dtype) -> rates.Rates:
    """The group's measured GEMM and collective rates in ``dtype`` (measured, collectively, on first use)."""
    measured = context.rates.get(dtype)
    if measured is None:
        measured = context.rates[dtype] = rates.measure(context.process_group, context.device, dtype)
    return measured


def _fp8_plan_for(spec, shape: tuple[int, int, int], context: GroupContext, path: str) -> Plan:
    """An fp8 call's plan (``tune/fp8.py``): on NCCL, overlap or not by the collective's time over the fp8 GEMM's
    (the bf16 rates: the GEMM ``FP8_GEMM_SPEEDUP`` times faster, the bytes those the call moves)."""
    m, n, k = shape
    scales = spec.scales
    comm_ratio = None
    if path == "nccl":
        measured = _rates(context, torch.bfloat16)
        if spec.op == "all_gather":
            moved = m * scaled.row_bytes(k, spec.a.dtype, scales)
        else:
            moved = m * n * scales.out_dtype.itemsize
        gemm_ms = measured.gemm_ms(m, n, k) / fp8.FP8_GEMM_SPEEDUP
        comm_ratio = round(measured.collective_ms(spec.op, moved, context.world_size) / gemm_ms, 2)
    # Bands of cuBLAS's block-wise kernel only where it takes every band: they end at tile rows inside each rank block.
    block_rows = m if spec.op == "all_reduce" else m // context.world_size
    cublas_block = block_rows % 4 == 0 and scaled.cublas_takes(spec.a, spec.b, "block")
    return fp8.fp8_plan(spec.op, m, n, k, context.world_size, scales.mode, path=path,
                        num_sms=guards.sm_count(context.device), comm_ratio=comm_ratio,
                        out_size=scales.out_dtype.itemsize, cublas_block=cublas_block)


def plan_for(op: str, shape: tuple[int, int, int], group: dist.ProcessGroup, device: torch.device,
             dtype: torch.dtype, path: str = "nccl", tuned: bool = True) -> Plan:
    """The plan a call of ``op`` at ``shape`` ``(M, N, K)`` (all-gather: the gathered M) uses when none is given:
    on CUDA, the tuned plan from the plan cache (``tune/cache.py``: this shape's, or the nearest tuned M's) where
    there is one (and ``tuned``); otherwise the default plan. For that, the first NCCL-path call for a group
    measures the machine's GEMM and all-reduce rates (collectively) to choose between overlap and sequential (the
    P2P path needs no rates: its transfers take no SM). ``tuned=False``: the default plan regardless of the cache
    (the benchmark's hand-set comparison)."""
    return _plan_for(op, *shape, context_of(group, device), dtype, path, tuned)
