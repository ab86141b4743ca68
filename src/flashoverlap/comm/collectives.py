"""Thin wrappers over ``torch.distributed`` collectives that differ between the torch versions we support, and
the one layout helper the all-gather paths share."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.plan import Plan

# torch >= 2.13 deprecates the *_tensor names for *_single, which torch 2.11 (the GPU machines') does not have.
# Chosen once: a ``warnings.catch_warnings`` around every call would cost host time on every op call.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``dist.reduce_scatter_tensor`` (or its torch >= 2.13 name)."""
    _reduce_scatter(out, inp, group=group)


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                           async_op: bool = False):
    """``dist.all_gather_into_tensor`` (or its torch >= 2.13 name); its work handle where ``async_op``."""
    return _all_gather(out, inp, group=group, async_op=async_op)


def place_own_shard(gathered: torch.Tensor, a_shard: torch.Tensor, plan: Plan,
                    rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy ``rank``'s shard into its slot of every band of ``gathered`` (the plan's ``[group][W][rows][K]``
    layout) on the current stream, so that the GEMM's local tiles read it without waiting; returns each group's
    band and this rank's slot in it."""
    placed = []
    for grp in plan.groups:
        band = gathered[grp.out_row_start : grp.out_row_end]
        slot = band[rank * grp.rows : (rank + 1) * grp.rows]
        slot.copy_(a_shard[grp.row_start : grp.row_end])
        placed.append((band, slot))
    return placed


def gathered_in_rank_order(gathered: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The gathered A as ``all_gather_into_tensor`` of whole shards returns it (rank order), from the plan's
    ``[group][W][rows][K]`` layout."""
    world_size, shard_rows = plan.world_size, plan.block_rows
    full = torch.empty_like(gathered)
    for grp in plan.groups:
        band = gathered[grp.out_row_start : grp.out_row_end]
        full.view(world_size, shard_rows, -1)[:, grp.row_start : grp.row_end].copy_(
            band.view(world_size, grp.rows, -1))
    return full
