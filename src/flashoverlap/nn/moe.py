"""An expert-parallel SwiGLU MoE layer on flashoverlap's all-to-all ops, and the plain block it shards.

Shapes, for a group of ``W`` ranks, rank r, ``E`` experts (``L = E / W`` here: experts ``[r*L, (r+1)*L)``), hidden
``H``, expert FFN ``F``, tokens flattened to rows (``T`` on this rank), top-k routing:

- ``MoEBlock`` (plain PyTorch, unsharded; the reference): ``gate: Linear(H, E)``, experts ``e`` with
  ``w1, w3: [F, H]`` and ``w2: [H, F]`` (``nn.Linear`` weights); ``y[t] = sum_c p[t, c] * w2_e (silu(w1_e x[t]) *
  w3_e x[t])`` over the top-k experts ``e = idx[t, c]`` of ``softmax(gate(x[t]))``, ``p`` renormalised over the k
  (Mixtral; Qwen3-MoE with ``norm_topk_prob``).
- ``ExpertParallelMLP``: rank r holds ``w13_r: [L, 2F, H]`` (its experts' ``w1`` then ``w3``, stacked) and
  ``w2_r: [L, H, F]``, and (optionally) the whole gate. ``x_r: [T, H]`` -> ``moe_layout`` of the routing ->
  ``h_r = moe_dispatch_gemm(x_r, w13_r^T)``: ``[R_r, 2F]`` -> ``a_r = silu(h_r[:, :F]) * h_r[:, F:]`` ->
  ``y_r = moe_gemm_combine(a_r, w2_r^T, p_r)``: ``[T, H]``, this rank's tokens. The router is given as top-k
  indices and weights, or as logits, or computed by the layer's own gate.

Backward: the ops' autograd (``ops/moe_library.py``) gives ``x``, ``w13``, ``w2`` and the router weights their
gradients (the gate's through the router weights).

fp8 (``fp8="row"``, ``nn/fp8_moe.py``): the bf16 parameters stay the master weights; each call runs torchao's row-wise
fp8 MoE training recipe through the fp8 expert ops (the forward GEMMs and both backward GEMMs of each projection in
fp8 with power-of-2 row-wise scales, the rows dispatched as fp8 with their scales, gradients bf16). ``fp8="block"``:
inference with one scale per 128x128 block of the weights and per 1x128 block of the rows, cast at each call (a call
that needs gradients raises). Expert weights converted by torchao's MoE training conversion
(``torchao.quantization.quantize_(layer, Float8TrainingOpConfig())``) run ``fp8="row"`` with ``fp8=None`` or
``"row"``; ``fp8="block"`` with them raises (their recipe is row-wise).

The gate is replicated: with data parallelism over the expert group, its gradient is summed by the data-parallel
reduction like any replicated parameter.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine, moe_layout
from flashoverlap.runtime.policy import EXPERT_PATHS, check_path_name


def route(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: ``(topk_idx [T, k] int64, topk_weights [T, k])`` from ``logits [T, E]``. The softmax
    in fp32 over all experts, the k largest, renormalised to sum 1 where ``normalize``; weights returned in the
    logits' dtype (as Mixtral and Qwen3-MoE do)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx, weights.to(logits.dtype)


def check_routing_shapes(where: str, x: torch.Tensor, hidden: int, num_experts: int,
                         topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                         logits: torch.Tensor | None = None) -> None:
    """``x [..., H]`` and the routing given with it (``topk_idx``/``topk_weights [..., k]``, ``logits [..., E]``,
    their leading dimensions ``x``'s or flattened ``[T]``), checked before anything runs: a wrong width would
    otherwise be reshaped into other rows without an error."""
    if x.dim() == 0 or x.shape[-1] != hidden:
        raise ValueError(f"{where}: x must be [..., H = {hidden}], got {list(x.shape)}")
    lead, tokens = tuple(x.shape[:-1]), math.prod(x.shape[:-1])
    for name, t, last in (("topk_idx", topk_idx, None), ("topk_weights", topk_weights, None),
                          ("logits", logits, num_experts)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        flat = x.dim() <= 2 and math.prod(t.shape[:-1]) == tokens  # x's rows flattened already: routing any shape
        if t.dim() == 0 or (tuple(t.shape[:-1]) not in (lead, (tokens,)) and not flat) or (
                last is not None and t.shape[-1] != last):
            want = f"[..., E = {last}]" if last is not None else "[..., k]"
            raise ValueError(f"{where}: {name} must be {want} with x's leading dimensions {list(lead)} (or "
                             f"[{tokens}, ...]), got {list(t.shape)}")
    if topk_idx is not None and topk_weights is not None and topk_idx.shape[-1] != topk_weights.shape[-1]:
        raise ValueError(f"{where}: topk_idx {list(topk_idx.shape)} and topk_weights {list(topk_weights.shape)} "
                         "must have the same k")


class MoEExpert(nn.Module):
    """One SwiGLU expert: ``w2(silu(w1(x)) * w3(x))``, ``w1, w3: Linear(H, F)``, ``w2: Linear(F, H)``, no bias."""

    def __init__(self, hidden: int, ffn: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(hidden, ffn, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(ffn, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEBlock(nn.Module):
    """The plain (unsharded) MoE block of the common shape: a gate ``Linear(H, E)`` and ``E`` SwiGLU experts,
    softmax top-k routing (see the module docstring). Loops over experts: a reference, not a fast layer."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *, normalize: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.hidden, self.ffn, self.num_experts, self.top_k, self.normalize = hidden, ffn, num_experts, top_k, normalize
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = nn.ModuleList(MoEExpert(hidden, ffn, device, dtype) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``; the routing from the gate unless given (``[..., k]`` each)."""
        check_routing_shapes("MoEBlock", x, self.hidden, self.num_experts, topk_idx, topk_weights)
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("MoEBlock: pass topk_idx with topk_weights, or neither (the gate routes)")
        rows = x.reshape(-1, self.hidden)
        if topk_idx is None:
            topk_idx, topk_weights = route(self.gate(rows), self.top_k, self.normalize)
        topk_idx = topk_idx.reshape(rows.shape[0], topk_idx.shape[-1])  # [..., k] -> [T, k], T may be 0
        topk_weights = topk_weights.reshape(rows.shape[0], topk_weights.shape[-1])
        if rows.shape[0] == 0:  # no rows, no expert runs: the (empty) output still hangs off x's graph, as a plain
            return (rows * 1).view(x.shape)  # block's would, so that backward() on it runs
        out = torch.zeros_like(rows, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            token, choice = torch.nonzero(topk_idx == e, as_tuple=True)
            if token.numel():
                y = expert(rows[token]) * topk_weights[token, choice, None]
                out = out.index_add(0, token, y.float())
        return out.to(x.dtype).view(x.shape)


class ExpertParallelMLP(nn.Module):
    """SwiGLU experts sharded over ``group``, tokens moved by flashoverlap's all-to-all ops (see the module
    docstring). ``gate=True`` adds a replicated router ``Linear(H, E)`` so that ``forward(x)`` routes by itself.

    Args:
        hidden, ffn, num_experts, top_k: ``H``, ``F``, ``E`` (a multiple of the group's size), ``k``.
        group: the expert-parallel process group (default: the world).
        gate: hold a router ``Linear(H, E)`` (no bias), replicated on every rank.
        normalize: renormalise the top-k router weights (Mixtral, Qwen3-MoE ``norm_topk_prob``).
        mode, bound: as ``flashoverlap.moe_layout`` (``"bounded"`` for CUDA graphs and ``fullgraph=True``).
        path: as ``flashoverlap.moe_dispatch_gemm``.
        fp8: None (the parameters' dtype), ``"row"`` (fp8 training, torchao's row-wise MoE recipe; inference too) or
            ``"block"`` (fp8 inference, 128x128 weight blocks); see the module docstring.
        device, dtype: of the parameters (bf16/fp16 for the overlapped paths; fp32 runs too).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *, group: dist.ProcessGroup | None = None,
                 gate: bool = False, normalize: bool = True, mode: str = "exact", bound: int | None = None,
                 path: str = "auto", fp8: str | None = None, device=None, dtype=None) -> None:
        super().__init__()
        if fp8 not in (None, "row", "block"):
            raise ValueError(f"ExpertParallelMLP: fp8 must be None, 'row' (training) or 'block' (inference), "
                             f"got {fp8!r}")
        if fp8 == "block":
            from flashoverlap.nn.fp8_experts import check_block_widths

            check_block_widths("ExpertParallelMLP: fp8", hidden, ffn)
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelMLP: torch.distributed is not initialised; call "
                               "dist.init_process_group()")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if num_experts % self.world_size:
            raise ValueError(f"ExpertParallelMLP: num_experts = {num_experts} must be divisible by the group's "
                             f"{self.world_size} ranks (each holds num_experts / {self.world_size})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"ExpertParallelMLP: top_k = {top_k} must lie in [1, num_experts = {num_experts}]")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.local_experts = num_experts // self.world_size
        self.normalize, self.mode, self.bound, self.fp8 = normalize, mode, bound, fp8
        self.path = check_path_name("ExpertParallelMLP", path, EXPERT_PATHS)
        self.w13 = nn.Parameter(torch.empty((self.local_experts, 2 * ffn, hidden), device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty((self.local_experts, hidden, ffn), device=device, dtype=dtype))
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype) if gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Each expert's linears as nn.Linear initialises them (bounds from their own fan-in).
        nn.init.uniform_(self.w13, -1 / math.sqrt(self.hidden), 1 / math.sqrt(self.hidden))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.ffn), 1 / math.sqrt(self.ffn))

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.local_experts

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                *, logits: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``, this rank's tokens. Routing: ``topk_idx`` and ``topk_weights``
        (``[..., k]`` each), or ``logits [..., E]`` (softmax top-k), or neither (the layer's gate)."""
        if x.dtype != self.w13.dtype:  # before the gate, whose own matmul would refuse it less clearly
            raise ValueError(f"ExpertParallelMLP: the input x is {x.dtype} but the experts' weights are "
                             f"{self.w13.dtype}; cast one to the other")
        rows, topk_idx, topk_weights = self.routing(x, topk_idx, topk_weights, logits)
        routing = moe_layout(topk_idx, self.num_experts, self.group, mode=self.mode, bound=self.bound)
        w13, w2, fp8 = self.w13, self.w2, self.fp8
        if type(w13) not in (nn.Parameter, torch.Tensor) or type(w2) not in (nn.Parameter, torch.Tensor):
            w13, w2, fp8 = self._converted(w13, w2, fp8)
        if fp8 is not None:
            from flashoverlap.nn.fp8_experts import experts_forward

            return experts_forward(self, rows, w13, w2, topk_weights, routing, fp8).view(x.shape)
        h = moe_dispatch_gemm(rows, self.w13.transpose(1, 2), routing, self.group, path=self.path)
        a = F.silu(h[:, : self.ffn]) * h[:, self.ffn :]
        y = moe_gemm_combine(a, self.w2.transpose(1, 2), topk_weights, routing, self.group, path=self.path)
        return y.view(x.shape)

    @staticmethod
    def _converted(w13: torch.Tensor, w2: torch.Tensor, fp8: str | None) -> tuple[torch.Tensor, torch.Tensor, str]:
        """Expert weights converted by torchao's MoE training conversion: the plain weights and ``"row"``."""
        from flashoverlap.nn.fp8_experts import torchao_weight

        got13, got2 = torchao_weight(w13), torchao_weight(w2)
        if got13 is None or got2 is None:
            raise TypeError(f"ExpertParallelMLP: w13 is {type(w13).__name__} and w2 {type(w2).__name__}: convert "
                            "both experts' weights with torchao's MoE training conversion, or neither")
        if fp8 == "block":
            raise ValueError("ExpertParallelMLP: fp8='block' with weights converted by torchao's MoE training "
                             "conversion (row-wise): build the layer with fp8=None or 'row'")
        return got13[0], got2[0], "row"

    def routing(self, x: torch.Tensor, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
                logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows [T, H], topk_idx [T, k], topk_weights [T, k])`` of a forward's arguments (see ``forward``)."""
        where = type(self).__name__
        check_routing_shapes(where, x, self.hidden, self.num_experts, topk_idx, topk_weights, logits)
        rows = x.reshape(-1, self.hidden)
        if topk_idx is not None:
            if topk_weights is None or logits is not None:
                raise ValueError("ExpertParallelMLP: pass topk_idx with topk_weights, or logits, or neither")
        else:
            if topk_weights is not None:
                raise ValueError("ExpertParallelMLP: topk_weights needs topk_idx")
            if logits is None:
                if self.gate is None:
                    raise ValueError("ExpertParallelMLP: no routing given and the layer has no gate; pass "
                                     "topk_idx and topk_weights, or logits, or build it with gate=True")
                if x.dtype != self.gate.weight.dtype and not torch.is_autocast_enabled(x.device.type):
                    # (the gate's matmul would refuse it less clearly; autocast casts them alike)
                    raise ValueError(f"{where}: the input x is {x.dtype} but the gate's weight is "
                                     f"{self.gate.weight.dtype}; cast one to the other")
                logits = self.gate(rows)
            topk_idx, topk_weights = route(logits.reshape(rows.shape[0], logits.shape[-1]), self.top_k,
                                           self.normalize)  # (a rank with no tokens has no -1 to infer)
        # [..., k] -> [T, k] (k from the last dimension: a rank with no tokens has no -1 to infer)
        return (rows, topk_idx.reshape(rows.shape[0], topk_idx.shape[-1]),
                topk_weights.reshape(rows.shape[0], topk_weights.shape[-1]))

    @classmethod
    def from_moe_block(cls, block: MoEBlock, group: dist.ProcessGroup | None = None, *, mode: str = "exact",
                       bound: int | None = None, path: str = "auto", fp8: str | None = None) -> ExpertParallelMLP:
        """This rank's shard of ``block`` (its experts, and the whole gate), on the block's device and dtype."""
        weight = block.gate.weight
        layer = cls(block.hidden, block.ffn, block.num_experts, block.top_k, group=group, gate=True,
                    normalize=block.normalize, mode=mode, bound=bound, path=path, fp8=fp8, device=weight.device,
                    dtype=weight.dtype)
        with torch.no_grad():
            layer.gate.weight.copy_(weight)
            for i in range(layer.local_experts):
                expert = block.experts[layer.first_expert + i]
                layer.w13[i, : block.ffn].copy_(expert.w1.weight)
                layer.w13[i, block.ffn :].copy_(expert.w3.weight)
                layer.w2[i].copy_(expert.w2.weight)
        return layer

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.num_experts} ({self.local_experts} here: "
                f"{self.first_expert}..{self.first_expert + self.local_experts - 1}), top_k={self.top_k}, "
                f"mode={self.mode!r}, shard {self.rank}/{self.world_size}"
                + (f", fp8={self.fp8!r}" if self.fp8 else ""))
