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


def _dequantised(a, b, sa, sb, mode):
    """The oracle on the GPU for any shape: the fp8 operands times their scales, multiplied in fp32 (written out here,
    not the library's)."""
    k, n = b.shape
    if mode == "block":
        a32 = a.float() * sa.repeat_interleave(128, 1)[:, :k]
        b32 = b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
    else:
        a32, b32 = a.float() * sa.reshape(-1, 1), b.float() * sb.reshape(1, -1)
    return a32 @ b32


# (mode, M, N, K, B as w.t()): odd shapes (the kernel's pointer loads; cuBLAS cannot take them, so the cuBLAS-band
# plans fall back to the dequantised product), round ones (TMA, torch's scaled matmul), block-wise K/128 odd (torch's
# block-wise kernel not used) and a multiple of 4.
NCCL_CASES = [("tensor", 777, 2000, 1234, True), ("row", 1000, 1000, 96, False), ("row", 2048, 4096, 1024, True),
              ("tensor", 2048, 4096, 1024, False), ("block", 1000, 1040, 640, True), ("block", 2048, 4096, 1024, True)]


def _plans(kind, m, n, k, mode, world, sms):
    """The plans each case runs under: the default (None), and the NCCL path's overlapped plans with the fp8 tiles,
    the signalling GEMM's and cuBLAS bands'."""
    import flashoverlap as fo
    from flashoverlap.tune.fp8 import fp8_tiles

    tile = fp8_tiles(m, n, k, mode, kind).tile_config()
    plans = {"default": None}
    for gemm in ("triton", "cublas"):
        plans[gemm] = fo.default_plan(kind, m, n, k, world, num_sms=sms, tile=tile, allow_sequential=False, gemm=gemm,
                                      num_groups=3)
    return plans


def _nccl_path(rank, world):
    """The NCCL path's fp8 calls at W = 1 under overlapped plans (the signalling fp8 GEMM, and cuBLAS bands), each op
    twice (the counters and flags must be back to zero for the second call), and under the default plan."""
    import flashoverlap as fo
    from tests.ops.test_scaled import quantise

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ops = {"all_reduce": fo.scaled_gemm_all_reduce, "reduce_scatter": fo.scaled_gemm_reduce_scatter,
           "all_gather": fo.all_gather_scaled_gemm}
    errors = {}
    for mode, m, n, k, transposed in NCCL_CASES:
        a, sa = quantise(torch.randn(m, k, device=device), mode)
        b, sb = quantise(torch.randn(k, n, device=device), mode, operand="b")
        if mode == "row":
            sb = sb.reshape(1, n)
        if transposed:
            b = b.t().contiguous().t()
        want = _dequantised(a, b, sa, sb, mode)
        for kind, op in ops.items():
            for name, plan in _plans(kind, m, n, k, mode, world, sms).items():
                for repeat in range(2):
                    poison_allocator(device)
                    got = op(a, b, sa, sb, path="nccl", plan=plan)
                    assert got.dtype == torch.bfloat16 and not got.isnan().any(), (kind, mode, name)
                    err = ((got.float() - want).norm() / want.norm()).item()
                    errors[(kind, mode, m, n, k, name, repeat)] = err
    return errors


def test_the_nccl_path_runs_fp8_under_overlapped_plans():
    errors = spawn(_nccl_path, 1, "nccl", env=ENV)[0]
    assert len(errors) == len(NCCL_CASES) * 3 * 3 * 2
    bad = {key: e for key, e in errors.items() if not e < 1e-2}
    assert not bad, bad


def _bias_and_odd_rows(rank, world):
    """fp32 output with a bias (which torch 2.11's ``_scaled_mm`` refuses: the library adds the bias after it), and
    block-wise rows that cuBLAS's block-wise kernel refuses (not a multiple of 4), under the default plan and the
    NCCL path's overlapped plans."""
    import flashoverlap as fo
    from tests.ops.test_scaled import quantise

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ops = {"all_reduce": fo.scaled_gemm_all_reduce, "reduce_scatter": fo.scaled_gemm_reduce_scatter,
           "all_gather": fo.all_gather_scaled_gemm}
    errors = {}
    for mode, m, n, k, out_dtype, with_bias in (("row", 1024, 2048, 1024, torch.float32, True),
                                                ("tensor", 1000, 1024, 512, torch.float32, True),
                                                ("block", 1002, 1024, 1024, torch.bfloat16, True),
                                                ("block", 1024, 1024, 1024, torch.float32, True)):
        a, sa = quantise(torch.randn(m, k, device=device), mode)
        b, sb = quantise(torch.randn(k, n, device=device), mode, operand="b")
        sb = sb.reshape(1, n) if mode == "row" else sb
        b = b.t().contiguous().t()
        bias = torch.randn(n, device=device).to(out_dtype) if with_bias else None
        want = _dequantised(a, b, sa, sb, mode) + (0 if bias is None else bias.float())
        for kind, op in ops.items():
            for name, plan in _plans(kind, m, n, k, mode, world, sms).items():
                poison_allocator(device)
                got = op(a, b, sa, sb, out_dtype=out_dtype, bias=bias, plan=plan)
                assert got.dtype == out_dtype and not got.isnan().any(), (kind, mode, name)
                errors[(kind, mode, m, str(out_dtype), name)] = ((got.float() - want).norm() / want.norm()).item()
    return errors


def test_fp32_output_with_a_bias_and_block_rows_cublas_refuses():
    errors = spawn(_bias_and_odd_rows, 1, "nccl", env=ENV)[0]
    assert len(errors) == 4 * 3 * 3
    bad = {key: e for key, e in errors.items() if not e < 1e-2}
    assert not bad, bad


def test_scaled_mm_takes_a_band_whose_row_scales_start_mid_tensor():
    """A band of rows 501.. of a 1002-row row-wise call: its A scales are a slice 2004 bytes into their tensor, a
    pointer cuBLASLt refuses unaligned (the P2P path's sub-bands; logs/issue35). (Block-wise scales are always
    copied into torch's layout first.)"""
    from flashoverlap.comm.scaled import Scales, scaled_mm
    from tests.ops.test_scaled import expected, quantise

    m, n, k = 1002, 256, 512
    rows = slice(501, m)
    a, sa = quantise(torch.randn(m, k, device="cuda"), "row")
    b, sb = quantise(torch.randn(k, n, device="cuda"), "row", operand="b")
    b, sb = b.t().contiguous().t(), sb.reshape(1, n)
    band_scales = sa[rows]
    assert band_scales.data_ptr() % 16, "the slice must start off a 16-byte boundary for this test to mean anything"
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    scaled_mm(a[rows], b, Scales.of(sa, sb), band_scales, out=out[rows])
    want = expected(a[rows], b, sa[rows].clone(), sb, "row", torch.bfloat16)  # a fresh, aligned copy
    got = out[rows].float()
    assert not got.isnan().any() and ((got - want).norm() / want.norm()).item() < 1e-2
