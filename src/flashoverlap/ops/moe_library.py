"""The expert-parallel ops as PyTorch custom ops (``torch.ops.flashoverlap.moe_*``), with fake implementations and
autograd, so that ``torch.compile(fullgraph=True)`` traces a model that calls them (bounded mode: every shape is
fixed by the bound) and autograd records them. The layout travels as two arguments: its tensors (``Tensor[]``) and
its values (``int[]``, ``layout_values``: experts, top-k, the bound (0: exact mode), exact mode's largest
(source, destination) pair of the group (0 in bounded mode), then the split sizes, empty in bounded mode).

Autograd, for one layer (``comm/expert/contract.py`` has the shape algebra; ``b^T`` is ``b.transpose(1, 2)``):

- ``moe_dispatch(x [T, H], w_up [L, H, N]) -> h [R, N]`` (and the received rows ``recv [R, H]``):
  ``grad_x`` = combine of ``grad_h`` with ``w_up^T``, unweighted (each token's k copies summed back at the
  origin: the reverse all-to-all); ``grad_w_up[l] = sum over segments of expert l of recv[seg]^T @ grad_h[seg]``.
- ``moe_combine(a [R, F], w_down [L, F, H], topk_weights [T, k]) -> out [T, H]`` (and the returned rows
  ``y_back [S, H]``): ``grad_a`` = per-choice dispatch of ``topk_weights[t, c] * grad_out[t]`` with ``w_down^T``
  (the forward all-to-all); ``grad_w_down[l] = sum a[seg]^T @ g_recv[seg]`` with the received gradient rows;
  ``grad_topk_weights[t, c] = <grad_out[t], y_back[row of (t, c)]>``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from flashoverlap.comm.expert import Layout, default_bound
from flashoverlap.comm.expert.scaled import ExpertScales, mode_of_weight_scales, wire_width
from flashoverlap.runtime import experts
from flashoverlap.runtime.calls import execute


def _world(group: str) -> int:
    return dist.get_world_size(_resolve_process_group(group))


def layout_values(routing: Layout) -> list[int]:
    """What the custom ops take beside the layout's tensors: ``[experts, top_k, bound, max_pair_rows, W_splits,
    *send_splits, *recv_splits]`` (``bound`` 0 in exact mode, ``max_pair_rows`` 0 in bounded mode, where the bound
    is the value; ``W_splits`` the number of split sizes each way, 0 in bounded mode)."""
    send, recv = list(routing.send_splits or ()), list(routing.recv_splits or ())
    return [routing.experts, routing.top_k, routing.bound or 0, 0 if routing.bound else (routing.max_pair_rows or 0),
            len(send), *send, *recv]


def layout_of(tensors: list[torch.Tensor], values: list[int]) -> Layout:
    """``layout_values``' inverse, with the tensors (``Layout.tensors()``)."""
    num_experts, top_k, bound, max_pair_rows, splits = values[:5]
    send_splits, recv_splits = list(values[5 : 5 + splits]), list(values[5 + splits : 5 + 2 * splits])
    if bound:
        return Layout(*tensors, mode="bounded", bound=bound, top_k=top_k, tokens=tensors[0].shape[0] // top_k,
                      experts=num_experts, max_pair_rows=bound)
    return Layout(*tensors, mode="exact", bound=None, top_k=top_k, tokens=tensors[0].shape[0] // top_k,
                  experts=num_experts, send_splits=tuple(send_splits), recv_splits=tuple(recv_splits),
                  max_pair_rows=max_pair_rows)


