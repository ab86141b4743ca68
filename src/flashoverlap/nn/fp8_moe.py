"""fp8 expert-parallel MoE inference: ``Float8ExpertParallelMLP``, an ``ExpertParallelMLP`` whose experts' weights are
held in fp8 with row-wise (``[L, N]``) or 128x128 block scales (DeepSeek-V3's layout), running the fp8 expert ops
(``ops/moe.py``): each token's row is quantised (one scale per row, or per 128 channels), dispatched as fp8 with its
scales, multiplied in fp8; the SwiGLU intermediate is quantised again for the second projection; combine returns the
input dtype (bf16). Forward only: the fp8 ops record no autograd (fp8 training, torchao's row-wise MoE recipe, is not
here yet); a call that needs gradients raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashoverlap.comm.scaled import BLOCK
from flashoverlap.nn.moe import ExpertParallelMLP
from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine, moe_layout

SCALINGS = ("row", "block")


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


class Float8ExpertParallelMLP(ExpertParallelMLP):
    """``ExpertParallelMLP`` with fp8 experts for inference (see the module docstring). Build it from a bf16 layer
    with ``from_float(layer, scaling)``; ``scaling`` ``"row"`` or ``"block"``. The fp8 weights and their scales are
    buffers (``w13_fp8``, ``w13_scale``, ``w2_fp8``, ``w2_scale``); the bf16 parameters are dropped to empty tensors."""

    scaling: str

    @classmethod
    def from_float(cls, layer: ExpertParallelMLP, scaling: str = "block") -> Float8ExpertParallelMLP:
        if scaling not in SCALINGS:
            raise ValueError(f"Float8ExpertParallelMLP: scaling must be one of {SCALINGS}, got {scaling!r}")
        if not isinstance(layer, ExpertParallelMLP) or isinstance(layer, Float8ExpertParallelMLP):
            raise TypeError("Float8ExpertParallelMLP.from_float takes a (bf16) ExpertParallelMLP")
        w13, s13 = quantise_weight(layer.w13, scaling)
        w2, s2 = quantise_weight(layer.w2, scaling)
        layer.__class__ = cls
        layer.scaling = scaling
        layer.register_buffer("w13_fp8", w13)
        layer.register_buffer("w13_scale", s13)
        layer.register_buffer("w2_fp8", w2)
        layer.register_buffer("w2_scale", s2)
        layer.dtype = layer.w13.dtype
        del layer.w13, layer.w2
        return layer

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                *, logits: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise ValueError("Float8ExpertParallelMLP: fp8 experts run forward only (inference); call it under "
                             "torch.no_grad() or torch.inference_mode()")
        rows, topk_idx, topk_weights = self.routing(x, topk_idx, topk_weights, logits)
        routing = moe_layout(topk_idx, self.num_experts, self.group, mode=self.mode, bound=self.bound)
        h = moe_dispatch_gemm(rows, self.w13_fp8.transpose(1, 2), routing, self.group, path=self.path,
                              scale_w=self.w13_scale, out_dtype=torch.bfloat16)
        a = F.silu(h[:, : self.ffn].float()) * h[:, self.ffn :].float()
        y = moe_gemm_combine(a.to(torch.bfloat16), self.w2_fp8.transpose(1, 2), topk_weights, routing, self.group,
                             path=self.path, scale_w=self.w2_scale, out_dtype=torch.bfloat16)
        return y.to(x.dtype).view(x.shape)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={self.scaling!r}"
