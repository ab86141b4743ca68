"""``gemm_all_reduce(a, b)``: ``c = a @ b; dist.all_reduce(c)``, with the all-reduce of each finished band of rows
overlapped with the rest of the GEMM.

Row-parallel linear layer (K sharded): rank r holds ``a_r: [M, K/W]`` (its slice of the activations' features)
and ``b_r: [K/W, N]`` (its rows of the weight, or ``w_r.t()`` of an ``nn.Linear`` weight ``w_r: [N, K/W]``); every
rank gets ``c = sum_r a_r @ b_r: [M, N]``, row-major, in the input dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from flashoverlap.comm import nccl, reference
from flashoverlap.kernels.gemm import gemm
from flashoverlap.ops._checks import check_group, check_operands, choose_path
from flashoverlap.plan import Plan, default_plan
from flashoverlap.tune import rates

OP = "gemm_all_reduce"
# (group, device, dtype, shape, default plan?) -> (group as given, group, world size, default plan)
_SEEN: dict[tuple, tuple] = {}


@functools.lru_cache(maxsize=256)
def _default_plan(m: int, n: int, k: int, world_size: int, num_sms: int, element_size: int,
                  comm_ratio: float | None) -> Plan:
    return default_plan("all_reduce", m, n, k, world_size, num_sms=num_sms, element_size=element_size,
                        comm_ratio=comm_ratio)


def plan_for(m: int, n: int, k: int, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> Plan:
    """The plan an all-reduce call of this shape uses when none is given. On CUDA the first call for a group
    measures the machine's GEMM and all-reduce rates (collectively) to choose between overlap and sequential."""
    world_size = dist.get_world_size(group)
    element_size = torch.empty((), dtype=dtype).element_size()
    if device.type != "cuda":
        return _default_plan(m, n, k, world_size, 132, element_size, None)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    measured = rates.measure(group, device, dtype)
    ratio = measured.all_reduce_ms(m * n * element_size, world_size) / measured.gemm_ms(m, n, k)
    # Rounded so that nearby ratios share a cached plan; identical on every rank (the rates are agreed).
    return _default_plan(m, n, k, world_size, num_sms, element_size, round(ratio, 2))


def gemm_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    plan: Plan | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """``a @ b`` summed over ``group``, as ``c = a @ b; dist.all_reduce(c, group=group)`` would return it.

    Args:
        a: ``[M, K]`` bf16 or fp16, this rank's K-shard of the input.
        b: ``[K, N]``, same dtype and device; may be the transposed view ``w.t()`` of an ``[N, K]`` weight.
        group: the process group (default: the world). CUDA tensors need an NCCL group.
        plan: a :class:`flashoverlap.Plan` for this shape and world size (default: the library's plan for it).
        path: ``"auto"`` (NCCL overlap for CUDA tensors, the reference for CPU ones), ``"nccl"`` or
            ``"reference"`` (group by group, nothing overlapped; any backend).

    Returns:
        ``[M, N]`` row-major, the input dtype, identical on every rank of ``group``.
    """
    m, n, k = check_operands(OP, a, b)
    path = choose_path(OP, path, a.device)
    # Host time before the first launch is GPU idle time for a call that starts on an idle GPU: a call seen
    # before skips the group checks and the plan lookup.
    resolved = group if group is not None or not dist.is_initialized() else dist.group.WORLD
    key = (id(resolved), a.device, a.dtype, m, n, k, plan is None)
    seen = _SEEN.get(key)
    if seen is not None and seen[0] is resolved:
        group, world_size, default = seen[1], seen[2], seen[3]
        plan = default if plan is None else plan
    else:
        group = check_group(OP, group, a.device)
        world_size = dist.get_world_size(group)
        default = plan_for(m, n, k, group, a.device, a.dtype) if plan is None else None
        if len(_SEEN) > 1024:
            _SEEN.clear()
        _SEEN[key] = (resolved, group, world_size, default)
        plan = default if plan is None else plan
    if not isinstance(plan, Plan):
        raise TypeError(f"{OP}: plan must be a flashoverlap.Plan, got {type(plan).__name__}")
    elif (plan.op, plan.m, plan.n, plan.k, plan.world_size) != ("all_reduce", m, n, k, world_size):
        raise ValueError(
            f"{OP}: plan is for {plan.op} (m, n, k) = {(plan.m, plan.n, plan.k)} over {plan.world_size} ranks, "
            f"but this call is all_reduce {(m, n, k)} over {world_size} ranks"
        )

    if path == "reference":
        return reference.gemm_all_reduce(a, b, plan, group)
    with torch.cuda.device(a.device):
        if plan.sequential:
            c = torch.matmul(a, b)
            dist.all_reduce(c, group=group)
            return c
        comm = nccl.communicator(group, a.device)
        comm.prepare(plan, a.dtype)
        c = gemm(a, b, plan, counters=comm.counters)
        comm.all_reduce(c, plan)
        return c
