"""The sequential fallback: ``torch.matmul`` and then one NCCL collective on the whole result, what a plan with
``sequential=True`` runs where overlap cannot pay (small GEMMs, short collectives)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from flashoverlap.plan import Plan


def run(plan: Plan, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup,
        return_gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op's result (and all-gather's gathered input where ``return_gathered``), as plain PyTorch computes it."""
    if plan.op == "all_gather":
        a_full = torch.empty((plan.m, plan.k), dtype=a.dtype, device=a.device)
        all_gather_into_tensor(a_full, a.contiguous(), group)
        return torch.matmul(a_full, b), a_full if return_gathered else None
    c = torch.matmul(a, b)
    if plan.op == "all_reduce":
        dist.all_reduce(c, group=group)
        return c, None
    out = torch.empty((plan.block_rows, plan.n), dtype=a.dtype, device=a.device)
    reduce_scatter_tensor(out, c, group)
    return out, None
