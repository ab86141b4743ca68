"""``expert_layout`` on a GPU: the host synchronisations it promises (``comm/expert/layout.py``): none in bounded
mode (a layer in bounded mode can then be issued, and captured, without the host waiting on the GPU), exactly one in
exact mode (the split sizes). Counted by ``torch.cuda.set_sync_debug_mode`` (``testing.host_synchronisations``; it
does not see ``torch.distributed``'s collectives: the layout's one all-gather is asynchronous by NCCL's contract),
on a one-rank NCCL group (one GPU is enough: the count does not depend on the group's size), skewed routing with an
expert that gets no token, the counts checked against ``torch.bincount`` computed afterwards."""

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import host_synchronisations, spawn
from tests.gpu.helpers import ENV

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layouts(rank, world_size):
    from flashoverlap.comm.expert import expert_layout
    from flashoverlap.comm.protocol import CommGroup

    group = CommGroup.of(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
    experts, tokens, top_k = 16, 1777, 4  # 7108 choices: past torch's small-sort path (4096), as layers are
    gen = torch.Generator(device="cuda").manual_seed(5)
    keys = torch.rand(tokens, experts, device="cuda", generator=gen)
    keys = keys + torch.log(1.0 / torch.arange(1, experts + 1, device="cuda") ** 1.2)
    keys[:, 3] = float("-inf")  # expert 3 gets no token
    idx = keys.topk(top_k, dim=1).indices
    want = torch.bincount(idx.reshape(-1), minlength=experts).view(1, experts).cpu()
    expert_layout(idx, experts, group, mode="bounded", bound=tokens * top_k)  # NCCL set up, kernels loaded
    torch.cuda.synchronize()
    found = {}
    for mode, bound in (("bounded", tokens * top_k), ("exact", None)):
        layouts = []

        def build(mode=mode, bound=bound, layouts=layouts):
            layouts.append(expert_layout(idx, experts, group, mode=mode, bound=bound))

        found[mode] = host_synchronisations(build)
        layout = layouts[0]
        assert torch.equal(layout.send_counts.cpu(), want), mode
        assert torch.equal(layout.recv_counts.cpu(), want), mode
    return found


@needs_gpu
def test_bounded_layout_never_waits_for_the_gpu_and_exact_waits_once():
    found = spawn(_layouts, 1, backend="nccl", env=ENV)[0]
    assert len(found["bounded"]) == 0 and len(found["exact"]) == 1, found


@needs_gpu
def test_a_new_layouts_hybrid_tables_never_wait_for_the_gpu():
    """The hybrid GEMM's light tables (``chunked_gemm.light_tables``) are made once per exact-mode layout, so once a
    call when the routing changes every call (training): made from the layout's device tensors and its host counts,
    with no host synchronisation (a host list copied to the device waited for the GPU's queue: 11 ms of host a call
    on one H100 in ``benchmarks/diagnostics/fp8_moe_host.py --new-routing``); the experts the host's split names."""
    from flashoverlap.comm.expert import Layout, chunked_gemm

    counts = [[30, 4, 0, 11, 0], [25, 9, 7, 12, 0], [3, 0, 6, 13, 0]]
    recv = torch.tensor(counts, dtype=torch.int64, device="cuda")
    ends = recv.reshape(-1).cumsum(0)
    splits = tuple(int(v) for v in recv.sum(1))
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    layout = Layout(empty, empty, recv.clone(), recv, (ends - recv.reshape(-1)).to(torch.int32), ends.to(torch.int32),
                    mode="exact", bound=None, top_k=1, tokens=0, experts=15, send_splits=splits, recv_splits=splits,
                    max_pair_rows=max(splits), recv_counts_host=tuple(map(tuple, counts)))  # as expert_layout's
    torch.cuda._sleep(10**8)  # the GPU busy: a wait would show
    found = host_synchronisations(lambda: chunked_gemm.light_tables(layout, 36))
    assert found == [], found
    assert chunked_gemm.light_tables(layout, 36)[2].tolist() == [1, 2]


def _new_routing_calls(rank, world_size):
    import torch.nn.functional as F

    import flashoverlap as fo
    from benchmarks.diagnostics.fp8_moe_host import fresh_routing, layer_weights

    local, hidden, ffn, top_k, tokens = 64, 2048, 768, 8, 2048  # Qwen3-30B-A3B's slice: bf16 takes the hybrid GEMM
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, generator=gen).bfloat16()
    weights = torch.softmax(torch.randn(tokens, top_k, device=dev, generator=gen), -1)
    w13 = torch.randn(local, 2 * ffn, hidden, device=dev, generator=gen).div_(hidden ** 0.5).bfloat16()
    w2 = torch.randn(local, hidden, ffn, device=dev, generator=gen).div_(ffn ** 0.5).bfloat16()
    found = {}
    for dtype in ("bf16", "fp8-row", "fp8-block"):
        w_up, w_down, s_up, s_down = layer_weights(dtype, w13, w2)

        def layer(layout, w_up=w_up, w_down=w_down, s_up=s_up, s_down=s_down):
            h = fo.moe_dispatch_gemm(x, w_up, layout, path="nccl", scale_w=s_up)
            return fo.moe_gemm_combine(F.silu(h[:, :ffn]) * h[:, ffn:], w_down, weights, layout, path="nccl",
                                       scale_w=s_down)

        def routing(seed):
            return fo.moe_layout(fresh_routing(local, top_k, tokens, dev, seed), local, mode="exact")

        layer(routing(1))  # the first call: the plan, the kernels
        layouts = [routing(seed) for seed in (2, 3, 4)]
        torch.cuda.synchronize()
        found[dtype] = []
        for layout in layouts:
            torch.cuda._sleep(10**7)  # the GPU busy: a wait would show
            found[dtype] += host_synchronisations(lambda layout=layout: layer(layout))
        torch.cuda.synchronize()
    return found


@needs_gpu
def test_an_exact_layer_with_a_new_routing_every_call_never_waits_for_the_gpu():
    """Exact mode with a new routing every call, as training runs it: once the layout is built (its one
    synchronisation), the layer's calls (dispatch, combine; bf16's hybrid GEMM, fp8 row- and block-wise) issue
    without the host waiting on the GPU, also for layouts they have not seen."""
    found = spawn(_new_routing_calls, 1, backend="nccl", env=ENV)[0]
    assert found == {"bf16": [], "fp8-row": [], "fp8-block": []}, found
