"""The sequential fallback: ``torch.mm`` and then one NCCL collective on the whole result, what a plan with
``sequential=True`` runs where overlap cannot pay (small GEMMs, short collectives). The collective is issued
straight to the group (``collectives.*_now``): these calls are small, and their host time is the cost."""

from __future__ import annotations

import torch

from flashoverlap.comm import scaled
from flashoverlap.comm.collectives import (
    all_gather_now,
    all_gather_pair_now,
    all_reduce_now,
    reduce_scatter_now,
    refuse_coalescing,
)
from flashoverlap.comm.protocol import Call, CommGroup


class SequentialCommunicator:
    """Plans with ``sequential=True`` behind the communicator protocol (``comm/protocol.py``): holds nothing."""

    path = "sequential"

    def __init__(self, group: CommGroup) -> None:
        self.group = group

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The op's result (and all-gather's gathered input where asked), as plain PyTorch computes it; the hook is
        issued once the collective is queued, so that it runs beside it."""
        plan, a, b, process_group = call.plan, call.a, call.b, self.group.process_group
        refuse_coalescing(process_group, call.name)
        if call.scales is not None:
            result = _scaled(call, process_group)
        elif plan.op == "all_gather":
            a_full = torch.empty((plan.m, plan.k), dtype=a.dtype, device=a.device)
            all_gather_now(a_full, a.contiguous(), process_group)
            result = torch.mm(a_full, b), a_full if call.return_gathered else None
        elif plan.op == "all_reduce":
            c = torch.mm(a, b)
            all_reduce_now(c, process_group)
            result = c, None
        else:
            out = torch.empty((plan.block_rows, plan.n), dtype=a.dtype, device=a.device)
            reduce_scatter_now(out, torch.mm(a, b), process_group)
            result = out, None
        if call.hook is not None:
            call.hook()
        return result

    def release(self) -> None:
        pass


def _scaled(call: Call, process_group) -> tuple[torch.Tensor, object]:
    """An fp8 call: ``torch._scaled_mm`` and the collective. The all-gather moves the shard's fp8 rows and their
    scales (tensor-wise: its one scale per row) in one collective call, into the dense gathered input it returns
    (no packing: these calls are small, and each copy costs host time); the reductions move the output dtype's
    partials (NCCL sums them)."""
    plan, a, b, scales = call.plan, call.a, call.b, call.scales
    if plan.op == "all_gather":
        a_full = torch.empty((plan.m, plan.k), dtype=a.dtype, device=a.device)
        scale_full = torch.empty((plan.m, scales.scale_columns(plan.k)), dtype=torch.float32, device=a.device)
        all_gather_pair_now((a_full, scale_full), (a.contiguous(), scales.shard_rows(a.shape[0]).contiguous()),
                            process_group)
        c = scaled.scaled_mm(a_full, b, scales, scale_full)
        return c, (a_full, scale_full) if call.return_gathered else None
    c = scaled.scaled_mm(a, b, scales)
    if plan.op == "all_reduce":
        all_reduce_now(c, process_group)
        return c, None
    out = torch.empty((plan.block_rows, plan.n), dtype=c.dtype, device=a.device)
    reduce_scatter_now(out, c, process_group)
    return out, None
