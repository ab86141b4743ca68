"""The fp8 expert layer's host-work savings keep its values: the rows' quantiser (``comm/expert/scaled.quantise``,
views of one wire buffer that ``pack`` hands on without a copy) equals the plain formula."""

import pytest
import torch

from flashoverlap.comm.expert import scaled


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
