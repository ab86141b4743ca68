"""The reference expert communicator: dispatch and combine (``contract.py``) in plain PyTorch, one step after
the other: ``all_to_all_single`` with the layout's split sizes, a ``torch.mm`` per received segment (fp32
accumulation, rounded to the input dtype), the reverse ``all_to_all_single`` and the weighted sum at the origin.

fp8 (``call.scales``, ``comm/expert/scaled.py``): dispatch moves each row packed with its scales (uint8 rows) and
multiplies the dequantised rows by the dequantised weights in fp32, rounded to the output dtype; combine multiplies
the same way and returns the output dtype's rows.

It runs on any backend that has ``all_to_all_single`` (gloo on the CPU included) and overlaps nothing. It is the
executable specification of the expert calls and the CPU test oracle's partner. It reads the segment bounds on
the host (one synchronisation on CUDA), so on CUDA its bounded mode is not capturable: the fast paths are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm.expert.contract import ExpertCall, ExpertPlan, Layout
from flashoverlap.comm.expert.rows import combine_at_origin, send_buffer
from flashoverlap.comm.expert.scaled import (
    ExpertScales,
    dequantised_rows,
    dequantised_weight,
    pack,
    segment_rows,
    wired,
)
from flashoverlap.comm.protocol import CommGroup, NoLane


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group: dist.ProcessGroup) -> None:
    """``all_to_all_single`` by rows; ``None`` splits: equal slots (bounded mode)."""
    dist.all_to_all_single(out, inp, None if out_splits is None else list(out_splits),
                           None if in_splits is None else list(in_splits), group=group)


def _segment_mm(rows: torch.Tensor, b: torch.Tensor, layout: Layout, n: int,
                scales: ExpertScales | None = None) -> torch.Tensor:
    """``out[seg (s, l)] = rows[seg (s, l)] @ b[l]`` for every received segment; rows outside every segment zero.
    fp8: the dequantised product (``rows`` packed or fp8 with ``scales.a``), in the output dtype."""
    dtype = rows.dtype if scales is None else scales.out_dtype
    out = torch.zeros((rows.shape[0], n), dtype=dtype, device=rows.device)
    local = layout.experts_per_rank
    starts, ends = layout.recv_seg_starts.tolist(), layout.recv_seg_ends.tolist()
    for index, (start, end) in enumerate(zip(starts, ends)):
        if end > start:
            if scales is None:
                out[start:end] = (rows[start:end].float() @ b[index % local].float()).to(dtype)
            else:
                x, x_scale = segment_rows(rows, scales, b.shape[1], start, end - start)
                w = dequantised_weight(b[index % local], scales.b[index % local], scales.mode)
                out[start:end] = (dequantised_rows(x, x_scale) @ w).to(dtype)
    return out


def dispatch(a: torch.Tensor, b: torch.Tensor, plan: ExpertPlan, layout: Layout,
             group: dist.ProcessGroup, scales: ExpertScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h [R, N], recv_rows [R, H])``: the rows sent in send order, received grouped by (source, local expert),
    each segment times its expert's ``b[l]`` (fp8: the rows packed with their scales, ``recv_rows`` uint8)."""
    rows = a if scales is None else pack(a, scales.a)
    send = send_buffer(rows, plan, layout)
    recv = rows.new_empty((layout.recv_rows, rows.shape[1]))
    _all_to_all(recv, send, layout.recv_splits, layout.send_splits, group)
    return _segment_mm(recv, b, layout, b.shape[2], scales), recv


def combine(a: torch.Tensor, b: torch.Tensor, plan: ExpertPlan, layout: Layout, group: dist.ProcessGroup,
            out: torch.Tensor | None = None, scales: ExpertScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], y_back [S, H])``: each received segment times its expert's ``b[l]``, sent back to where it
    came from, and summed at the origin over each token's choices with the router weights (into ``out`` where
    given)."""
    y = _segment_mm(a, b, layout, b.shape[2], scales)
    back = y.new_empty((layout.send_capacity, b.shape[2]))
    _all_to_all(back, y, layout.send_splits, layout.recv_splits, group)
    return combine_at_origin(back, plan, layout, y.dtype, out=out), back


class ExpertReferenceCommunicator(NoLane):
    """The reference expert path behind the communicator protocol (``comm/protocol.py``): holds nothing."""

    path = "reference"

    def __init__(self, group: CommGroup) -> None:
        self.group = group

    def run(self, call: ExpertCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call's result, and its extra rows where ``return_gathered``; the hook runs after (nothing
        overlaps)."""
        call = wired(call, call.a)[0]  # fp8 from bf16 rows: quantised first
        if call.plan.op == "dispatch":
            result, extra = dispatch(call.a, call.b, call.plan, call.layout, self.group.process_group, call.scales)
        else:
            result, extra = combine(call.a, call.b, call.plan, call.layout, self.group.process_group, call.out,
                                    call.scales)
        if call.hook is not None:
            call.hook()
        return result, extra if call.return_gathered else None

    def release(self) -> None:
        pass
