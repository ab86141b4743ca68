"""Expert parallelism: the MoE layer and the MoE ops against the plain (unsharded) MoE block.

    torchrun --nproc-per-node 2 examples/moe.py

A plain ``MoEBlock`` (a gate and SwiGLU experts, softmax top-k routing), the same on every rank, and each rank's own
tokens. Its experts sharded over the ranks three ways: ``ExpertParallelMLP.from_moe_block``, an
``ExpertParallelMLP`` whose weights are copied in by hand (as from another library's block of the same shape), and
the three ops a layer written with ``all_to_all_single`` and ``torch._grouped_mm`` calls instead. NCCL and GPU-sized
tensors where every rank has a GPU; else gloo, CPU-sized tensors and the reference path. Prints the largest relative
difference from the plain block over every rank, and raises beyond bf16 rounding.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashoverlap as fo
from flashoverlap.nn import ExpertParallelMLP, MoEBlock, route


def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """The largest relative difference over every rank; raises beyond bf16 rounding."""
    worst = ((got.detach().float() - want.float()).norm() / want.float().norm()).reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.item() <= 2e-2
    if dist.get_rank() == 0:
        print(f"{what}: max relative diff vs the plain MoE block {worst.item():.1e}, {'OK' if ok else 'MISMATCH'}")
    assert ok, f"{what} differs from the plain MoE block by {worst.item()}"


def main() -> None:
    if not dist.is_initialized():  # under torchrun (the test suite starts its ranks itself)
        gpus = torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
        dist.init_process_group("nccl" if gpus else "gloo")
    rank = dist.get_rank()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    # tokens per rank, hidden, expert FFN, experts, top-k: Mixtral-like on GPUs, or CPU-sized
    T, hidden, ffn, num_experts, top_k = (4096, 4096, 14336, 8, 2) if on_gpu else (64, 64, 96, 4, 2)
    ep = dist.group.WORLD  # the expert-parallel group: every rank here
    torch.manual_seed(0)  # the same plain block on every rank
    block = MoEBlock(hidden, ffn, num_experts, top_k, dtype=torch.bfloat16, device=device)
    torch.manual_seed(1 + rank)  # this rank's own tokens
    x_r = torch.randn(T, hidden, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        want = block(x_r)  # the plain block on this rank's tokens

    layer = ExpertParallelMLP.from_moe_block(block, ep)  # ep: the expert-parallel group; num_experts % its size == 0
    y_r = layer(x_r)                                      # x_r [..., H]: this rank's tokens, routed by the gate
    check("ExpertParallelMLP.from_moe_block", y_r, want)

    layer = ExpertParallelMLP(hidden, ffn, num_experts, top_k, group=ep, gate=True, dtype=torch.bfloat16,
                              device=device)
    with torch.no_grad():
        layer.gate.weight.copy_(block.gate.weight)
        for i in range(layer.local_experts):
            expert = block.experts[layer.first_expert + i]
            layer.w13[i, :ffn].copy_(expert.w1.weight)
            layer.w13[i, ffn:].copy_(expert.w3.weight)
            layer.w2[i].copy_(expert.w2.weight)
    check("ExpertParallelMLP, weights copied in", layer(x_r), want)

    # The ops, on this rank's L experts: w_up [L, H, 2F] (w1 and w3 side by side), w_down [L, F, H].
    with torch.no_grad():
        topk_idx, topk_weights = route(block.gate(x_r), top_k)  # [T, k] each: the experts and their weights
        experts = block.experts[layer.first_expert : layer.first_expert + layer.local_experts]
        w_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]).t() for e in experts])
        w_down = torch.stack([e.w2.weight.t() for e in experts])

    routing = fo.moe_layout(topk_idx, num_experts, ep)  # topk_idx [T, k]: each token's experts; collective
    h = fo.moe_dispatch_gemm(x_r, w_up, routing, ep)  # x_r [T, H], w_up [L, H, 2F] -> h [received rows, 2F]
    a = F.silu(h[:, :ffn]) * h[:, ffn:]  # any row-wise activation; SwiGLU here
    y_r = fo.moe_gemm_combine(a, w_down, topk_weights, routing, ep)  # w_down [L, F, H] -> y_r [T, H]
    check("moe_layout, moe_dispatch_gemm, moe_gemm_combine", y_r, want)


if __name__ == "__main__":
    if sys.argv[1:]:  # it takes no options: a misspelt one must not pass for a run of the example
        sys.exit(f"{sys.argv[0]} takes no arguments, got: {' '.join(sys.argv[1:])}")
    if "RANK" not in os.environ:  # not under torchrun: one line, not torch's traceback
        sys.exit(f"start it under torchrun: torchrun --nproc-per-node 2 {sys.argv[0]}")
    main()
    dist.destroy_process_group()
