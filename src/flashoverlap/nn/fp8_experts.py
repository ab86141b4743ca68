"""The fp8 expert layer's mechanics, apart from the layer classes (``nn/moe.py`` imports them, ``nn/fp8_moe.py``
documents them): the weights' quantisation for the ops (``quantise_weight``), torchao's row-wise MoE training recipe
through the expert ops (the casts, the autograd Functions around dispatch and combine, the weight gradients:
``experts_forward``), and the recognition of torchao-converted weights (``torchao_weight``). Apart so that the layer
(``nn/moe.py``) and the inference layer (``nn/fp8_moe.py``, a subclass of it) both use them without importing each
other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashoverlap.comm.scaled import BLOCK
from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine


def check_block_widths(where: str, hidden: int, ffn: int) -> None:
    """Block-wise fp8 experts' widths, checked where the layer is built or converted, not at its first dispatch."""
    if hidden % BLOCK or ffn % BLOCK:
        raise ValueError(f"{where}='block' scales {BLOCK}x{BLOCK} blocks of the weights: hidden ({hidden}) and ffn "
                         f"({ffn}) must be multiples of {BLOCK}")


def quantise_weight(w: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear-shaped expert weights ``w [L, N, K]`` as fp8 e4m3 ``[L, N, K]`` and the scales the ops take for the
    ``[L, K, N]`` view (``transpose(1, 2)``): row-wise ``[L, N]``; block-wise ``[L, K/128, ceil(N/128)]`` (a
    transposed view of ``[L, ceil(N/128), K/128]``)."""
    top = torch.finfo(torch.float8_e4m3fn).max
    w = w.detach().float()
    local, n, k = w.shape
    if scaling == "row":
        scale = (w.abs().amax(2) / top).clamp_min(1e-12)
        return (w / scale[:, :, None]).clamp(-top, top).to(torch.float8_e4m3fn), scale
    if k % BLOCK:
        raise ValueError(f"block-wise fp8 weights need K = {k} to be a multiple of {BLOCK}")
    n_pad = -(-n // BLOCK) * BLOCK
    padded = F.pad(w, (0, 0, 0, n_pad - n)).view(local, n_pad // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = (padded.abs().amax((2, 4)) / top).clamp_min(1e-12)
    q = (padded / scale[:, :, None, :, None]).clamp(-top, top).view(local, n_pad, k)[:, :n]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.transpose(1, 2)


# -- training: torchao's row-wise MoE recipe through the expert ops ------------------------------------------------
E4M3 = torch.float8_e4m3fn
EPS = 1e-12  # torchao.float8.float8_utils.EPS


def cast_rowwise(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's axis-wise cast (its Triton kernels' arithmetic): ``t`` as e4m3, one scale per slice along ``dim``
    (``448 / max(amax, 1e-12)`` in fp64, to fp32, rounded down to a power of 2), saturated; returns the fp8 tensor
    and the dequantisation scales (the reciprocals, exact: powers of 2), fp32, ``dim`` kept with size 1."""
    top = torch.finfo(E4M3).max
    t = t.detach()
    amax = t.abs().amax(dim, keepdim=True).double()
    scale = torch.exp2(torch.floor(torch.log2((top / amax.clamp_min(EPS)).float())))
    q = (t.float() * scale).clamp(-top, top).to(E4M3)
    return q, scale.reciprocal()


def _weight_for(w: torch.Tensor, over: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``nn.Linear``-shaped ``w [L, N, K]`` cast for a GEMM that contracts its dimension ``over`` (2: ``x @
    w^T``, the forward; 1: ``dy @ w``, the input gradient), as the ops take it: ``[L, contracted, other]`` column-major
    (a ``transpose(1, 2)`` view of dense fp8) and its row-wise scales ``[L, other]``."""
    dense = w if over == 2 else w.transpose(1, 2)
    q, s = cast_rowwise(dense.contiguous(), 2)
    return q.transpose(1, 2), s.squeeze(2)


def _row_experts(count: int, seg_starts: torch.Tensor, seg_ends: torch.Tensor, local: int,
                 device: torch.device) -> torch.Tensor:
    """Each of ``count`` received rows' local expert (segments ordered by (source, local expert)); ``local`` for
    rows of no segment (bounded mode's padding)."""
    segments = seg_ends.numel()
    index = torch.arange(count, device=device)
    seg = torch.searchsorted(seg_ends.to(torch.int64), index, right=True)
    clamped = seg.clamp(max=max(segments - 1, 0))
    inside = (seg < segments) & (index >= seg_starts.to(torch.int64)[clamped])
    return torch.where(inside, clamped % local, local)


def _cast_groups(t: torch.Tensor, expert: torch.Tensor, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-group column-wise cast: ``t [R, C]`` as e4m3 with one scale per (expert, column) over that
    expert's rows (``expert [R]``; rows of expert ``local``, padding, are zeroed); the dequantisation scales
    ``[local + 1, C]``."""
    top = torch.finfo(E4M3).max
    t = torch.where((expert < local)[:, None], t.detach().float(), 0.0)
    amax = t.new_zeros((local + 1, t.shape[1])).scatter_reduce_(0, expert[:, None].expand_as(t), t.abs(), "amax")
    scale = torch.exp2(torch.floor(torch.log2((top / amax.double().clamp_min(EPS)).float())))
    q = (t * scale.index_select(0, expert)).clamp(-top, top).to(E4M3)
    return q, scale.reciprocal()


def weight_grad(grads: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor, seg_ends: torch.Tensor,
                local: int, dtype: torch.dtype) -> torch.Tensor:
    """``grad_w [L, N, K]`` (``nn.Linear``-shaped), ``grad_w[l] = grads[rows of l]^T @ rows[rows of l]`` in fp8 as
    torchao's ``_Float8GroupedMM`` computes its weight gradient: both operands cast per (expert, column)
    (``_cast_groups``), the product accumulated in fp32, rounded to ``dtype``. CUDA: ``torch._scaled_grouped_mm``
    on the rows in expert order, each expert's group padded to 16 rows; elsewhere the fp8 values' product in fp32
    (no host synchronisation either way)."""
    count, device = grads.shape[0], grads.device
    expert = _row_experts(count, seg_starts, seg_ends, local, device)
    gq, gs = _cast_groups(grads, expert, local)
    xq, xs = _cast_groups(rows, expert, local)
    n, k = grads.shape[1], rows.shape[1]
    if device.type == "cuda":
        per_expert = torch.zeros(local + 1, dtype=torch.int64, device=device).index_add_(
            0, expert, torch.ones_like(expert))[:local]
        padded = (per_expert + 15) // 16 * 16
        ends = torch.cumsum(padded, 0)
        order = torch.sort(expert, stable=True).indices
        first = torch.cumsum(per_expert, 0) - per_expert  # each expert's first row in expert order
        sorted_expert = expert.index_select(0, order)
        inside = sorted_expert < local
        e = sorted_expert.clamp(max=local - 1)
        rank_in = torch.arange(count, device=device) - first.index_select(0, e)
        total = -(-(count + 16 * local + 1) // 16) * 16
        dest = torch.where(inside, (ends - padded).index_select(0, e) + rank_in, total - 1)  # padding: a dead row
        a_t = torch.zeros((n, total), dtype=torch.uint8, device=device)
        b_t = torch.zeros((k, total), dtype=torch.uint8, device=device)
        a_t.index_copy_(1, dest, gq.view(torch.uint8).index_select(0, order).t())
        b_t.index_copy_(1, dest, xq.view(torch.uint8).index_select(0, order).t())
        out = torch._scaled_grouped_mm(a_t.view(E4M3), b_t.view(E4M3).t(), gs[:local].reshape(-1).contiguous(),
                                       xs[:local].reshape(-1).contiguous(), offs=ends.to(torch.int32),
                                       out_dtype=torch.bfloat16 if dtype != torch.float32 else torch.float32)
        return out.to(dtype)
    # Elsewhere (the CPU): every expert's product at once through a one-hot of the rows' experts, fp32 (products of
    # fp8 values are exact in fp32), no host synchronisation (torch.compile traces it whole).
    onehot = (expert[:, None] == torch.arange(local, device=device)).float()  # padding rows: no expert
    spread = (onehot[:, :, None] * gq.float()[:, None, :]).reshape(count, local * n)
    out = (spread.t() @ xq.float()).reshape(local, n, k)
    return (out * gs[:local, :, None] * xs[:local, None, :]).to(dtype)


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


class _Fp8Dispatch(torch.autograd.Function):
    """``h = moe_dispatch_gemm(x, w13^T)`` in torchao's row-wise fp8 (module docstring); ``w13 [L, 2F, H]``."""

    @staticmethod
    def forward(ctx, x, w13, layout, group, path):
        from flashoverlap.ops import moe_library
        from flashoverlap.ops.library import group_name

        xq, sx = cast_rowwise(x, 1)
        wq, sw = _weight_for(w13, 2)
        values, name = moe_library.layout_values(layout), group_name(group, "Float8ExpertParallelMLP")
        tensors = list(layout.tensors())
        h, recv = torch.ops.flashoverlap.moe_dispatch_scaled(xq, sx, wq, sw, tensors, name, values, False, path,
                                                             _out_dtype(x.dtype))
        ctx.save_for_backward(w13, recv, *tensors)
        ctx.call = (name, values, path, x.dtype, x.shape[1])
        return h.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_h):
        from flashoverlap.comm.expert.scaled import unpack

        w13, recv, *layout = ctx.saved_tensors
        name, values, path, dtype, hidden = ctx.call
        grad_h = grad_h.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq, gs = cast_rowwise(grad_h, 1)
            wq, sw = _weight_for(w13, 1)
            out, _ = torch.ops.flashoverlap.moe_combine_scaled(gq, gs, wq, sw, None, layout, name, values, path,
                                                               _out_dtype(dtype))
            grad_x = out.to(dtype)
        if ctx.needs_input_grad[1]:
            q, s = unpack(recv, hidden, E4M3, 1)
            rows = q.float() * s  # exact: fp8 times a power of 2
            grad_w = weight_grad(grad_h, rows, layout[4], layout[5], w13.shape[0], w13.dtype)
        return grad_x, grad_w, None, None, None


class _Fp8Combine(torch.autograd.Function):
    """``y = moe_gemm_combine(a, w2^T, topk_weights)`` in torchao's row-wise fp8 (module docstring); ``w2 [L, H,
    F]``."""

    @staticmethod
    def forward(ctx, a, w2, topk_weights, layout, group, path):
        from flashoverlap.ops import moe_library
        from flashoverlap.ops.library import group_name

        aq, sa = cast_rowwise(a, 1)
        wq, sw = _weight_for(w2, 2)
        values, name = moe_library.layout_values(layout), group_name(group, "Float8ExpertParallelMLP")
        tensors = list(layout.tensors())
        y, back = torch.ops.flashoverlap.moe_combine_scaled(aq, sa, wq, sw, topk_weights, tensors, name, values,
                                                            path, _out_dtype(a.dtype))
        ctx.save_for_backward(a, w2, topk_weights, back, *tensors)
        ctx.call = (name, values, path)
        return y.to(a.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        from flashoverlap.comm.expert.scaled import unpack

        a, w2, topk_weights, back, *layout = ctx.saved_tensors
        name, values, path = ctx.call
        top_k = values[1]
        send_order, send_rows = layout[0], layout[1]
        grad_y = grad_y.contiguous()
        tokens, hidden = grad_y.shape
        grad_a = grad_w = grad_weights = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # Each choice's gradient row, rounded to the rows' dtype as the unsharded model's autograd gives it.
            per_choice = (grad_y.float()[:, None, :] * topk_weights.float()[:, :, None]).to(a.dtype)
            pq, ps = cast_rowwise(per_choice.reshape(tokens * top_k, hidden), 1)
            wq, sw = _weight_for(w2, 1)
            grad_a, g_recv = torch.ops.flashoverlap.moe_dispatch_scaled(pq, ps, wq, sw, layout, name, values, True,
                                                                        path, _out_dtype(a.dtype))
            grad_a = grad_a.to(a.dtype)
            if ctx.needs_input_grad[1]:
                q, s = unpack(g_recv, hidden, E4M3, 1)
                grad_w = weight_grad(q.float() * s, a, layout[4], layout[5], w2.shape[0], w2.dtype)
        if ctx.needs_input_grad[2]:
            token = torch.div(send_order, top_k, rounding_mode="floor")
            dots = (grad_y.float().index_select(0, token) * back.index_select(0, send_rows).float()).sum(1)
            grad_weights = dots.new_empty(tokens * top_k).index_copy_(0, send_order, dots)
            grad_weights = grad_weights.view(tokens, top_k).to(topk_weights.dtype)
        return grad_a if ctx.needs_input_grad[0] else None, grad_w, grad_weights, None, None, None


def experts_forward(layer: torch.nn.Module, rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, routing, scaling: str) -> torch.Tensor:
    """``ExpertParallelMLP``'s experts in fp8 (``scaling`` ``"row"``: torchao's training recipe, with autograd;
    ``"block"``: inference, the weights cast to 128x128 blocks), ``rows [T, H]`` -> ``[T, H]``. The weights are cast
    at every call, nothing kept between calls (a kept cast goes stale, silently, after a write that autograd's version
    counter does not see, such as ``w.data.copy_(...)``): ``Float8ExpertParallelMLP`` holds the weights cast once."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (rows, w13, w2, topk_weights))
    if scaling == "block":
        if grad:
            raise ValueError("ExpertParallelMLP: fp8='block' runs forward only (inference); call it under "
                             "torch.no_grad(), or train with fp8='row'")
        return fp8_inference(layer, rows, *quantise_weight(w13, "block"), *quantise_weight(w2, "block"),
                             topk_weights, routing)
    if grad:
        h = _Fp8Dispatch.apply(rows, w13, routing, layer.group, layer.path)
        a = F.silu(h[:, : layer.ffn]) * h[:, layer.ffn :]
        return _Fp8Combine.apply(a, w2, topk_weights, routing, layer.group, layer.path)
    # No autograd: the public ops, the same casts as the training forward's.
    xq, sx = cast_rowwise(rows, 1)
    w13q, s13 = _weight_for(w13, 2)
    h = moe_dispatch_gemm(xq, w13q, routing, layer.group, path=layer.path, scale_x=sx, scale_w=s13,
                          out_dtype=_out_dtype(rows.dtype)).to(rows.dtype)
    a = F.silu(h[:, : layer.ffn]) * h[:, layer.ffn :]
    aq, sa = cast_rowwise(a, 1)
    w2q, s2 = _weight_for(w2, 2)
    return moe_gemm_combine(aq, w2q, topk_weights, routing, layer.group, path=layer.path, scale_a=sa, scale_w=s2,
                            out_dtype=_out_dtype(rows.dtype)).to(rows.dtype)


def fp8_inference(layer: torch.nn.Module, rows: torch.Tensor, w13q: torch.Tensor, s13: torch.Tensor,
                  w2q: torch.Tensor, s2: torch.Tensor, topk_weights: torch.Tensor, routing) -> torch.Tensor:
    """The fp8 inference experts (``Float8ExpertParallelMLP``, and ``ExpertParallelMLP(fp8="block")`` on its
    per-call casts): ``rows [T, H]`` quantised by the ops, the weights as ``quantise_weight`` returns them; the
    GEMMs' output bf16 (fp32 for fp32 rows), SwiGLU in fp32 rounded to that dtype; ``[T, H]`` in the rows' dtype."""
    out = _out_dtype(rows.dtype)
    h = moe_dispatch_gemm(rows, w13q.transpose(1, 2), routing, layer.group, path=layer.path, scale_w=s13,
                          out_dtype=out)
    a = (F.silu(h[:, : layer.ffn].float()) * h[:, layer.ffn :].float()).to(out)
    return moe_gemm_combine(a, w2q.transpose(1, 2), topk_weights, routing, layer.group, path=layer.path,
                            scale_w=s2, out_dtype=out).to(rows.dtype)


def torchao_weight(w: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """``(the plain weight, differentiably unwrapped, "row")`` for an expert weight converted by torchao's MoE
    training conversion (``Float8TrainingOpConfig``: row-wise fp8, what ``experts_forward`` runs); None for a plain
    tensor. Other torchao training configs (MXFP8) raise."""
    if type(w) in (torch.Tensor, torch.nn.Parameter) or not hasattr(w, "config") or not hasattr(w, "_data"):
        return None
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor
        from torchao.prototype.moe_training.utils import unwrap_weight
    except ImportError:
        return None
    if not isinstance(w, TrainingWeightWrapperBaseTensor):
        return None
    config = w.config
    if not isinstance(config, Float8TrainingOpConfig):
        raise NotImplementedError(f"ExpertParallelMLP: expert weights converted by torchao with "
                                  f"{type(config).__name__}; flashoverlap's fp8 experts run torchao's row-wise "
                                  "recipe (Float8TrainingOpConfig) only")
    if config.float8_dtype != E4M3 or config.out_dtype not in (torch.bfloat16, None):
        raise NotImplementedError(f"ExpertParallelMLP: torchao's Float8TrainingOpConfig with float8_dtype="
                                  f"{config.float8_dtype}, out_dtype={config.out_dtype}; flashoverlap's fp8 experts "
                                  "run float8_e4m3fn with bf16 outputs")
    return unwrap_weight(w), "row"
