"""``gemm_reduce_scatter(a, b)``: ``dist.reduce_scatter_tensor(y, a @ b)``, each finished band reduce-scattered
while the multiplication goes on.

Row-parallel linear layer with sequence parallelism: rank r holds ``a_r: [M, K/W]`` and ``b_r: [K/W, N]``; rank r
gets rows ``[r*M/W, (r+1)*M/W)`` of ``sum_r a_r @ b_r`` as ``[M/W, N]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.ops import library
from flashoverlap.plan import Plan
from flashoverlap.runtime.calls import GEMM, GemmSpec, execute

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
    if library.needed(OP, (a, b), plan):
        return torch.ops.flashoverlap.gemm_reduce_scatter(a, b, library.group_name(group, OP), path)
    return execute(GEMM, GemmSpec(OP, "reduce_scatter", a, b, group, plan, path))[0]
