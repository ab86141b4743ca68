"""The expert NCCL path's repeated bounded-mode calls replayed from CUDA graphs (``comm/expert/nccl.py``) on one GPU
(a one-rank NCCL group: no peer, so the graph holds the GEMMs, the zeroing and the weighted sum; the rounds' NCCL
send/recv with peers need two GPUs). ``moe_dispatch_gemm`` and ``moe_gemm_combine``, bf16, and fp8 with row-wise and
128-channel block scales, the rows given in fp8 or in bf16 (quantised by the call's first issued step: inside the
graph on replay); every call on new values in the same tensors, the previous outputs NaN-poisoned, against
the reference path on the same layout (plain PyTorch); every call after a case's first two replays in bounded mode,
none in exact mode."""

import os

import pytest
import torch

from flashoverlap.testing import spawn
from tests.gpu.helpers import ENV, communicator_graphs, relative_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or
                                                  os.environ.get("TRITON_INTERPRET") == "1",
                                                  reason="needs a CUDA GPU, and TRITON_INTERPRET unset")]

CALLS = 5
TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 301, 256, 384, 8, 2


def _replays(rank, world):
    import flashoverlap as fo
    from flashoverlap.comm.expert.scaled import quantise
    from flashoverlap.nn.fp8_experts import quantise_weight

    device, graphs = communicator_graphs("expert", "nccl")
    gen = torch.Generator(device=device).manual_seed(7)
    counts = {}
    for mode in ("bounded", "exact"):
        idx = torch.stack([torch.randperm(EXPERTS, device=device, generator=gen)[:TOP_K] for _ in range(TOKENS)])
        layout = fo.moe_layout(idx, EXPERTS, mode=mode)
        weights = torch.rand(TOKENS, TOP_K, device=device, generator=gen)
        for precision, given in (("bf16", None), ("row", "fp8"), ("block", "fp8"), ("row", "bf16"), ("block", "bf16")):
            w_up = torch.randn(EXPERTS, 2 * FFN, HIDDEN, device=device, generator=gen) / HIDDEN**0.5
            w_down = torch.randn(EXPERTS, HIDDEN, FFN, device=device, generator=gen) / FFN**0.5
            x = torch.empty(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
            a = torch.empty(layout.recv_rows, FFN, device=device, dtype=torch.bfloat16)
            if precision == "bf16":
                up, down = w_up.bfloat16().transpose(1, 2), w_down.bfloat16().transpose(1, 2)
                extra_up, extra_down = {}, {}
            else:
                q_up, s_up = quantise_weight(w_up, precision)
                q_down, s_down = quantise_weight(w_down, precision)
                up, down = q_up.transpose(1, 2), q_down.transpose(1, 2)
                extra_up, extra_down = {"scale_w": s_up}, {"scale_w": s_down}
            if precision == "bf16" or given == "bf16":  # fp8 weights, bf16 rows: the op quantises them in its graph
                xin, ain, sx, sa = x, a, {}, {}
            else:  # the fp8 operands in tensors of their own, refilled by each call (the addresses repeat)
                (xin, xs), (ain, as_) = ([t.contiguous() for t in quantise(v.normal_(generator=gen), precision)]
                                         for v in (x, a))
                sx, sa = {"scale_x": xs}, {"scale_a": as_}
            before = graphs.replays
            for call in range(CALLS):
                x.copy_(torch.randn(x.shape, device=device, generator=gen))
                a.copy_(torch.randn(a.shape, device=device, generator=gen))
                if given == "fp8":
                    for source, (q, scale) in ((x, (xin, xs)), (a, (ain, as_))):
                        new_q, new_scale = quantise(source, precision)
                        q.copy_(new_q)
                        scale.copy_(new_scale)
                what = f"{mode} {precision} from {given} #{call}"
                h = fo.moe_dispatch_gemm(xin, up, layout, path="nccl", **sx, **extra_up)
                relative_close(h, fo.moe_dispatch_gemm(xin, up, layout, path="reference", **sx, **extra_up),
                               "dispatch " + what, 2e-2)
                y = fo.moe_gemm_combine(ain, down, weights, layout, path="nccl", **sa, **extra_down)
                relative_close(y, fo.moe_gemm_combine(ain, down, weights, layout, path="reference", **sa, **extra_down),
                               "combine " + what, 2e-2)
                h.fill_(float("nan"))
                y.fill_(float("nan"))
                del h, y
            counts[f"{mode} {precision} from {given}"] = graphs.replays - before
    torch.cuda.synchronize()
    return counts


def test_bounded_expert_calls_replay_on_the_nccl_path():
    counts = spawn(_replays, 1, "nccl", env=ENV)[0]
    for case, replays in counts.items():
        if case.startswith("exact"):
            assert replays == 0, (case, replays)
        else:  # dispatch and combine: every call after the first two of each
            assert replays >= 2 * (CALLS - 2), (case, replays)
