"""The reference communicator: a plan executed group by group with ``torch.matmul`` and blocking collectives.

It performs exactly the arithmetic and data movement the fast paths promise, in the plan's group order, on any
device and any backend (gloo on the CPU included). It is the executable specification of an op and the test
oracle; it overlaps nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm import scaled
from flashoverlap.comm.collectives import all_gather_into_tensor, gathered_in_rank_order, reduce_scatter_tensor
from flashoverlap.comm.protocol import Call, CommGroup, NoLane
from flashoverlap.comm.scaled import Scales
from flashoverlap.plan import Plan


class Bands:
    """A call's product band by band: ``a``'s rows times ``b`` in fp32 (fp8: scaled, bias added, as
    ``comm/scaled.py`` says), and the dtype results take (the input's; fp8: the output dtype)."""

    def __init__(self, b: torch.Tensor, scales: Scales | None, dtype: torch.dtype) -> None:
        self.scales = scales
        self.b = b.float() if scales is None else scaled.dequantised_b(b, scales)
        self.dtype = dtype if scales is None else scales.out_dtype

    def __call__(self, a: torch.Tensor, rows: slice, scale_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``a[rows] @ b`` in fp32; ``scale_rows``: the rows' scales where they are not ``scales.a``'s."""
        if self.scales is None:
            return a[rows].float() @ self.b
        if scale_rows is None:
            scale_rows = self.scales.rows_of_a(rows, rows.stop - rows.start)
        return scaled.product(a[rows], scale_rows, self.b, self.scales)

    def reduce(self, band: torch.Tensor, partial: torch.Tensor, collective) -> None:
        """Round ``partial`` to the result dtype and reduce it with ``collective(out, input)`` into ``band``:
        fp8 calls' partials travel in the output dtype and are summed in fp32."""
        if self.scales is None:
            collective(band, partial.to(self.dtype))
            return
        summed = torch.empty(band.shape, dtype=torch.float32, device=band.device)
        collective(summed, partial.to(self.dtype).float())
        band.copy_(summed)


def gemm_all_reduce(a: torch.Tensor, bands: Bands, plan: Plan, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` summed over ``group``: each group's rows are computed (fp32 accumulation, output
    rounded to the result dtype like the kernel's) and then all-reduced, one group after the other."""
    c = torch.empty((plan.m, plan.n), dtype=bands.dtype, device=a.device)
    for grp in plan.groups:
        band = c[grp.row_start : grp.row_end]  # full-width rows: contiguous in row-major C
        bands.reduce(band, bands(a, slice(grp.row_start, grp.row_end)), lambda out, x: _all_reduce(out, x, group))
    return c


def _all_reduce(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    dist.all_reduce(x, group=group)
    out.copy_(x)


def gemm_reduce_scatter(a: torch.Tensor, bands: Bands, plan: Plan, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` summed over ``group`` and scattered by rows: this rank gets rows
    ``[r*M/W, (r+1)*M/W)`` as ``[M/W, N]``. Group by group, the plan's layout: the group's band of every rank
    block is computed into the group's workspace slice ``[W][rows][N]``, whose reduce-scatter lands this rank's
    band straight in its place in the output."""
    block_rows = plan.block_rows
    out = torch.empty((block_rows, plan.n), dtype=bands.dtype, device=a.device)
    workspace = torch.empty((plan.m, plan.n), dtype=torch.float32, device=a.device)
    for grp in plan.groups:
        band = workspace[grp.out_row_start : grp.out_row_end]
        for block in range(plan.blocks):
            rows = slice(block * block_rows + grp.row_start, block * block_rows + grp.row_end)
            band[block * grp.rows : (block + 1) * grp.rows].copy_(bands(a, rows))
        bands.reduce(out[grp.row_start : grp.row_end], band, lambda dst, x: reduce_scatter_tensor(dst, x, group))
    return out


def all_gather_gemm(a_shard: torch.Tensor, bands: Bands, plan: Plan, group: dist.ProcessGroup | None,
                    rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``all_gather(a_shard) @ b`` and the gathered ``a`` itself (fp8: and its scales, ``[M, S]``), in the plan's
    order: this rank's shard first (nothing to wait for), then group by group: the group's band of every shard is
    gathered (one ``all_gather_into_tensor`` into the ``[group][W][rows][K]`` layout of ``Plan.tile_rows``; fp8:
    each row's bytes and its scales in one buffer) and multiplied."""
    world_size, shard_rows, k, scales = plan.world_size, plan.block_rows, plan.k, bands.scales
    c = torch.empty((plan.m, plan.n), dtype=bands.dtype, device=a_shard.device)
    c[rank * shard_rows : (rank + 1) * shard_rows].copy_(bands(a_shard, slice(0, shard_rows)))
    width = k if scales is None else scaled.row_bytes(k, a_shard.dtype, scales)
    columns = 0 if scales is None else scales.scale_columns(k)
    gathered = torch.empty((plan.m, width), dtype=a_shard.dtype if scales is None else torch.uint8,
                           device=a_shard.device)
    for grp in plan.groups:
        band = gathered[grp.out_row_start : grp.out_row_end]
        own = slice(grp.row_start, grp.row_end)
        if scales is None:
            mine = a_shard[own].contiguous()
        else:
            mine = scaled.pack_rows(a_shard[own], scales.rows_of_a(own, grp.rows))
        all_gather_into_tensor(band, mine, group)
        for q in range(1, world_size):
            src = (rank + q) % world_size
            rows = slice(src * shard_rows + grp.row_start, src * shard_rows + grp.row_end)
            theirs = band[src * grp.rows : (src + 1) * grp.rows]
            if scales is None:
                c[rows].copy_(bands(theirs, slice(0, grp.rows)))
            else:
                a_rows, scale_rows = scaled.unpack_rows(theirs, k, a_shard.dtype, columns)
                c[rows].copy_(bands(a_rows, slice(0, grp.rows), scale_rows))
    gathered = gathered_in_rank_order(gathered, plan)
    if scales is None:
        return c, gathered, None
    return c, *scaled.gathered_input(gathered, k, a_shard.dtype, scales)


class ReferenceCommunicator(NoLane):
    """The reference path behind the communicator protocol (``comm/protocol.py``): holds nothing."""

    path = "reference"

    def __init__(self, group: CommGroup) -> None:
        self.group = group

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The op's result, and all-gather's gathered input where asked; the hook runs after (nothing overlaps)."""
        plan, a, process_group = call.plan, call.a, self.group.process_group
        bands = Bands(call.b, call.scales, a.dtype)
        if plan.op == "all_reduce":
            result = gemm_all_reduce(a, bands, plan, process_group), None
        elif plan.op == "reduce_scatter":
            result = gemm_reduce_scatter(a, bands, plan, process_group), None
        else:
            c, a_full, scale_full = all_gather_gemm(a, bands, plan, process_group, self.group.rank)
            result = c, (a_full if scale_full is None else (a_full, scale_full)) if call.return_gathered else None
        if call.hook is not None:
            call.hook()
        return result

    def release(self) -> None:
        pass
