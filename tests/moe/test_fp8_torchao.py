"""Expert weights converted by torchao's MoE training conversion (``quantize_(layer, Float8TrainingOpConfig())``:
the parameters become ``Float8TrainingWeightWrapperTensor``) used as they are by ``ExpertParallelMLP``.

On the CPU (gloo, W = 2; torchao's fp8 grouped GEMM does not run there): the converted layer takes the fp8 path
(output and every gradient bit-equal to ``fp8="row"`` on the same weights, the gradients plain bf16 tensors on the
converted parameters), within bf16 roundings of torchao's unsharded model with its CPU casts
(``fp8_training_cases.torchao_model``, the dequantised oracle); a converted gate (torchao's fp8 linear) runs beside
it; MXFP8-converted weights, one weight converted and not the other, and ``fp8="block"`` on converted weights raise.

On one GPU (a one-rank NCCL group; skipped without CUDA): the layer against the unsharded converted model (torchtitan's
grouped experts, ``torch._grouped_mm`` on the converted weights: torchao's ``_Float8GroupedMM`` on
``torch._scaled_grouped_mm``), both against the fp32 model: ours within 1.1x torchao's error, and close to it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.moe import fp8_training_cases as fc


def _convert(module):
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    from flashoverlap.nn import ExpertParallelMLP

    quantize_(module, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: isinstance(m, ExpertParallelMLP))
    return module


def _run(layer, x, idx, router, grad):
    x = x.clone().requires_grad_()
    router = router.clone().requires_grad_()
    y = layer(x, idx, router)
    (y.float() * grad.float()).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "drouter": router.grad, "dw13": layer.w13.grad, "dw2": layer.w2.grad}


def _cpu(rank, world):
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig, MXFP8TrainingOpConfig
    from torchao.prototype.moe_training.conversion_utils import _swap_params

    from flashoverlap.nn import ExpertParallelMLP

    wrapper = "Float8TrainingWeightWrapperTensor"
    for routing, seed in (("skewed", 7), ("rank-sends-none", 8)):
        p = fc.problem(world, routing, seed)
        own = slice(rank * p["local"], (rank + 1) * p["local"])
        layers = {}
        for name, fp8 in (("converted", None), ("row", "row")):
            layer = ExpertParallelMLP(fc.H, fc.FFN, p["experts"], p["top_k"], fp8=fp8, dtype=torch.bfloat16)
            with torch.no_grad():
                layer.w13.copy_(p["w13"][own])
                layer.w2.copy_(p["w2"][own])
            layers[name] = layer
        _convert(layers["converted"])
        converted = layers["converted"]
        assert type(converted.w13).__name__ == type(converted.w2).__name__ == wrapper, type(converted.w13)
        args = (p["x"][rank], p["idx"][rank], p["router"][rank], p["grad"][rank])
        got, want = _run(converted, *args), _run(layers["row"], *args)
        for k in want:
            assert type(got[k]) is torch.Tensor and got[k].dtype == torch.bfloat16, (k, type(got[k]), got[k].dtype)
            assert torch.equal(got[k], want[k]), f"{routing}: converted layer's {k} is not fp8='row''s"
        # Against the dequantised oracle: torchao's unsharded model with its CPU casts, fp64 products.
        tao = fc.torchao_model(p)
        first = sum(t.shape[0] for t in p["x"][:rank])
        mine = slice(first, first + p["x"][rank].shape[0])
        for k in got:
            theirs = tao[k][own] if k.startswith("dw") else tao[k][mine]
            if theirs.numel():
                err = float((got[k].double() - theirs.double()).norm() / tao[k].double().norm())
                assert err <= 0.01, f"{routing}: {k} {err:.4f} from torchao's model"
    # A gate converted too (quantize_ swaps every parameter of the layer): torchao's fp8 linear routes.
    gated = _convert(ExpertParallelMLP(fc.H, fc.FFN, 2 * world, 2, gate=True, dtype=torch.bfloat16))
    assert type(gated.gate.weight).__name__ == wrapper
    x = torch.randn(9, fc.H, dtype=torch.bfloat16, requires_grad=True)
    gated(x).float().sum().backward()
    assert x.grad.shape == x.shape and gated.w13.grad is not None and gated.gate.weight.grad is not None
    # What the layer refuses, on every rank, before anything is sent.
    idx, weights = torch.tensor([[0, 1]]), torch.full((1, 2), 0.5, dtype=torch.bfloat16)
    x = torch.randn(1, fc.H, dtype=torch.bfloat16)
    # (block-wise needs widths of 128, checked when the layer is built)
    block = _convert(ExpertParallelMLP(128, 128, 2 * world, 2, fp8="block", dtype=torch.bfloat16))
    half = ExpertParallelMLP(fc.H, fc.FFN, 2 * world, 2, dtype=torch.bfloat16)
    _swap_params(half, config=Float8TrainingOpConfig(), target_parameter_name="w13")
    mx = ExpertParallelMLP(fc.H, fc.FFN, 2 * world, 2, dtype=torch.bfloat16)
    _swap_params(mx, config=MXFP8TrainingOpConfig())
    for layer, error, words in ((block, ValueError, "fp8='block' with weights converted"),
                                (half, TypeError, "convert both experts' weights"),
                                (mx, NotImplementedError, "MXFP8TrainingOpConfig")):
        with pytest.raises(error, match=words):
            layer(x if layer is not block else torch.randn(1, 128, dtype=torch.bfloat16), idx, weights)
    return True


def test_converted_experts_take_the_fp8_path(ranks):
    ranks(2).run(_cpu)


# -- one GPU: against the unsharded converted model ---------------------------------------------------------------
class GroupedExperts(nn.Module):
    """torchtitan's routed experts, unsharded: ``w1, w3 [E, F, H]``, ``w2 [E, H, F]``, the tokens' choices sorted by
    expert and one ``torch._grouped_mm`` per projection (what torchao's conversion turns into fp8)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        ffn = w2.shape[2]
        self.w1 = nn.Parameter(w13[:, :ffn].clone())
        self.w3 = nn.Parameter(w13[:, ffn:].clone())
        self.w2 = nn.Parameter(w2.clone())

    def forward(self, x, idx, weights):
        top_k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        offs = torch.cumsum(torch.bincount(flat, minlength=self.w1.shape[0]), 0).to(torch.int32)
        rows = x[order // top_k]
        h1 = torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=offs)
        h3 = torch._grouped_mm(rows, self.w3.transpose(-2, -1), offs=offs)
        o = torch._grouped_mm(F.silu(h1) * h3, self.w2.transpose(-2, -1), offs=offs)
        weighted = o.float() * weights.reshape(-1)[order, None].float()
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add(0, order // top_k,
                                                                                    weighted).to(x.dtype)


def _fp32_reference(w13, w2, x, idx, weights, grad):
    """The fp32 model's output and gradients, one expert at a time."""
    x = x.float().requires_grad_()
    weights = weights.float().requires_grad_()
    w13 = w13.float().requires_grad_()
    w2 = w2.float().requires_grad_()
    ffn = w2.shape[2]
    y = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, choice = torch.nonzero(idx == e, as_tuple=True)
        h = x[token] @ w13[e].t()
        o = (F.silu(h[:, :ffn]) * h[:, ffn:]) @ w2[e].t()
        y = y.index_add(0, token, o * weights[token, choice, None])
    (y * grad.float()).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "drouter": weights.grad, "dw13": w13.grad, "dw2": w2.grad}


