"""``all_gather_gemm(a_shard, b)``: ``all_gather(a_shard) @ b``, each band of the gathered input multiplied as it
arrives.

Column-parallel linear layer with sequence parallelism: rank r holds ``a_shard_r: [M/W, K]`` (its rows of the
sequence) and ``b_r: [K, N/W]``; every rank computes ``[M, N/W] = all_gather(a_shard) @ b_r``. The plan computes
the rank's own shard first, then each group's band of the other shards as it arrives (``Plan.tile_rows``).

Status: the reference path is tested on the CPU; the NCCL path (the GEMM waiting in-kernel for each band's flag)
is not written yet (issue 3), so this op is not exported from ``flashoverlap``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm import reference
from flashoverlap.ops._common import prepare_call
from flashoverlap.plan import Plan

OP = "all_gather_gemm"


def all_gather_gemm(
    a_shard: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    plan: Plan | None = None,
    path: str = "auto",
    return_gathered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(a_shard) @ b``: ``[M, N]`` with ``M = W * a_shard.shape[0]``; with ``return_gathered``, also
    the gathered ``[M, K]`` input (rank order), as ``dist.all_gather_into_tensor`` would return it."""
    path, group, plan = prepare_call(OP, "all_gather", a_shard, b, group, plan, path)
    if path != "reference":
        raise NotImplementedError(f"{OP}: the NCCL path is not implemented yet (issue 3); pass path='reference'")
    c, a_full = reference.all_gather_gemm(a_shard, b, plan, group, dist.get_rank(group))
    return (c, a_full) if return_gathered else c
