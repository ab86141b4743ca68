"""What every op does before launching: argument checks, the group, and the plan (given, or the default for the
shape, chosen from the machine's rates). Repeated calls of one shape skip the group checks and the plan lookup:
host time before the first launch is GPU idle time when the GPU has nothing queued."""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.distributed as dist

from flashoverlap.comm.symmetric import p2p_excluded, p2p_unavailable_reason
from flashoverlap.ops._checks import check_group, check_operands, choose_path
from flashoverlap.plan import Plan, default_plan
from flashoverlap.tune import cache, rates

_LOG = logging.getLogger("flashoverlap")
# (op, group, device, dtype, shape, path, automatic?, default plan?) -> (group as given, group, world size,
# default plan, path)
_SEEN: dict[tuple, tuple] = {}


@functools.lru_cache(maxsize=512)
def _default_plan(op: str, m: int, n: int, k: int, world_size: int, num_sms: int, element_size: int,
                  comm_ratio: float | None, path: str = "nccl") -> Plan:
    return default_plan(op, m, n, k, world_size, num_sms=num_sms, element_size=element_size, comm_ratio=comm_ratio,
                        path=path)


def _cached_plan(op: str, m: int, n: int, k: int, group: dist.ProcessGroup, device: torch.device,
                 dtype: torch.dtype, path: str) -> Plan | None:
    """The plan cache's plan for this call under ``path`` (``"auto"``: `tune plan --path auto`'s): the shape's
    own, the nearest tuned M's, or None. Collective on a group's first lookup (rank 0's entries are agreed)."""
    world_size = dist.get_world_size(group)
    key = cache.cache_key(torch.cuda.get_device_name(device), world_size, op, path, str(dtype).replace("torch.", ""))
    with torch.cuda.device(device):  # the exchange's tensors go to this device
        entries = cache.agreed_entries(group, key)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return cache.select(entries, op, m, n, k, world_size, num_sms)


def plan_for(op: str, m: int, n: int, k: int, group: dist.ProcessGroup, device: torch.device,
             dtype: torch.dtype, path: str = "nccl", tuned: bool = True) -> Plan:
    """The plan a call of ``op`` at this shape uses when none is given: on CUDA, the tuned plan from the plan cache
    (``tune/cache.py``: this shape's, or the nearest tuned M's) where there is one (and ``tuned``); otherwise the
    default plan. For that, the first call for a group measures the machine's GEMM and all-reduce rates
    (collectively) to choose between overlap and sequential (the P2P path needs no rates: its transfers take no
    SM). ``tuned=False``: the default plan regardless of the cache (the benchmark's hand-set comparison)."""
    world_size = dist.get_world_size(group)
    element_size = torch.empty((), dtype=dtype).element_size()
    if device.type != "cuda":
        return _default_plan(op, m, n, k, world_size, 132, element_size, None)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    cached = _cached_plan(op, m, n, k, group, device, dtype, path) if tuned else None
    if cached is not None:
        return cached
    if path == "p2p":
        return _default_plan(op, m, n, k, world_size, num_sms, element_size, None, "p2p")
    measured = rates.measure(group, device, dtype)
    moved = m * (k if op == "all_gather" else n) * element_size  # all-gather moves A, the others C
    comm_ms = measured.collective_ms(op, moved, world_size)
    # Rounded so that nearby ratios share a cached plan; identical on every rank (the rates are agreed).
    return _default_plan(op, m, n, k, world_size, num_sms, element_size, round(comm_ms / measured.gemm_ms(m, n, k), 2))


# The ops for which path="auto" takes P2P where it applies, when no tuned plan says otherwise: those where the
# P2P path was measured faster than the NCCL path's default and than sequential at every nvlink grid shape
# (benchmarks/results/h200x2-nvlink.json, 71a39d5: all-gather E 0.47-0.67 against ~0). For all-reduce and
# reduce-scatter it lost to the NCCL path at some grid shapes and to sequential at the small ones, so "auto"
# keeps NCCL there. `tune plan --path auto` replaces this rule by measurement, shape by shape.
AUTO_P2P_OPS = frozenset({"all_gather"})
_AUTO_LOGGED: set[tuple[int, str]] = set()


