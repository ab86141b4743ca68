"""``all_gather_gemm(a_shard, b)``: ``all_gather(a_shard) @ b``, each band of the gathered input multiplied as it
arrives.

Column-parallel linear layer with sequence parallelism: rank r holds ``a_shard_r: [M/W, K]`` (its rows of the
sequence) and ``b_r: [K, N/W]``; every rank computes ``[M, N/W] = all_gather(a_shard) @ b_r``, its own shard's
rows first, then each peer's as they arrive (rank+1, rank+2, ...).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.ops import library
from flashoverlap.plan import Plan
from flashoverlap.runtime.calls import GEMM, GemmSpec, execute

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
    the gathered ``[M, K]`` input (rank order), as ``dist.all_gather_into_tensor`` would return it.

    Args: as :func:`flashoverlap.gemm_all_reduce`, with ``a_shard: [M/W, K]`` this rank's rows.
    """
    if library.needed(OP, (a_shard, b), plan):
        c, gathered = torch.ops.flashoverlap.all_gather_gemm(a_shard, b, library.group_name(group, OP), path)
    else:
        c, gathered = execute(GEMM, GemmSpec(OP, "all_gather", a_shard, b, group, plan, path, return_gathered))
    return (c, gathered) if return_gathered else c
