"""``gemm_all_reduce(a, b)``: ``c = a @ b; dist.all_reduce(c)``, with the all-reduce of each finished band of rows
overlapped with the rest of the GEMM.

Row-parallel linear layer (K sharded): rank r holds ``a_r: [M, K/W]`` (its slice of the activations' features)
and ``b_r: [K/W, N]`` (its rows of the weight, or ``w_r.t()`` of an ``nn.Linear`` weight ``w_r: [N, K/W]``); every
rank gets ``c = sum_r a_r @ b_r: [M, N]``, row-major, in the input dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm import nccl, p2p, reference
from flashoverlap.kernels.gemm import gemm
from flashoverlap.ops._bands import produce
from flashoverlap.ops._common import plan_for as _plan_for
from flashoverlap.ops._common import prepare_call
from flashoverlap.plan import Plan

OP = "gemm_all_reduce"


def plan_for(m: int, n: int, k: int, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> Plan:
    """The plan an all-reduce call of this shape uses when none is given."""
    return _plan_for("all_reduce", m, n, k, group, device, dtype)


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
        path: ``"auto"`` (NCCL overlap for CUDA tensors, or the given plan's path; the reference for CPU ones),
            ``"nccl"``, ``"p2p"`` (copy engines over symmetric memory, one node) or ``"reference"`` (group by
            group, nothing overlapped; any backend).

    Returns:
        ``[M, N]`` row-major, the input dtype, identical on every rank of ``group``.
    """
    path, group, plan = prepare_call(OP, "all_reduce", a, b, group, plan, path)
    if path == "reference":
        return reference.gemm_all_reduce(a, b, plan, group)
    with torch.cuda.device(a.device):
        if plan.sequential:
            c = torch.matmul(a, b)
            dist.all_reduce(c, group=group)
            return c
        if path == "p2p":
            p2p_comm = p2p.communicator(group, a.device)
            workspace = p2p_comm.prepare_reduction(plan, a.dtype)
            gemm(a, b, plan, out=workspace, counters=p2p_comm.counters)
            c = torch.empty((plan.m, plan.n), dtype=a.dtype, device=a.device)
            p2p_comm.reduce(c, plan)
            return c
        comm = nccl.communicator(group, a.device)
        comm.prepare(plan, a.dtype)
        c, ready = produce(a, b, plan, comm.counters)
        comm.all_reduce(c, plan, ready)
        return c
