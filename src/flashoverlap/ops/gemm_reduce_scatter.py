"""``gemm_reduce_scatter(a, b)``: ``dist.reduce_scatter_tensor(y, a @ b)``, each finished band reduce-scattered
while the GEMM goes on.

Row-parallel linear layer with sequence parallelism: rank r holds ``a_r: [M, K/W]`` and ``b_r: [K/W, N]``; rank r
gets rows ``[r*M/W, (r+1)*M/W)`` of ``sum_r a_r @ b_r`` as ``[M/W, N]``. The GEMM writes each group's band of
every rank block into a workspace laid out ``[group][W][rows][N]`` (``Plan.tile_rows``), so one
``reduce_scatter_tensor`` per group lands this rank's band straight in its place in the output.

P2P path (``path="p2p"``, NVLink): the workspace lives in symmetric memory; per group, once every rank's GEMM has
written it, copy engines pull this rank's rows of every partial and one small kernel sums them (``comm/p2p.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm import nccl, p2p, reference
from flashoverlap.comm.collectives import reduce_scatter_tensor
from flashoverlap.kernels.gemm import gemm
from flashoverlap.ops._bands import produce
from flashoverlap.ops._common import prepare_call
from flashoverlap.plan import Plan

OP = "gemm_reduce_scatter"


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    plan: Plan | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """This rank's rows of ``a @ b`` summed over ``group``: ``[M/W, N]``, as ``dist.reduce_scatter_tensor`` returns.

    Args: as :func:`flashoverlap.gemm_all_reduce`; ``M`` must be divisible by the group's size.
    """
    path, group, plan = prepare_call(OP, "reduce_scatter", a, b, group, plan, path)
    if path == "reference":
        return reference.gemm_reduce_scatter(a, b, plan, group)
    with torch.cuda.device(a.device):
        out = torch.empty((plan.block_rows, plan.n), dtype=a.dtype, device=a.device)
        if plan.sequential:
            reduce_scatter_tensor(out, torch.matmul(a, b), group)
            return out
        if path == "p2p":
            p2p_comm = p2p.communicator(group, a.device)
            workspace = p2p_comm.prepare_reduction(plan, a.dtype)
            gemm(a, b, plan, out=workspace, counters=p2p_comm.counters)
            p2p_comm.reduce(out, plan)
            return out
        comm = nccl.communicator(group, a.device)
        comm.prepare(plan, a.dtype)
        workspace, ready = produce(a, b, plan, comm.counters)
        comm.reduce_scatter(out, workspace, plan, ready)
        return out
