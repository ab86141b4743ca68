"""fp8 MoE training's test problems and the two unsharded models it is measured against (nothing here calls
flashoverlap):

- ``exact``: the unsharded SwiGLU MoE in fp64 (autograd): the truth;
- ``torchao_model``: the unsharded model as torchao's MoE training runs it (torchtitan's grouped experts: ``w1``,
  ``w3``, ``w2`` separate, tokens sorted by expert, one grouped GEMM per projection), its grouped GEMM torchao's
  ``_Float8GroupedMM`` with torchao's own CPU casts (``tensor_to_scale`` with power-of-2 axis-wise scales,
  ``to_fp8_saturated``, ``torch_to_float8_per_group_colwise`` for the weight gradients,
  ``torch_to_3d_rowwise_float8_transpose_rhs`` for the input gradients) and the dequantised products in fp64, rounded
  to bf16 as its GEMMs' outputs are. torchao's fp8 GEMM (``torch._scaled_grouped_mm``) and its Triton casts do not
  run on the CPU; these pieces are its reference implementations of the same casts. Its error against ``exact`` is
  torchao's own fp8-vs-exact error, the budget of the layer under test.

Errors are normwise: ``||got - want|| / ||want||`` over everything a rank holds, summed over the ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

H, FFN = 32, 32  # multiples of 16, as torchao's fp8 grouped GEMM asks
FP8 = torch.float8_e4m3fn
ROUTINGS = ("skewed", "rank-sends-none", "balanced")


def problem(world: int, routing: str, seed: int, local: int = 2, tokens: int = 12, top_k: int = 2) -> dict:
    """Every rank's bf16 tokens, routing, router weights and output gradient, and every expert's bf16 weights."""
    gen = torch.Generator().manual_seed(seed)
    experts = local * world
    zipf = (torch.arange(1, experts + 1, dtype=torch.float64) ** -1.2)[torch.randperm(experts, generator=gen)]
    xs, idxs, routers, grads = [], [], [], []
    for r in range(world):
        t = 0 if routing == "rank-sends-none" and r == 0 else tokens + r
        if routing == "balanced":
            idx = (torch.arange(t)[:, None] * top_k + torch.arange(top_k)[None, :] + r) % experts
        else:
            picked = torch.multinomial(zipf.expand(max(t, 1), -1), top_k, replacement=False, generator=gen)
            idx = picked[:t]
        xs.append(torch.randn(t, H, generator=gen).bfloat16())
        idxs.append(idx.reshape(t, top_k))
        routers.append(torch.softmax(torch.randn(t, top_k, generator=gen), -1).bfloat16())
        grads.append(torch.randn(t, H, generator=gen).bfloat16())
    w13 = (torch.randn(experts, 2 * FFN, H, generator=gen) / H**0.5).bfloat16()  # [w1; w3], nn.Linear-shaped
    w2 = (torch.randn(experts, H, FFN, generator=gen) / FFN**0.5).bfloat16()
    return {"x": xs, "idx": idxs, "router": routers, "grad": grads, "w13": w13, "w2": w2, "experts": experts,
            "local": local, "top_k": top_k}


def _all(p: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.cat(p["x"]), torch.cat(p["idx"]), torch.cat(p["router"]), torch.cat(p["grad"])


def exact(p: dict) -> dict:
    """The fp64 unsharded model's output and gradients (``y``, ``dx``, ``drouter`` over all ranks' tokens in rank
    order; ``dw13``, ``dw2`` of every expert)."""
    x, idx, router, grad = (t.double() if t.is_floating_point() else t for t in _all(p))
    x.requires_grad_()
    router.requires_grad_()
    w13 = p["w13"].double().requires_grad_()
    w2 = p["w2"].double().requires_grad_()
    h = torch.einsum("tcnh,th->tcn", w13[idx], x)
    a = F.silu(h[..., :FFN]) * h[..., FFN:]
    y = (router[..., None] * torch.einsum("tchf,tcf->tch", w2[idx], a)).sum(1)
    (y * grad).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "drouter": router.grad, "dw13": w13.grad, "dw2": w2.grad}


def _scale(t: torch.Tensor, dim: int) -> torch.Tensor:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale

    return tensor_to_scale(t, FP8, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                           round_scales_to_power_of_2=True)


def _deq(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` cast to fp8 with torchao's axis-wise power-of-2 scale along ``dim``, dequantised in fp64."""
    from torchao.float8.float8_utils import to_fp8_saturated

    scale = _scale(t, dim)
    return to_fp8_saturated(t.float() * scale, FP8).double() / scale.double()


