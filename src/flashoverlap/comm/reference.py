"""The reference communicator: a plan executed group by group with ``torch.matmul`` and blocking collectives.

It performs exactly the arithmetic and data movement the fast paths promise, in the plan's group order, on any
device and any backend (gloo on the CPU included). It is the executable specification of an op and the test
oracle; it overlaps nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.plan import Plan


def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, plan: Plan, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` summed over ``group``: each group's rows are computed (fp32 accumulation, output
    rounded to the input dtype like the kernel's) and then all-reduced, one group after the other."""
    c = torch.empty((plan.m, plan.n), dtype=a.dtype, device=a.device)
    b32 = b.float()
    for grp in plan.groups:
        band = c[grp.row_start : grp.row_end]  # full-width rows: contiguous in row-major C
        band.copy_(a[grp.row_start : grp.row_end].float() @ b32)
        dist.all_reduce(band, group=group)
    return c
