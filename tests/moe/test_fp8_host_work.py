"""The fp8 expert layer's host-work savings keep its values: the rows' quantiser (``comm/expert/scaled.quantise``,
views of one wire buffer that ``pack`` hands on without a copy) equals the plain formula, and the weights' casts kept
between calls (``nn/fp8_experts.cached_cast``) are made again whenever the weight changes."""

import pytest
import torch

from flashoverlap.comm.expert import scaled
from flashoverlap.nn import fp8_experts


def _plain(x, mode, dtype):
    """The formula: per row (or 1x128 block) ``scale = max(amax * (1 / fp8_max), 1e-12)``, ``q = x / scale`` in fp32
    (times the reciprocal: what torch's CUDA division by a number computes, and so the GPU kernel)."""
    top, inverse = torch.finfo(dtype).max, 1 / torch.finfo(dtype).max
    rows, k = x.shape
    xf = x.float()
    if mode == "block":
        blocks = xf.reshape(rows, k // 128, 128)
        scale = (blocks.abs().amax(2) * inverse).clamp_min(1e-12)
        return (blocks / scale[:, :, None]).clamp(-top, top).to(dtype).reshape(rows, k), scale
    scale = (xf.abs().amax(1, keepdim=True) * inverse).clamp_min(1e-12)
    return (xf / scale).clamp(-top, top).to(dtype), scale


@pytest.mark.parametrize("mode", ["row", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantised_rows_equal_the_formula_and_pack_without_a_copy(mode, dtype, fp8):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(29, 384, generator=gen) * 10 ** (3 * torch.randn(29, 1, generator=gen))).to(dtype)
    x[4] = 0  # an all-zero row: the scale's floor
    x[7, 5] = torch.finfo(dtype).max  # a row whose largest magnitude is its dtype's largest
    for rows in (x, x.t().contiguous().t()):  # dense and column-major
        q, s = scaled.quantise(rows, mode, fp8)
        want_q, want_s = _plain(rows, mode, fp8)
        assert torch.equal(s, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        packed = scaled.pack(q, s)
        assert packed.data_ptr() == q.data_ptr() and packed.shape == (29, scaled.wire_width(384, mode))
        back_q, back_s = scaled.unpack(packed, 384, fp8, s.shape[1])
        assert torch.equal(back_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(back_s, want_s)
        # a row slice of the pair is packed in place too; dense copies are packed by copying
        assert scaled.pack(q[3:9], s[3:9]).data_ptr() == q[3].data_ptr()
        dense = scaled.pack(q.contiguous(), s.contiguous())
        assert dense.data_ptr() != q.data_ptr() and torch.equal(dense[:, :384], packed[:, :384])


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_a_kept_weight_cast_is_made_again_when_the_weight_changes(scaling):
    fp8_experts.clear_weight_casts()
    w = torch.nn.Parameter(torch.randn(2, 256, 128, dtype=torch.bfloat16))
    kept = fp8_experts._quantise_weight_kept if scaling == "block" else (
        lambda w, _: fp8_experts._weight_for_kept(w, 2))

    def fresh():
        return fp8_experts.quantise_weight(w, "block") if scaling == "block" else fp8_experts._weight_for(w, 2)

    first = kept(w, scaling)
    assert kept(w, scaling) is first  # unchanged: the kept cast
    with torch.no_grad():
        w.mul_(2)  # an in-place write (an optimiser step)
    second = kept(w, scaling)
    assert second is not first and all(torch.equal(a.float(), b.float()) for a, b in zip(second, fresh()))
    state = {"w": torch.randn(2, 256, 128, dtype=torch.bfloat16)}
    module = torch.nn.Module()
    module.w = w
    module.load_state_dict(state)  # load_state_dict copies in place
    third = kept(w, scaling)
    assert third is not second and all(torch.equal(a.float(), b.float()) for a, b in zip(third, fresh()))
    w.data = torch.randn(2, 256, 128, dtype=torch.bfloat16)  # a new storage: another data pointer
    fourth = kept(w, scaling)
    assert fourth is not third and all(torch.equal(a.float(), b.float()) for a, b in zip(fourth, fresh()))
    w.data.mul_(3)  # a write the version counter does not see: clear_weight_casts() is the documented way
    fp8_experts.clear_weight_casts()
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(kept(w, scaling), fresh()))


def test_the_layer_without_autograd_reuses_its_weights_casts_and_sees_a_changed_weight(monkeypatch):
    """``experts_forward``'s calls without autograd cast unchanged weights once, and again after a change."""
    fp8_experts.clear_weight_casts()
    made = []
    real = fp8_experts.quantise_weight
    monkeypatch.setattr(fp8_experts, "quantise_weight", lambda w, s: made.append(w) or real(w, s))
    monkeypatch.setattr(fp8_experts, "moe_dispatch_gemm", lambda rows, w, *a, **k: torch.zeros(
        rows.shape[0], w.shape[2], dtype=torch.bfloat16))
    monkeypatch.setattr(fp8_experts, "moe_gemm_combine", lambda a, w, *args, **k: torch.zeros(
        a.shape[0], w.shape[2], dtype=torch.bfloat16))

    class Layer:
        group, path, ffn = None, "reference", 128

    w13 = torch.nn.Parameter(torch.randn(2, 256, 128, dtype=torch.bfloat16))
    w2 = torch.nn.Parameter(torch.randn(2, 128, 128, dtype=torch.bfloat16))
    rows, weights = torch.randn(4, 128, dtype=torch.bfloat16), torch.rand(4, 2)
    with torch.no_grad():
        for _ in range(3):
            fp8_experts.experts_forward(Layer(), rows, w13, w2, weights, None, "block")
        assert len(made) == 2  # w13 and w2, once each
        w2.add_(1)
        fp8_experts.experts_forward(Layer(), rows, w13, w2, weights, None, "block")
    assert len(made) == 3 and made[-1] is w2
