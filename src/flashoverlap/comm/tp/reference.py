"""The reference communicator: a plan executed group by group with ``torch.matmul`` and blocking collectives.

It performs exactly the arithmetic and data movement the fast paths promise, in the plan's group order, on any
device and any backend (gloo on the CPU included). It is the executable specification of an op and the test
oracle; it overlaps nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm.collectives import all_gather_into_tensor, gathered_in_rank_order, reduce_scatter_tensor
from flashoverlap.comm.protocol import Call, CommGroup
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


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, plan: Plan, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` summed over ``group`` and scattered by rows: this rank gets rows
    ``[r*M/W, (r+1)*M/W)`` as ``[M/W, N]``. Group by group, the plan's layout: the group's band of every rank
    block is computed into the group's workspace slice ``[W][rows][N]``, whose reduce-scatter lands this rank's
    band straight in its place in the output."""
    block_rows = plan.block_rows
    out = torch.empty((block_rows, plan.n), dtype=a.dtype, device=a.device)
    workspace = torch.empty((plan.m, plan.n), dtype=a.dtype, device=a.device)
    b32 = b.float()
    for grp in plan.groups:
        band = workspace[grp.out_row_start : grp.out_row_end]
        for block in range(plan.blocks):
            rows = slice(block * block_rows + grp.row_start, block * block_rows + grp.row_end)
            band[block * grp.rows : (block + 1) * grp.rows].copy_(a[rows].float() @ b32)
        reduce_scatter_tensor(out[grp.row_start : grp.row_end], band, group)
    return out


def all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, plan: Plan, group: dist.ProcessGroup | None,
                    rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(a_shard) @ b`` and the gathered ``a`` itself, in the plan's order: this rank's shard first
    (nothing to wait for), then group by group: the group's band of every shard is gathered (one
    ``all_gather_into_tensor`` into the ``[group][W][rows][K]`` layout of ``Plan.tile_rows``) and multiplied."""
    world_size, shard_rows = plan.world_size, plan.block_rows
    c = torch.empty((plan.m, plan.n), dtype=a_shard.dtype, device=a_shard.device)
    gathered = torch.empty((plan.m, plan.k), dtype=a_shard.dtype, device=a_shard.device)
    b32 = b.float()
    c[rank * shard_rows : (rank + 1) * shard_rows].copy_(a_shard.float() @ b32)
    for grp in plan.groups:
        band = gathered[grp.out_row_start : grp.out_row_end]
        all_gather_into_tensor(band, a_shard[grp.row_start : grp.row_end].contiguous(), group)
        for q in range(1, world_size):
            src = (rank + q) % world_size
            rows = slice(src * shard_rows + grp.row_start, src * shard_rows + grp.row_end)
            c[rows].copy_(band[src * grp.rows : (src + 1) * grp.rows].float() @ b32)
    return c, gathered_in_rank_order(gathered, plan)


class ReferenceCommunicator:
    """The reference path behind the communicator protocol (``comm/protocol.py``): holds nothing."""

    path = "reference"

    def __init__(self, group: CommGroup) -> None:
        self.group = group

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The op's result, and all-gather's gathered input where asked; the hook runs after (nothing overlaps)."""
        plan, a, b, process_group = call.plan, call.a, call.b, self.group.process_group
        if plan.op == "all_reduce":
            result = gemm_all_reduce(a, b, plan, process_group), None
        elif plan.op == "reduce_scatter":
            result = gemm_reduce_scatter(a, b, plan, process_group), None
        else:
            c, a_full = all_gather_gemm(a, b, plan, process_group, self.group.rank)
            result = c, a_full if call.return_gathered else None
        if call.hook is not None:
            call.hook()
        return result

    def release(self) -> None:
        pass
