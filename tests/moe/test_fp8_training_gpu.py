"""fp8 MoE training on one GPU (skipped without CUDA; torchao not needed): the weight gradients' grouped product on
CUDA (``torch._scaled_grouped_mm`` on the rows in expert order, groups padded to 16) against the same function's
CPU product on the same inputs (segments of uneven sizes, an empty expert, gap rows holding NaN as bounded mode's
padding may); and ``ExpertParallelMLP(fp8="row")`` on a one-rank NCCL group, exact and bounded, forward and backward,
against the fp32 model within fp8's error (normwise <= 0.1: e4m3 keeps 3 mantissa bits; the CPU tests measure the
layer against torchao's own error) and against the bf16 layer far from bf16's own error (the fp8 path ran)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fp8 scaled grouped GEMM)")]


def _rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_weight_grad_on_cuda_matches_the_cpu_product():
    from flashoverlap.nn.fp8_moe import weight_grad

    gen = torch.Generator().manual_seed(0)
    local, world, n, k = 4, 3, 384, 256
    sizes = torch.tensor([[37, 0, 5, 130], [1, 0, 64, 17], [300, 0, 2, 9]])  # expert 1 empty
    gap = 11  # rows of no segment after each source's block (bounded mode's padding)
    starts, ends, row = [], [], 0
    for s in range(world):
        for e in range(local):
            starts.append(row)
            row += int(sizes[s, e])
            ends.append(row)
        row += gap
    grads = torch.randn(row, n, generator=gen).bfloat16()
    rows = (torch.randn(row, k, generator=gen) * 3).bfloat16()
    inside = torch.zeros(row, dtype=torch.bool)
    for a, b in zip(starts, ends):
        inside[a:b] = True
    grads[~inside] = float("nan")
    rows[~inside] = float("nan")
    seg = (torch.tensor(starts, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32))
    want = weight_grad(grads, rows.float(), *seg, local, torch.bfloat16)
    got = weight_grad(grads.cuda(), rows.float().cuda(), *(t.cuda() for t in seg), local, torch.bfloat16).cpu()
    assert not torch.isnan(got).any()
    assert torch.equal(got[1], torch.zeros_like(got[1])), "the empty expert's gradient is not zero"
    assert _rel(got, want) <= 5e-3, _rel(got, want)


def _layer(rank, world):
    import torch.nn.functional as F

    from flashoverlap.nn import ExpertParallelMLP

    torch.cuda.set_device(0)
    experts, hidden, ffn, tokens, top_k = 8, 1024, 768, 1500, 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, ffn, device="cuda", generator=gen) / ffn**0.5).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    zipf = torch.arange(1, experts + 1, device="cuda", dtype=torch.float32) ** -1.2
    idx = torch.multinomial(zipf.expand(tokens, -1), top_k, generator=gen)
    router = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), -1).bfloat16()
    # The fp32 model, one expert at a time.
    leaves = [t.float().requires_grad_() for t in (x, router, w13, w2)]
    xf, rf, w13f, w2f = leaves
    y = torch.zeros_like(xf)
    for e in range(experts):
        token, choice = torch.nonzero(idx == e, as_tuple=True)
        h = xf[token] @ w13f[e].t()
        y = y.index_add(0, token, ((F.silu(h[:, :ffn]) * h[:, ffn:]) @ w2f[e].t()) * rf[token, choice, None])
    (y * grad.float()).sum().backward()
    want = [y.detach(), *(t.grad for t in leaves)]
    out = {}
    for fp8 in ("row", None):
        for mode in ("exact", "bounded"):
            layer = ExpertParallelMLP(hidden, ffn, experts, top_k, mode=mode, fp8=fp8, device="cuda",
                                      dtype=torch.bfloat16)
            with torch.no_grad():
                layer.w13.copy_(w13)
                layer.w2.copy_(w2)
            xl, rl = x.clone().requires_grad_(), router.clone().requires_grad_()
            yl = layer(xl, idx, rl)
            yl.backward(grad)
            got = [yl.detach(), xl.grad, rl.grad, layer.w13.grad, layer.w2.grad]
            out[f"{fp8 or 'bf16'} {mode}"] = {name: _rel(g, w) for name, g, w in
                                              zip(("y", "dx", "drouter", "dw13", "dw2"), got, want)}
    return out


def test_fp8_layer_trains_on_one_gpu():
    from flashoverlap.testing import spawn
    from tests.gpu.helpers import ENV

    errors = spawn(_layer, 1, "nccl", env=ENV)[0]
    for what, errs in errors.items():
        print(what, {k: round(v, 4) for k, v in errs.items()})
    for mode in ("exact", "bounded"):
        for name, err in errors[f"row {mode}"].items():
            bf16 = errors[f"bf16 {mode}"][name]
            assert err <= 0.1, f"fp8 {mode}: {name} normwise error {err:.4f} against fp32"
            assert err >= 3 * bf16, f"fp8 {mode}: {name} error {err:.4f}, bf16's {bf16:.4f}: did fp8 run?"