def automatic_path(op: str, p2p_reason: str | None, world_size: int, nccl_p2p_disabled: bool = False,
                   tuned: Plan | None = None) -> tuple[str, str]:
    """What path="auto" picks for ``op`` on a group, and why (pure: the same inputs on every rank give the same
    answer): the path of ``tuned`` (the plan `tune plan --path auto` cached for this shape) where it applies,
    else P2P for ``AUTO_P2P_OPS`` where it applies, else NCCL. Explicit ``path="p2p"`` works regardless."""
    excluded = p2p_excluded(p2p_reason, world_size, nccl_p2p_disabled)
    if tuned is not None and (tuned.path == "nccl" or excluded is None):
        return tuned.path, f"the tuned plan for this shape (`tune plan --path auto`) is on {tuned.path}"
    if op not in AUTO_P2P_OPS:
        return "nccl", f"P2P is not chosen automatically for {op}: it was not faster than the NCCL path there"
    if excluded is not None:
        return "nccl", excluded
    return "p2p", "every rank on one node with peer access between all GPUs"


def _automatic_path(op: str, m: int, n: int, k: int, group: dist.ProcessGroup, device: torch.device,
                    dtype: torch.dtype) -> tuple[str, Plan | None]:
    """The path (and the tuned plan, if one decided it) for a path="auto" call; collective on first use."""
    world_size = dist.get_world_size(group)
    disabled = os.environ.get("NCCL_P2P_DISABLE") == "1"
    tuned = _cached_plan(op, m, n, k, group, device, dtype, "auto")
    # Collective (once per group), and only where the answer can matter; every rank takes the same branch.
    wanted = not disabled and (op in AUTO_P2P_OPS or (tuned is not None and tuned.path == "p2p"))
    reason = p2p_unavailable_reason(group, device) if wanted else None
    path, why = automatic_path(op, reason, world_size, disabled, tuned)
    if (id(group), op) not in _AUTO_LOGGED:
        _AUTO_LOGGED.add((id(group), op))
        _LOG.debug("flashoverlap: path='auto' uses %s for %s on this group of %d ranks: %s", path, op, world_size,
                   why)
    return path, tuned if tuned is not None and tuned.path == path else None


def prepare_call(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                 plan: Plan | None, path: str) -> tuple[str, dist.ProcessGroup, Plan]:
    """Check a call of op ``name`` (plan kind ``op``) and return its path, group and plan."""
    m, n, k = check_operands(name, a, b)  # for all-gather, m is this rank's shard
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"{name}: plan must be a flashoverlap.Plan, got {type(plan).__name__}")
    automatic = path == "auto" and plan is None and a.device.type == "cuda"
    path = choose_path(name, path, a.device, None if plan is None else plan.path)
    resolved = group if group is not None or not dist.is_initialized() else dist.group.WORLD
    key = (op, id(resolved), a.device, a.dtype, m, n, k, path, automatic, plan is None)
    seen = _SEEN.get(key)
    if seen is not None and seen[0] is resolved:
        group, world_size, default, path = seen[1], seen[2], seen[3], seen[4]
        m = m * world_size if op == "all_gather" else m
    else:
        group = check_group(name, group, a.device)
        world_size = dist.get_world_size(group)
        if op == "all_gather":
            m *= world_size  # a is this rank's shard: the plan is for the gathered M
        if op == "reduce_scatter" and m % world_size:
            raise ValueError(
                f"{name}: a has M = {m} rows, which the {world_size} ranks of group cannot share evenly: "
                "reduce-scatter gives each rank M / world_size rows (pad M to a multiple of the world size)"
            )
        tuned = None
        if automatic:
            path, tuned = _automatic_path(op, m, n, k, group, a.device, a.dtype)
        elif path == "p2p":
            reason = p2p_unavailable_reason(group, a.device)
            if reason is not None:
                raise ValueError(f"{name}: path='p2p' cannot apply to this group: {reason}; use path='nccl'")
        plan_path = "p2p" if path == "p2p" else "nccl"
        default = None if plan is not None else tuned or plan_for(op, m, n, k, group, a.device, a.dtype, plan_path)
        if len(_SEEN) > 1024:
            _SEEN.clear()
        _SEEN[key] = (resolved, group, world_size, default, path)
    plan = default if plan is None else plan
    if (plan.op, plan.m, plan.n, plan.k, plan.world_size) != (op, m, n, k, world_size):
        raise ValueError(
            f"{name}: plan is for {plan.op} (m, n, k) = {(plan.m, plan.n, plan.k)} over {plan.world_size} ranks, "
            f"but this call is {op} {(m, n, k)} over {world_size} ranks"
        )
    return path, group, plan
