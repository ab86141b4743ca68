"""fp8 expert-parallel MoE: training (row-wise, torchao's MoE recipe) and inference (row- or block-wise).

Training, ``ExpertParallelMLP(..., fp8="row")`` (or expert weights converted by torchao's MoE training conversion,
``torchao.quantization.quantize_(layer, Float8TrainingOpConfig())``, used as they are): the bf16 parameters stay the
master weights; every call casts, as ``torchao.prototype.moe_training``'s ``_Float8GroupedMM`` does (e4m3, one scale
per row of the contracted dimension, scales rounded down to powers of 2, saturated casts), for each of the three GEMMs
of each projection (``L`` local experts, ``R`` received rows):

- forward ``h = x @ w13^T``: ``x`` row-wise over ``H`` (before the dispatch: the rows cross the wire as fp8 with one
  scale each), ``w13 [L, 2F, H]`` per (expert, output column) over ``H``; ``y = a @ w2^T`` likewise (``a`` row-wise
  over ``F``, ``w2`` per (expert, output column) over ``F``); the ops' fp8 grouped GEMM, bf16 out;
- input gradients ``dy @ w``: the output gradient row-wise, the weight per (expert, input column) over the output
  dimension; they run through the same fp8 ops as the bf16 layer's backward runs through its ops (``dx``: the
  unweighted combine of ``dh``, the reverse all-to-all of bf16 rows; ``da``: the per-choice dispatch of the router-
  weighted ``dy``, fp8 rows with their scales on the wire);
- weight gradients ``dy^T @ x`` per expert: both operands cast per (expert, column) over that expert's rows (torchao's
  per-group column-wise scales), the product in fp32 (``torch._scaled_grouped_mm`` on CUDA, expert groups padded to
  16 rows; a dequantised fp32 product elsewhere), bf16 out.

What crosses the wire changes nothing: the weight gradients' row operand is the received fp8 rows (``x`` for
``w13``'s, the per-choice gradient rows for ``w2``'s) dequantised (exactly: powers of 2) and cast again per expert
column, where torchao casts the bf16 rows once; rounding to fp8's 3 mantissa bits twice, at power-of-2 scales, is
rounding once (but where the row cast left a value subnormal or rounded a column's largest past 448), so the
weight gradients equal torchao's. One
difference: ``w13`` is one GEMM for the gate and up projections, its input gradient's ``dh`` cast over ``2F`` where
torchao casts the two ``F`` halves apart. The tests measure the layer against torchao's unsharded model on the CPU
(``tests/moe/test_fp8_training.py``: its error against fp64 0.999..1.005x torchao's own, weight gradients bit-equal).

Inference, ``Float8ExpertParallelMLP.from_float(layer, scaling)``: an ``ExpertParallelMLP`` whose experts' weights are
held in fp8 with row-wise (``[L, N]``) or 128x128 block scales (DeepSeek-V3's blocks), running the fp8 expert ops
(``ops/moe.py``): each token's row is quantised (one scale per row, or per 128 channels), dispatched as fp8 with its
scales, multiplied in fp8; the SwiGLU intermediate is quantised again for the second projection; combine returns
bf16 (fp32 for fp32 inputs), and the layer the input's dtype. Forward only; a call that needs gradients raises.
``ExpertParallelMLP(..., fp8="block")`` is the same numerics with the weights cast at every call (inference only
too).
"""

from __future__ import annotations

import torch

from flashoverlap.nn.fp8_experts import (  # noqa: F401 (the training mechanics, kept importable from here)
    _cast_groups,
    _Fp8Combine,
    _Fp8Dispatch,
    cast_rowwise,
    check_block_widths,
    experts_forward,
    fp8_inference,
    quantise_weight,
    torchao_weight,
    weight_grad,
)
from flashoverlap.nn.moe import ExpertParallelMLP
from flashoverlap.ops.moe import moe_layout

SCALINGS = ("row", "block")


class Float8ExpertParallelMLP(ExpertParallelMLP):
    """``ExpertParallelMLP`` with fp8 experts for inference (see the module docstring). Build it from a bf16 layer
    with ``from_float(layer, scaling)``, which converts ``layer`` in place and returns it; ``scaling`` ``"row"`` or
    ``"block"``. The fp8 weights and their scales are buffers (``w13_fp8``, ``w13_scale``, ``w2_fp8``,
    ``w2_scale``) that keep their dtypes under ``.to(dtype)``; the bf16 parameters are dropped."""

    scaling: str

    @classmethod
    def from_float(cls, layer: ExpertParallelMLP, scaling: str = "block") -> Float8ExpertParallelMLP:
        if scaling not in SCALINGS:
            raise ValueError(f"Float8ExpertParallelMLP: scaling must be one of {SCALINGS}, got {scaling!r}")
        if not isinstance(layer, ExpertParallelMLP) or isinstance(layer, Float8ExpertParallelMLP):
            raise TypeError("Float8ExpertParallelMLP.from_float takes a (bf16) ExpertParallelMLP")
        if scaling == "block":
            check_block_widths("Float8ExpertParallelMLP.from_float: scaling", layer.hidden, layer.ffn)
        w13, s13 = quantise_weight(layer.w13, scaling)
        w2, s2 = quantise_weight(layer.w2, scaling)
        layer.__class__ = cls
        layer.scaling = scaling
        layer.fp8 = None  # the weights are fp8 themselves (extra_repr says which)
        layer.register_buffer("w13_fp8", w13)
        layer.register_buffer("w13_scale", s13)
        layer.register_buffer("w2_fp8", w2)
        layer.register_buffer("w2_scale", s2)
        layer.dtype = layer.w13.dtype
        del layer.w13, layer.w2
        return layer

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                *, logits: torch.Tensor | None = None) -> torch.Tensor:
        rows, topk_idx, topk_weights = self.routing(x, topk_idx, topk_weights, logits)
        # Before the layout and the dispatch (the routing is local): router weights that need a gradient (from x
        # through the gate, the gate's parameters, or the caller's) would otherwise be refused by the combine, after
        # the dispatch's all-to-all, by a name the caller never passed.
        if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
            raise ValueError("Float8ExpertParallelMLP: fp8 experts run forward only (inference); call it under "
                             "torch.no_grad() or torch.inference_mode()")
        routing = moe_layout(topk_idx, self.num_experts, self.group, mode=self.mode, bound=self.bound)
        return fp8_inference(self, rows, self.w13_fp8, self.w13_scale, self.w2_fp8, self.w2_scale, topk_weights,
                             routing).view(x.shape)

    _KEPT = ("w13_fp8", "w13_scale", "w2_fp8", "w2_scale")  # their dtypes are the format: .to(dtype) keeps them

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module``'s, but the fp8 weights and their fp32 scales keep their dtypes: ``.to(torch.bfloat16)`` or
        ``.half()`` (fp8 counts as floating point there) would have cast them, and the next call failed. A move to
        another device still moves them."""
        before = {name: self._buffers[name] for name in self._KEPT if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, kept in before.items():
            moved = self._buffers[name]
            if moved.dtype != kept.dtype:
                self._buffers[name] = kept.to(device=moved.device)
        return self

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={self.scaling!r}"