def _gpu(rank, world):
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    from flashoverlap.nn import ExpertParallelMLP

    torch.cuda.set_device(0)
    experts, hidden, ffn, tokens, top_k = 8, 1024, 512, 2048, 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, ffn, device="cuda", generator=gen) / ffn**0.5).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    # Balanced: every expert's group a multiple of 16 rows (torchtitan pads its groups to 16 for torchao's fp8).
    idx = (torch.arange(tokens, device="cuda")[:, None] * top_k + torch.arange(top_k, device="cuda")) % experts
    router = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), -1).bfloat16()
    want = _fp32_reference(w13, w2, x, idx, router, grad)

    theirs = GroupedExperts(w13, w2)
    quantize_(theirs, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: isinstance(m, GroupedExperts))
    assert type(theirs.w1).__name__ == "Float8TrainingWeightWrapperTensor"
    xt, rt = x.clone().requires_grad_(), router.clone().requires_grad_()
    yt = theirs(xt, idx, rt)
    (yt.float() * grad.float()).sum().backward()
    tao = {"y": yt.detach(), "dx": xt.grad, "drouter": rt.grad,
           "dw13": torch.cat([theirs.w1.grad, theirs.w3.grad], 1), "dw2": theirs.w2.grad}

    results = {}
    for mode in ("exact", "bounded"):
        layer = ExpertParallelMLP(hidden, ffn, experts, top_k, mode=mode, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer.w13.copy_(w13)
            layer.w2.copy_(w2)
        quantize_(layer, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: isinstance(m, ExpertParallelMLP))
        got = _run(layer, x, idx, router, grad)
        torch.cuda.synchronize()
        for k in want:
            assert not torch.isnan(got[k]).any(), f"{mode}: NaN in {k}"
            ours, budget = fc.errors({k: got[k]}, {k: want[k]})[k], fc.errors({k: tao[k]}, {k: want[k]})[k]
            apart = fc.errors({k: got[k]}, {k: tao[k]})[k]
            results[f"{mode} {k}"] = (ours, budget, apart)
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torchao's fp8 grouped GEMM)")
def test_converted_layer_matches_the_converted_model_on_one_gpu():
    from flashoverlap.testing import spawn
    from tests.gpu.helpers import ENV

    results = spawn(_gpu, 1, "nccl", env=ENV)[0]
    for what, (ours, budget, apart) in results.items():
        print(f"{what}: ours {ours:.4f}, torchao {budget:.4f}, apart {apart:.4f}")
    for what, (ours, budget, apart) in results.items():
        assert ours <= 1.1 * budget, f"{what}: normwise error {ours:.4f} against fp32, torchao's {budget:.4f}"
        assert apart <= 0.02, f"{what}: {apart:.4f} from the converted model"
