"""What every expert path does with rows besides the GEMM and the transfer: dispatch's send buffer from the tokens
(``send_buffer``), the token of each choice (``choice_tokens``), the receive buffer's segments
(``recv_segments``) and combine's weighted sum at the origin (``combine_at_origin``), on the contract's types
(``comm/expert/contract.py``).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from flashoverlap.comm.expert.contract import ExpertPlan, Layout


def source_rows(plan: ExpertPlan, layout: Layout) -> torch.Tensor:
    """int64 ``[T*k]``: the row of a dispatch's ``a`` that each choice in send order carries (``a[t]`` for choice
    ``t * k + c``, or ``a[j]`` itself with ``per_choice``)."""
    return layout.send_order if plan.per_choice else choice_tokens(layout, plan.top_k)


# Exact mode: each layout's ``choice_tokens``, by its send order (the tensor a layer's dispatch, combine and backward
# calls share: ``Layout.with_weights`` makes a new Layout around the same tensors), kept while the layout lives.
_TOKENS = WeakTensorKeyDictionary()


def choice_tokens(layout: Layout, top_k: int) -> torch.Tensor:
    """int64 ``[T*k]``: the token of each choice in send order (``send_order // top_k``). Exact mode: made once per
    layout (an exact layout is never captured: its sizes are host values); bounded mode: per call, on the device, so
    that a CUDA graph holding the call reads the layout's tensors as they are when it replays."""
    if layout.mode != "exact" or top_k != layout.top_k:
        return torch.div(layout.send_order, top_k, rounding_mode="floor")
    tokens = _TOKENS.get(layout.send_order)
    if tokens is None:
        tokens = _TOKENS[layout.send_order] = torch.div(layout.send_order, top_k, rounding_mode="floor")
    return tokens


def send_buffer(a: torch.Tensor, plan: ExpertPlan, layout: Layout) -> torch.Tensor:
    """Dispatch's send buffer ``[S_r, H]``: each choice's row at its ``send_rows`` position, padding zero."""
    rows = a.index_select(0, source_rows(plan, layout))
    if plan.mode == "exact":
        return rows
    buffer = a.new_zeros((plan.send_capacity, a.shape[1]))
    return buffer.index_copy_(0, layout.send_rows, rows)


def recv_segments(layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(starts, ends, local_expert)``, int32 ``[W*L]`` each: the received rows' segments in (source, local
    expert) order and the local expert of each (``grouped_gemm``'s ``seg_expert``)."""
    local = layout.experts_per_rank
    expert = torch.arange(local, dtype=torch.int32, device=layout.recv_seg_ends.device).repeat(layout.world_size)
    return layout.recv_seg_starts, layout.recv_seg_ends, expert


def combine_at_origin(y_back: torch.Tensor, plan: ExpertPlan, layout: Layout, out_dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_c w[t, c] * y[t, c]`` from the rows back at the origin ``y_back: [S_r, H]`` (send layout), in
    fp32, rounded to ``out_dtype``; ``w = 1`` where the plan is unweighted or the layout has no weights. ``out``: a
    preallocated ``[T, H]`` tensor of ``out_dtype`` on ``y_back``'s device to write the result into (and return);
    None: a new one."""
    shape = (plan.tokens, y_back.shape[1])
    if out is not None:
        check_out("combine_at_origin", out, shape, out_dtype, y_back.device)
    # Exact mode's send rows are packed (``send_rows`` is ``arange``): the rows are read in place.
    rows = y_back if layout.mode == "exact" else y_back.index_select(0, layout.send_rows)
    if plan.weighted and layout.weights is not None:
        rows = rows * layout.weights.float()[:, None]  # in fp32 (type promotion): the rows' exact fp32 values
    else:
        rows = rows.float()
    tokens = choice_tokens(layout, plan.top_k)
    if out is not None and out_dtype == torch.float32:  # the sum straight into it: no fp32 temporary
        return out.zero_().index_add_(0, tokens, rows)
    total = torch.zeros(shape, dtype=torch.float32, device=y_back.device).index_add_(0, tokens, rows)
    return total.to(out_dtype) if out is None else out.copy_(total)


def check_out(name: str, out: object, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
    """A preallocated combine output: a tensor of ``shape``, ``dtype`` and ``device`` (an error naming ``out`` and
    what it must be, otherwise)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: out must be a torch.Tensor {list(shape)} or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"{name}: out must be {list(shape)} {dtype} on {device} (the combine's [T, H] result), got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