@torch.library.custom_op("flashoverlap::moe_layout", mutates_args=())
def moe_layout(topk_idx: torch.Tensor, num_experts: int, group: str, bound: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bounded-mode layout's tensors (``Layout.tensors()``); collective."""
    routing = experts.layout("moe_layout", topk_idx, num_experts, _resolve_process_group(group), "bounded", bound)
    return tuple(t.clone() for t in routing.tensors())  # custom ops may not return views of one another


@moe_layout.register_fake
def _(topk_idx, num_experts, group, bound):
    world = _world(group)
    local, choices = num_experts // world, topk_idx.numel()
    i64 = dict(dtype=torch.int64, device=topk_idx.device)
    i32 = dict(dtype=torch.int32, device=topk_idx.device)
    return (torch.empty(choices, **i64), torch.empty(choices, **i64), torch.empty((world, local), **i64),
            torch.empty((world, local), **i64), torch.empty(world * local, **i32), torch.empty(world * local, **i32))


@torch.library.custom_op("flashoverlap::moe_dispatch", mutates_args=())
def moe_dispatch(x: torch.Tensor, w: torch.Tensor, layout: list[torch.Tensor], group: str, values: list[int],
                 per_choice: bool, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h [R, N], recv [R, H])``: see ``comm/expert/contract.py``; ``layout``, ``values``: ``layout_values``."""
    name = "moe_gemm_combine backward" if per_choice else "moe_dispatch_gemm"
    spec = experts.ExpertSpec(name, "dispatch", x, w, layout_of(layout, values), _resolve_process_group(group), path,
                              per_choice=per_choice, return_gathered=True)
    h, recv = execute(experts.EXPERT, spec)
    return h, recv


@moe_dispatch.register_fake
def _(x, w, layout, group, values, per_choice, path):
    bound, splits = values[2], values[4]
    rows = layout[2].shape[0] * bound if bound else sum(values[5 + splits : 5 + 2 * splits])
    return x.new_empty((rows, w.shape[2])), x.new_empty((rows, x.shape[1]))


@torch.library.custom_op("flashoverlap::moe_combine", mutates_args=())
def moe_combine(a: torch.Tensor, w: torch.Tensor, topk_weights: torch.Tensor | None, layout: list[torch.Tensor],
                group: str, values: list[int], path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], y_back [S, H])``: see ``comm/expert/contract.py``; ``topk_weights`` None: the unweighted sum."""
    weighted = topk_weights is not None
    name = "moe_gemm_combine" if weighted else "moe_dispatch_gemm backward"
    spec = experts.ExpertSpec(name, "combine", a, w, layout_of(layout, values), _resolve_process_group(group), path,
                              topk_weights, weighted=weighted, return_gathered=True)
    out, back = execute(experts.EXPERT, spec)
    return out, back


@moe_combine.register_fake
def _(a, w, topk_weights, layout, group, values, path):
    top_k, bound = values[1], values[2]
    send_order = layout[0]
    tokens = send_order.shape[0] // top_k
    sent = layout[2].shape[0] * bound if bound else send_order.shape[0]
    return a.new_empty((tokens, w.shape[2])), a.new_empty((sent, w.shape[2]))


@torch.library.custom_op("flashoverlap::moe_weight_grad", mutates_args=())
def moe_weight_grad(rows: torch.Tensor, grads: torch.Tensor, seg_starts: torch.Tensor, seg_ends: torch.Tensor,
                    local: int, k_major: bool) -> torch.Tensor:
    """``grad_w [L, K, N]``, ``grad_w[l] = sum over the received segments (s, l) of rows[seg]^T @ grads[seg]``
    (``rows [R, K]``, ``grads [R, N]``); laid out as ``w.transpose(1, 2)`` of a contiguous ``[L, N, K]`` where
    ``k_major`` (the layout of weights stored ``nn.Linear``-shaped), else contiguous. No host synchronisation where
    ``torch._grouped_mm`` takes the dtype (the CPU, bf16 on CUDA) and the widths (rows of K and of N elements a
    multiple of 16 bytes, its strides' rule): rows are put in expert order on the device. Elsewhere one product per
    expert, after one host synchronisation."""
    count = rows.shape[0]
    segments = seg_ends.numel()
    index = torch.arange(count, device=rows.device)
    seg = torch.searchsorted(seg_ends.to(torch.int64), index, right=True)  # the first segment ending past the row
    clamped = seg.clamp(max=segments - 1)
    inside = (seg < segments) & (index >= seg_starts.to(torch.int64)[clamped])  # else a gap (bounded padding)
    expert = torch.where(inside, clamped % local, local)
    order = torch.sort(expert, stable=True).indices
    per_expert = torch.zeros(local + 1, dtype=torch.int64, device=rows.device).index_add_(
        0, expert, torch.ones_like(expert))
    offs = torch.cumsum(per_expert[:local], 0).to(torch.int32)
    rows_sorted, grads_sorted = rows.index_select(0, order), grads.index_select(0, order)
    aligned = (rows.shape[1] * rows.element_size()) % 16 == 0 and (grads.shape[1] * grads.element_size()) % 16 == 0
    if aligned and (rows.device.type == "cpu" or rows.dtype == torch.bfloat16):
        if k_major:  # [L, N, K], returned as its [L, K, N] view
            return torch._grouped_mm(grads_sorted.t(), rows_sorted, offs).transpose(1, 2)
        return torch._grouped_mm(rows_sorted.t(), grads_sorted, offs)
    out = rows.new_zeros((local, grads.shape[1], rows.shape[1])).transpose(1, 2) if k_major else rows.new_zeros(
        (local, rows.shape[1], grads.shape[1]))
    start = 0
    for expert_index, end in enumerate(offs.tolist()):  # one host synchronisation on CUDA
        if end > start:
            out[expert_index] = (rows_sorted[start:end].t().float() @ grads_sorted[start:end].float()).to(rows.dtype)
        start = end
    return out


@moe_weight_grad.register_fake
def _(rows, grads, seg_starts, seg_ends, local, k_major):
    if k_major:
        return rows.new_empty((local, grads.shape[1], rows.shape[1])).transpose(1, 2)
    return rows.new_empty((local, rows.shape[1], grads.shape[1]))


def _k_major(w: torch.Tensor) -> bool:
    """Whether ``w [L, K, N]`` is the ``transpose(1, 2)`` view of a contiguous ``[L, N, K]`` weight."""
    return w.stride(1) == 1 and w.stride(2) != 1


# -- autograd ------------------------------------------------------------------------------------------------------
def _keep_dispatch(ctx, inputs, output) -> None:
    x, w, layout, group, values, per_choice, path = inputs
    ctx.save_for_backward(w, output[1], *layout)
    ctx.values = (group, values, per_choice, path)
    ctx.x_shape = x.shape
    ctx.mark_non_differentiable(output[1])
    ctx.k_major = _k_major(w)


def _dispatch_backward(ctx, grad_h, grad_recv):
    w, recv, *layout = ctx.saved_tensors
    group, values, per_choice, path = ctx.values
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        out, back = torch.ops.flashoverlap.moe_combine(grad_h.contiguous(), w.transpose(1, 2), None, layout, group,
                                                       values, path)
        if per_choice:  # one row per choice: its own returned row, unsummed
            send_order, send_rows = layout[0], layout[1]
            grad_x = back.new_empty(ctx.x_shape).index_copy_(0, send_order, back.index_select(0, send_rows))
        else:
            grad_x = out
    if ctx.needs_input_grad[1]:
        grad_w = torch.ops.flashoverlap.moe_weight_grad(recv, grad_h.contiguous(), layout[4], layout[5],
                                                        w.shape[0], ctx.k_major)
    return grad_x, grad_w, [None] * len(layout), None, None, None, None


def _keep_combine(ctx, inputs, output) -> None:
    a, w, topk_weights, layout, group, values, path = inputs
    ctx.save_for_backward(a, w, topk_weights, output[1], *layout)
    ctx.values = (group, values, path)
    ctx.mark_non_differentiable(output[1])
    ctx.k_major = _k_major(w)


def _combine_backward(ctx, grad_out, grad_back):
    a, w, topk_weights, back, *layout = ctx.saved_tensors
    group, values, path = ctx.values
    top_k = values[1]
    send_order, send_rows = layout[0], layout[1]
    grad_out = grad_out.contiguous()
    tokens, hidden = grad_out.shape
    grad_a = grad_w = grad_weights = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        # Each choice's gradient row: its router weight times its token's output gradient (what the plain
        # weighted sum's backward gives), rounded to the rows' dtype.
        scale = topk_weights.float()[:, :, None] if topk_weights is not None else 1.0
        per_choice = (grad_out.float()[:, None, :] * scale).to(a.dtype).expand(tokens, top_k, hidden)
        grad_a, g_recv = torch.ops.flashoverlap.moe_dispatch(
            per_choice.reshape(tokens * top_k, hidden), w.transpose(1, 2), layout, group, values, True, path)
        if ctx.needs_input_grad[1]:
            grad_w = torch.ops.flashoverlap.moe_weight_grad(a, g_recv, layout[4], layout[5], w.shape[0],
                                                            ctx.k_major)
    if topk_weights is not None and ctx.needs_input_grad[2]:
        token = torch.div(send_order, top_k, rounding_mode="floor")
        dots = (grad_out.float().index_select(0, token) * back.index_select(0, send_rows).float()).sum(1)
        grad_weights = dots.new_empty(tokens * top_k).index_copy_(0, send_order, dots)
        grad_weights = grad_weights.view(tokens, top_k).to(topk_weights.dtype)
    return grad_a if ctx.needs_input_grad[0] else None, grad_w, grad_weights, [None] * len(layout), None, None, None


moe_dispatch.register_autograd(_dispatch_backward, setup_context=_keep_dispatch)
moe_combine.register_autograd(_combine_backward, setup_context=_keep_combine)


# -- fp8 (comm/expert/scaled.py): no autograd of their own (flashoverlap.nn's fp8 experts define the backward) -----


@torch.library.custom_op("flashoverlap::moe_dispatch_scaled", mutates_args=())
def moe_dispatch_scaled(x: torch.Tensor, scale_x: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor,
                        layout: list[torch.Tensor], group: str, values: list[int], per_choice: bool, path: str,
                        out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``(h [R, N] out_dtype, recv [R, wire width] uint8)``: ``moe_dispatch`` with fp8 rows and weights and their
    scales (``comm/expert/scaled.py``), the received rows packed with their scales."""
    name = "moe_gemm_combine backward" if per_choice else "moe_dispatch_gemm"
    scales = ExpertScales(mode_of_weight_scales(scale_w) or "?", scale_w, scale_x, out_dtype, x.dtype)
    spec = experts.ExpertSpec(name, "dispatch", x, w, layout_of(layout, values), _resolve_process_group(group), path,
                              per_choice=per_choice, return_gathered=True, scales=scales)
    h, recv = execute(experts.EXPERT, spec)
    return h, recv


@moe_dispatch_scaled.register_fake
def _(x, scale_x, w, scale_w, layout, group, values, per_choice, path, out_dtype):
    bound, splits = values[2], values[4]
    rows = layout[2].shape[0] * bound if bound else sum(values[5 + splits : 5 + 2 * splits])
    width = wire_width(x.shape[1], mode_of_weight_scales(scale_w) or "row")
    return x.new_empty((rows, w.shape[2]), dtype=out_dtype), x.new_empty((rows, width), dtype=torch.uint8)


@torch.library.custom_op("flashoverlap::moe_combine_scaled", mutates_args=())
def moe_combine_scaled(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor,
                       topk_weights: torch.Tensor | None, layout: list[torch.Tensor], group: str, values: list[int],
                       path: str, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``(out [T, H], y_back [S, H])`` in ``out_dtype``: ``moe_combine`` with fp8 rows and weights and their
    scales; ``topk_weights`` None: the unweighted sum."""
    weighted = topk_weights is not None
    name = "moe_gemm_combine" if weighted else "moe_dispatch_gemm backward"
    scales = ExpertScales(mode_of_weight_scales(scale_w) or "?", scale_w, scale_a, out_dtype, a.dtype)
    spec = experts.ExpertSpec(name, "combine", a, w, layout_of(layout, values), _resolve_process_group(group), path,
                              topk_weights, weighted=weighted, return_gathered=True, scales=scales)
    out, back = execute(experts.EXPERT, spec)
    return out, back


@moe_combine_scaled.register_fake
def _(a, scale_a, w, scale_w, topk_weights, layout, group, values, path, out_dtype):
    top_k, bound = values[1], values[2]
    send_order = layout[0]
    tokens = send_order.shape[0] // top_k
    sent = layout[2].shape[0] * bound if bound else send_order.shape[0]
    return (a.new_empty((tokens, w.shape[2]), dtype=out_dtype), a.new_empty((sent, w.shape[2]), dtype=out_dtype))


def bounded_layout(topk_idx: torch.Tensor, num_experts: int, group: str, bound: int | None) -> Layout:
    """A bounded-mode layout through the custom op (what ``torch.compile`` traces)."""
    tokens, top_k = topk_idx.shape
    bound = default_bound(tokens, top_k) if bound is None else bound
    tensors = torch.ops.flashoverlap.moe_layout(topk_idx, num_experts, group, bound)
    return Layout(*tensors, mode="bounded", bound=bound, top_k=top_k, tokens=tokens, experts=num_experts,
                  max_pair_rows=bound)
