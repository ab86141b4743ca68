"""The expert-parallel layer on real GPUs through the overlapped paths (``comm/expert/nccl.py``,
``comm/expert/p2p.py``): ``ExpertParallelMLP.from_moe_block`` against the plain unsharded ``MoEBlock`` (computed in
fp32 on every rank, which holds all of it), forward and backward (tokens, both expert weights, the gate), NCCL and
P2P paths, exact and bounded mode, bf16 and fp16, odd and round shapes, skewed routing; eager, compiled with
``fullgraph=True`` (bounded mode), and bounded mode captured in a CUDA graph and replayed with new tokens and
routing. The caching allocator's free memory is poisoned with NaN first. Skipped without 2 GPUs."""

import copy

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import spawn
from tests.gpu.helpers import ENV, WORLD, assert_close, needs_gpus, poison_allocator

pytestmark = pytest.mark.gpu

# (tokens of rank r, hidden, ffn, experts, top_k); bounded mode takes every rank's count equal (its default bound).
SHAPES = [(lambda r: 333 + 17 * r, 520, 264, 8, 2), (lambda r: 2048, 1024, 512, 16, 4)]


def _skewed_tokens(block, tokens, rank, dtype):
    """Tokens whose routing is skewed: the gate favours the first experts (Zipf-like logits offsets)."""
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(tokens, block.hidden, device="cuda", generator=gen).to(dtype)
    return x


def _reference(block32, x, grad_out):
    """The fp32 block's output and gradients for this rank's tokens: (y, grad x, expert grads summed over the
    ranks, gate grad of this rank's tokens)."""
    block32.zero_grad(set_to_none=True)
    x32 = x.detach().float().requires_grad_(True)
    y = block32(x32)
    y.backward(grad_out.float())
    experts = torch.stack([torch.cat([e.w1.weight.grad, e.w3.weight.grad]) for e in block32.experts])
    downs = torch.stack([e.w2.weight.grad for e in block32.experts])
    dist.all_reduce(experts)
    dist.all_reduce(downs)
    return y.detach(), x32.grad, experts, downs, block32.gate.weight.grad.clone()


def _check_layer(layer, block32, x, grad_out, what, fn=None):
    from_rank = layer.first_expert
    layer.zero_grad(set_to_none=True)
    xin = x.detach().clone().requires_grad_(True)
    y = (fn or layer)(xin)
    y.backward(grad_out)
    want_y, want_gx, want_w13, want_w2, want_gate = _reference(block32, x, grad_out)
    local = layer.local_experts
    assert_close(y.float(), want_y, what + " forward")
    assert_close(xin.grad.float(), want_gx, what + " grad x")
    assert_close(layer.w13.grad.float(), want_w13[from_rank : from_rank + local], what + " grad w13")
    assert_close(layer.w2.grad.float(), want_w2[from_rank : from_rank + local], what + " grad w2")
    assert_close(layer.gate.weight.grad.float(), want_gate, what + " grad gate")


def _layers(rank, world_size):
    from flashoverlap.nn.moe import ExpertParallelMLP, MoEBlock, route

    device = torch.device("cuda", torch.cuda.current_device())
    poison_allocator(device)
    checked = 0
    for i, (tokens, hidden, ffn, experts, top_k) in enumerate(SHAPES):
        for dtype in (torch.bfloat16, torch.float16):
            torch.manual_seed(7 + i)  # the same block on every rank
            block = MoEBlock(hidden, ffn, experts, top_k, device="cuda", dtype=dtype)
            with torch.no_grad():  # skewed routing: the first experts favoured
                block.gate.weight[: experts // 2] += 0.05
            block32 = copy.deepcopy(block).float()
            for path in ("nccl", "p2p"):
                for mode in ("exact", "bounded"):
                    t = tokens(rank) if mode == "exact" else tokens(0)
                    x = _skewed_tokens(block, t, rank, dtype)
                    grad_out = torch.randn_like(x)
                    layer = ExpertParallelMLP.from_moe_block(block, mode=mode, path=path)
                    what = f"{path} {mode} {dtype} shape {i}"
                    _check_layer(layer, block32, x, grad_out, what + " eager")
                    checked += 1
                    if mode != "bounded":
                        continue
                    compiled = torch.compile(layer, fullgraph=True)
                    _check_layer(layer, block32, x, grad_out, what + " compiled", fn=compiled)
                    checked += 1
                    # Forward captured in a CUDA graph, replayed with new tokens and routing.
                    x_in = x.clone()
                    idx, weights = route(block.gate(x_in), top_k)
                    idx_in, w_in = idx.clone(), weights.clone()
                    with torch.no_grad():
                        layer(x_in, idx_in, w_in)  # eager first: the path's buffers, kernels, tables
                        torch.cuda.synchronize()
                        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side), torch.cuda.graph(graph):
                            y = layer(x_in, idx_in, w_in)
                        torch.cuda.current_stream().wait_stream(side)
                        for replay in range(3):
                            gen = torch.Generator(device="cuda").manual_seed(1000 * replay + rank)
                            x_in.copy_(torch.randn(x.shape, device="cuda", generator=gen).to(dtype))
                            idx, weights = route(block.gate(x_in), top_k)
                            idx_in.copy_(idx)
                            w_in.copy_(weights)
                            y.fill_(float("nan"))
                            graph.replay()
                            assert_close(y.float(), block32(x_in.float(), idx, weights.float()),
                                         f"{what} graph replay {replay}")
                        del graph
                    checked += 1
    return checked


@needs_gpus
def test_expert_parallel_layer_on_both_paths_matches_the_plain_block():
    results = spawn(_layers, WORLD, "nccl", env=ENV)
    assert results == [2 * 2 * 2 * 4] * WORLD
