"""The fp8 ops on one GPU (a one-rank NCCL group): what the sequential plan on CUDA runs (``torch._scaled_mm``, the
dequantised product block-wise, then the collective), every op and scaling mode, against ``torch._scaled_mm`` of
the same operands, outputs from a NaN-poisoned allocator."""

import pytest
import torch

from flashoverlap.testing import spawn
from tests.gpu.helpers import ENV, poison_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _ranks(rank, world):
    import flashoverlap as fo
    from tests.ops.test_scaled import expected, quantise

    device = torch.device("cuda", torch.cuda.current_device())
    errors = {}
    for mode in ("tensor", "row", "block"):
        m, n, k = (256, 384, 512) if mode == "block" else (200, 304, 96)
        a, sa = quantise(torch.randn(m, k, device=device), mode)
        b, sb = quantise(torch.randn(k, n, device=device), mode, operand="b")
        if mode == "row":
            sb = sb.reshape(1, n)
        b = b.t().contiguous().t()  # column-major, as torch._scaled_mm wants B
        want = expected(a, b, sa, sb, mode, torch.bfloat16).to(torch.bfloat16)
        poison_allocator(device)
        for op in (fo.scaled_gemm_all_reduce, fo.scaled_gemm_reduce_scatter, fo.all_gather_scaled_gemm):
            got = op(a, b, sa, sb)
            assert got.is_cuda and got.dtype == torch.bfloat16 and not got.isnan().any(), (op.__name__, mode)
            errors[(op.__name__, mode)] = ((got.float() - want.float()).norm() / want.float().norm()).item()
    return errors


def test_the_fp8_ops_on_one_gpu():
    errors = spawn(_ranks, 1, "nccl", env=ENV)[0]
    assert all(e < 1e-2 for e in errors.values()), errors
