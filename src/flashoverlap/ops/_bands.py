"""Plans with ``gemm="cublas"``: each group's rows computed by cuBLAS on the caller's stream, one event per group
marking its completion (what the signalling GEMM's counters mark otherwise), so the communicator can issue that
group's collective as soon as its band is done. The decomposition baseline, in the plan's layout."""

from __future__ import annotations

import torch

from flashoverlap.plan import Plan


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