class _TorchaoGroupedMM(torch.autograd.Function):
    """torchao's ``_Float8GroupedMM`` (``A [M, K] @ B_t [E, K, N]``, groups by ``offs``) with its CPU casts and fp64
    dequantised products, bf16 out."""

    @staticmethod
    def forward(ctx, a, b_t, offs):
        ctx.save_for_backward(a, b_t, offs)
        a_d, b_d = _deq(a, -1), _deq(b_t, -2)  # A row-wise over K; B per (expert, column n) over K
        out = torch.zeros(a.shape[0], b_t.shape[2], dtype=torch.float64)
        start = 0
        for e, end in enumerate(offs.tolist()):
            out[start:end] = a_d[start:end] @ b_d[e]
            start = end
        return out.bfloat16()

    @staticmethod
    def backward(ctx, grad):
        from torchao.prototype.moe_training.utils import (
            torch_to_3d_rowwise_float8_transpose_rhs,
            torch_to_float8_per_group_colwise,
        )

        a, b_t, offs = ctx.saved_tensors
        grad = grad.contiguous()
        g_d = _deq(grad, -1)
        b_q, b_s = torch_to_3d_rowwise_float8_transpose_rhs(b_t, FP8, round_scales_to_power_of_2=True)
        b_d = b_q.double() / b_s.double()  # [E, N, K], one scale per (expert, k) over N
        ga = torch.zeros(a.shape, dtype=torch.float64)
        gb = torch.zeros(b_t.shape[0], grad.shape[1], a.shape[1], dtype=torch.float64)
        start = 0
        for e, end in enumerate(offs.tolist()):
            ga[start:end] = g_d[start:end] @ b_d[e]
            if end > start:  # torchao's per-group cast, one group at a time (its CPU reference takes no empty group)
                one = torch.tensor([end - start], dtype=torch.int32)
                gq, gs = torch_to_float8_per_group_colwise(grad[start:end], one, FP8, round_scales_to_power_of_2=True)
                aq, as_ = torch_to_float8_per_group_colwise(a[start:end], one, FP8, round_scales_to_power_of_2=True)
                gb[e] = (gq.double() / gs.double()).t() @ (aq.double() / as_.double())
            start = end
        return ga.bfloat16(), gb.bfloat16().transpose(1, 2), None


def torchao_model(p: dict) -> dict:
    """The unsharded model as torchao's fp8 MoE training runs it (module docstring), bf16 autograd."""
    x, idx, router, grad = _all(p)
    x = x.clone().requires_grad_()
    router = router.clone().requires_grad_()
    w13 = p["w13"].clone().requires_grad_()
    w2 = p["w2"].clone().requires_grad_()
    w1, w3 = w13[:, :FFN], w13[:, FFN:]
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    offs = torch.cumsum(torch.bincount(flat, minlength=p["experts"]), 0).to(torch.int32)
    rows = x[order // p["top_k"]]
    gmm = _TorchaoGroupedMM.apply
    a = F.silu(gmm(rows, w1.transpose(1, 2), offs)) * gmm(rows, w3.transpose(1, 2), offs)
    o = gmm(a, w2.transpose(1, 2), offs)
    weighted = (o.float() * router.reshape(-1)[order, None].float()).bfloat16()
    y = torch.zeros(x.shape, dtype=torch.float32).index_add(0, order // p["top_k"], weighted.float()).bfloat16()
    (y.float() * grad.float()).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "drouter": router.grad, "dw13": w13.grad, "dw2": w2.grad}


def errors(got: dict, want: dict) -> dict:
    """Normwise relative error of each quantity."""
    return {k: float((got[k].double() - want[k].double()).norm() / want[k].double().norm()) for k in want}
