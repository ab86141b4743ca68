"""Who computes a reduction plan's bands: the signalling GEMM, or, for plans with ``gemm="cublas"``, cuBLAS on the
caller's stream, one event per group marking its completion (what the signalling GEMM's counters mark otherwise),
so the communicator can issue that group's collective as soon as its band is done (the decomposition baseline, in
the plan's layout)."""

from __future__ import annotations

import torch

from flashoverlap.kernels.gemm import gemm
from flashoverlap.plan import Plan


def produce(a: torch.Tensor, b: torch.Tensor, plan: Plan,
            counters: torch.Tensor) -> tuple[torch.Tensor, list[torch.cuda.Event] | None]:
    """A reduction plan's product (``C``, or the reduce-scatter workspace) and what the communicator waits on for
    each group: the events of cuBLAS bands, or None for the signalling GEMM, which bumps ``counters``."""
    if plan.gemm == "cublas":
        out = torch.empty((plan.m, plan.n), dtype=a.dtype, device=a.device)
        return out, compute_bands(a, b, plan, out)
    return gemm(a, b, plan, counters=counters), None


def compute_bands(a: torch.Tensor, b: torch.Tensor, plan: Plan, out: torch.Tensor) -> list[torch.cuda.Event]:
    """``out`` (``C``, or the reduce-scatter workspace ``[group][W][rows][N]``) band by band; returns one event
    per group, recorded on the current stream once the group's rows are written."""
    stream = torch.cuda.current_stream(a.device) if a.device.type == "cuda" else None  # CPU: the layout alone
    done = []
    for grp in plan.groups:
        for block in range(plan.blocks):  # reduce-scatter: the group's band of every rank block
            first = block * plan.block_rows + grp.row_start
            rows = grp.row_end - grp.row_start
            dst = grp.out_row_start + block * rows if plan.blocks > 1 else grp.row_start
            torch.matmul(a[first : first + rows], b, out=out[dst : dst + rows])
        if stream is not None:
            done.append(stream.record_event())
    return done
