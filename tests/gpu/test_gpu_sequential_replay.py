"""The sequential plan's repeated calls replayed from CUDA graphs (``comm/tp/sequential.py``) on one GPU, a one-rank
NCCL group (the collective inside the graph): every op through the public API with the sequential plan, bf16 and
fp8 row-wise, all-gather with and without its gathered input; every call on new values in the same tensors, the
previous outputs NaN-poisoned, against ``torch.mm`` / ``torch._scaled_mm``; every call from a case's fourth on
replayed. Then a user's ``torch.cuda.graph`` capturing a sequential call: captured there, not replayed, right on
each replay of the user's graph."""

import os

import pytest
import torch

from flashoverlap.testing import spawn
from tests.gpu.helpers import ENV, communicator_graphs, relative_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or
                                                  os.environ.get("TRITON_INTERPRET") == "1",
                                                  reason="needs a CUDA GPU, and TRITON_INTERPRET unset")]

CALLS = 6
M, N, K = 257, 320, 192


def _replays(rank, world):
    import flashoverlap as fo
    from flashoverlap.tune.defaults import sequential_plan

    device, graphs = communicator_graphs("gemm", "sequential")
    gen = torch.Generator(device=device).manual_seed(3)
    counts = {}
    cases = [(op, precision, False) for op in ("all_reduce", "reduce_scatter", "all_gather")
             for precision in ("bf16", "fp8-row")] + [("all_gather", "bf16", True)]
    ops = {"all_reduce": (fo.gemm_all_reduce, fo.scaled_gemm_all_reduce),
           "reduce_scatter": (fo.gemm_reduce_scatter, fo.scaled_gemm_reduce_scatter),
           "all_gather": (fo.all_gather_gemm, fo.all_gather_scaled_gemm)}
    for op, precision, gathered in cases:
        fn, fp8_fn = ops[op]
        plan = sequential_plan(op, M, N, K, world)
        a = torch.empty(M, K, dtype=torch.bfloat16, device=device)
        w = torch.empty(N, K, dtype=torch.bfloat16, device=device)
        a8 = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=device)
        w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=device)
        sa, sw = torch.empty(M, 1, device=device), torch.empty(1, N, device=device)
        before, what = graphs.replays, f"{op} {precision}{' gathered' if gathered else ''}"
        for call in range(CALLS):
            a.copy_(torch.randn(M, K, device=device, generator=gen))
            w.copy_(torch.randn(N, K, device=device, generator=gen) / K**0.5)
            if precision == "bf16":
                got = fn(a, w.t(), plan=plan, **({"return_gathered": True} if gathered else {}))
                want = a @ w.t()
            else:
                sa.copy_(a.float().abs().amax(1, keepdim=True) / 448)
                sw.copy_(w.float().abs().amax(1)[None, :] / 448)
                a8.copy_((a.float() / sa).to(torch.float8_e4m3fn))
                w8.copy_((w.float() / sw.t()).to(torch.float8_e4m3fn))
                got = fp8_fn(a8, w8.t(), sa, sw, plan=plan)
                want = torch._scaled_mm(a8, w8.t(), sa, sw, out_dtype=torch.bfloat16)
            out = got[0] if gathered else got
            relative_close(out, want, f"{what} #{call}", 1e-2)
            if gathered:
                assert torch.equal(got[1], a), f"{what} #{call}: the gathered input"
                got[1].fill_(float("nan"))
            out.fill_(float("nan"))
            del got, out
        counts[what] = graphs.replays - before
    # Inside a user's capture: the call is captured into the user's graph, not replayed from ours.
    plan = sequential_plan("all_reduce", M, N, K, world)
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device, generator=gen)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=device, generator=gen)
    for _ in range(3):  # the signature's eager call, its capture, a replay: the user's capture comes after
        fo.gemm_all_reduce(a, w.t(), plan=plan)
    torch.cuda.synchronize()
    before = graphs.replays
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = fo.gemm_all_reduce(a, w.t(), plan=plan)
    counts["inside a user's capture"] = graphs.replays - before
    for _ in range(3):
        a.copy_(torch.randn(M, K, device=device, generator=gen))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        relative_close(y, a @ w.t(), "a user's graph replayed", 1e-2)
    torch.cuda.synchronize()
    return counts


def test_repeated_sequential_calls_replay():
    counts = spawn(_replays, 1, "nccl", env=ENV)[0]
    for case, replays in counts.items():
        if case == "inside a user's capture":
            assert replays == 0, (case, replays)
        else:  # every call once the allocator's addresses repeat (by a case's third call: its first, eager, call
            # allocates where the previous case's tensors lay)
            assert replays >= CALLS - 3, (case, replays)
