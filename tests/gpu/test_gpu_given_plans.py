"""Any plan a caller passes to any op on one GPU (a one-rank NCCL group), as ``tests/ops/test_given_plans.py`` does
on the CPU: plans of every op, of the call's shape and of others, of the group's size and one more, for the NCCL,
ring and P2P paths, overlapped (the signalling GEMM's and cuBLAS bands', bf16 tiles and fp8 ones) and sequential,
passed with every call path, to the bf16 ops and the fp8 ops in each scaling mode: the call raises before anything
runs, or its result is plain PyTorch's (the dequantised product for fp8). No call may return a wrong result."""

import itertools
import os

import pytest
import torch

from flashoverlap.testing import spawn
from tests.gpu.helpers import ENV

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or
                                                  os.environ.get("TRITON_INTERPRET") == "1",
                                                  reason="needs a CUDA GPU, and TRITON_INTERPRET unset")]

M, N, K = 264, 256, 512  # fp8 block-wise: K a multiple of 512 for cuBLAS's block-wise kernel


def _plans(sms):
    import flashoverlap as fo
    from flashoverlap.tune.defaults import sequential_plan
    from flashoverlap.tune.fp8 import fp8_tiles

    plans = {}
    shapes = ((M, N, K), (2 * M, N, K), (M, 2 * N, K), (M, N, K // 2))
    for op, shape, size, path, kind in itertools.product(("all_reduce", "reduce_scatter", "all_gather"), shapes,
                                                          (1, 2), ("nccl", "ring", "p2p"),
                                                          ("triton", "cublas", "fp8-row", "sequential")):
        try:
            if kind == "sequential":
                plan = sequential_plan(op, *shape, size, path=path)
            else:
                tile = fp8_tiles(*shape, "row", op).tile_config() if kind == "fp8-row" else None
                plan = fo.default_plan(op, *shape, size, num_sms=sms, allow_sequential=False, path=path,
                                       gemm="cublas" if kind == "cublas" else "triton", num_groups=2,
                                       **({"tile": tile} if tile is not None else {}))
        except ValueError:
            continue  # no such plan for that shape
        plans[(op, shape, size, path, kind)] = plan
    return plans


def _ranks(rank, world):
    import flashoverlap as fo
    from tests.gpu.test_gpu_scaled import _dequantised
    from tests.ops.test_given_plans import given_plans
    from tests.ops.test_scaled import quantise

    device = torch.device("cuda", torch.cuda.current_device())
    plans = _plans(torch.cuda.get_device_properties(device).multi_processor_count)
    half_ops = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter,
                "all_gather": fo.all_gather_gemm}
    fp8_ops = {"all_reduce": fo.scaled_gemm_all_reduce, "reduce_scatter": fo.scaled_gemm_reduce_scatter,
               "all_gather": fo.all_gather_scaled_gemm}
    gen = torch.Generator(device=device).manual_seed(0)
    wrong, ran, refused = [], 0, 0
    for op in half_ops:
        for dtype in ("bf16", "tensor", "row", "block"):
            if dtype == "bf16":
                a = torch.randn(M, K, device=device, generator=gen).bfloat16()
                b = (torch.randn(N, K, device=device, generator=gen) / K**0.5).bfloat16().t()
                want = a.float() @ b.float()

                def call(plan, path, a=a, b=b, fn=half_ops[op]):
                    return fn(a, b, plan=plan, path=path)
            else:
                a, sa = quantise(torch.randn(M, K, device=device, generator=gen), dtype)
                b, sb = quantise(torch.randn(K, N, device=device, generator=gen), dtype, operand="b")
                if dtype == "row":
                    sb = sb.reshape(1, N)
                b = b.t().contiguous().t()
                want = _dequantised(a, b, sa, sb, dtype)

                def call(plan, path, a=a, b=b, sa=sa, sb=sb, fn=fp8_ops[op]):
                    return fn(a, b, sa, sb, plan=plan, path=path)
            done, no = given_plans(call, plans, ("auto", "nccl", "p2p", "ring", "reference"), want, 2e-2,
                                   (op, dtype), wrong)
            ran += done
            refused += no
    return wrong, ran, refused


def test_a_given_plan_is_refused_or_the_result_is_right():
    wrong, ran, refused = spawn(_ranks, 1, "nccl", env=ENV, timeout=400)[0]
    assert wrong == [], wrong[:8]
    assert ran >= 40 and refused >= 40, (ran, refused)
