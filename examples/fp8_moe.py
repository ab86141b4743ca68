"""fp8 experts: fp8 training of the expert-parallel MoE layer, the layer with fp8 weights for inference, and the fp8
expert ops on DeepEP-format rows.

    torchrun --nproc-per-node 2 examples/fp8_moe.py

A plain bf16 ``MoEBlock``, the same on every rank, sharded with ``ExpertParallelMLP.from_moe_block``: trained one step
in fp8 (``fp8="row"``, torchao's row-wise MoE recipe: output and gradients against the bf16 block's), then converted
to fp8 experts for inference (row-wise and 128x128 block scales); then the ops themselves, given fp8 token rows with
one scale per 128 channels (DeepSeek-V3's and DeepEP's layout). NCCL and GPU-sized tensors where every rank has a
GPU; else gloo, CPU-sized tensors and the reference path. Prints the largest relative difference from the bf16 block
over every rank and raises beyond fp8 rounding.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashoverlap as fo
from flashoverlap.nn import ExpertParallelMLP, Float8ExpertParallelMLP, MoEBlock, route
from flashoverlap.nn.fp8_moe import quantise_weight


def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """The largest relative difference over every rank; raises beyond fp8 rounding (e4m3: 3 mantissa bits)."""
    worst = ((got.float() - want.float()).norm() / want.float().norm()).reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.item() <= 1e-1
    if dist.get_rank() == 0:
        print(f"{what}: max relative diff vs the bf16 MoE block {worst.item():.1e}, {'OK' if ok else 'MISMATCH'}")
    assert ok, f"{what} differs from the bf16 MoE block by {worst.item()}"


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` as fp8 e4m3 with one fp32 scale per 128 channels ``[T, H/128]`` (DeepEP's dispatch format)."""
    blocks = x.float().view(x.shape[0], -1, 128)
    scale = blocks.abs().amax(2).clamp_min(1e-12) / 448
    return (blocks / scale[:, :, None]).view_as(x).to(torch.float8_e4m3fn), scale


def main() -> None:
    if not dist.is_initialized():  # under torchrun (the test suite starts its ranks itself)
        gpus = torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
        dist.init_process_group("nccl" if gpus else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    # tokens per rank, hidden, expert FFN, experts, top-k: DeepSeek-V3-like widths on GPUs, or CPU-sized
    T, hidden, ffn, num_experts, top_k = (4096, 7168, 2048, 16, 4) if on_gpu else (32, 256, 128, 4, 2)
    torch.manual_seed(0)  # the same plain block on every rank
    block = MoEBlock(hidden, ffn, num_experts, top_k, dtype=torch.bfloat16, device=device)
    torch.manual_seed(1 + rank)  # this rank's own tokens
    x_r = torch.randn(T, hidden, dtype=torch.bfloat16, device=device)
    grad_r = torch.randn(T, hidden, dtype=torch.bfloat16, device=device)

    # Training: the bf16 parameters are the master weights; the forward GEMMs and both backward GEMMs run in fp8
    # (power-of-2 row-wise scales, as torchao's MoE training casts), the tokens cross the wire as fp8, grads are bf16.
    x = x_r.clone().requires_grad_()
    layer = ExpertParallelMLP.from_moe_block(block, fp8="row")
    y = layer(x)
    y.backward(grad_r)
    x_bf16 = x_r.clone().requires_grad_()
    y_bf16 = block(x_bf16)  # the bf16 block, for the check: its expert grads from every rank's tokens
    y_bf16.backward(grad_r)
    w13_grad = torch.stack([torch.cat([e.w1.weight.grad, e.w3.weight.grad]) for e in block.experts]).float()
    dist.all_reduce(w13_grad)  # every expert's, from every rank's tokens
    own = slice(layer.first_expert, layer.first_expert + layer.local_experts)
    check("ExpertParallelMLP(fp8='row') training: output", y.detach(), y_bf16.detach())
    check("ExpertParallelMLP(fp8='row') training: grad x", x.grad, x_bf16.grad)
    check("ExpertParallelMLP(fp8='row') training: grad w13", layer.w13.grad, w13_grad[own])

    with torch.no_grad():
        want = block(x_r)

        # The layer: bf16 experts sharded over the ranks, then converted to fp8 (weights and their scales as
        # buffers); every forward quantises the tokens, dispatches fp8 rows with their scales and returns bf16.
        for scaling in ("row", "block"):
            layer = ExpertParallelMLP.from_moe_block(block)
            fp8_layer = Float8ExpertParallelMLP.from_float(layer, scaling)
            check(f"Float8ExpertParallelMLP ({scaling}-wise)", fp8_layer(x_r), want)

        # The ops on DeepEP-format rows: fp8 x with [T, H/128] scales crosses the wire as fp8 (0.52x the bf16 bytes
        # at H = 7168); expert weights fp8 with 128x128 block scales; the intermediate is quantised by the combine.
        local = num_experts // world
        own = range(rank * local, (rank + 1) * local)
        w13 = torch.stack([torch.cat([block.experts[e].w1.weight, block.experts[e].w3.weight]) for e in own])
        w2 = torch.stack([block.experts[e].w2.weight for e in own])
        w13_fp8, w13_scale = quantise_weight(w13, "block")  # [L, 2F, H] and its scales for the [L, H, 2F] view
        w2_fp8, w2_scale = quantise_weight(w2, "block")
        topk_idx, topk_weights = route(block.gate(x_r), top_k)
        x_fp8, x_scale = quantise_rows(x_r)
        routing = fo.moe_layout(topk_idx, num_experts)
        h = fo.moe_dispatch_gemm(x_fp8, w13_fp8.transpose(1, 2), routing, scale_x=x_scale, scale_w=w13_scale)
        a = F.silu(h[:, :ffn]) * h[:, ffn:]
        y = fo.moe_gemm_combine(a, w2_fp8.transpose(1, 2), topk_weights, routing, scale_w=w2_scale)
        check("moe_dispatch_gemm / moe_gemm_combine (fp8 rows with 128-channel scales)", y, want)


if __name__ == "__main__":
    if sys.argv[1:]:  # it takes no options: a misspelt one must not pass for a run of the example
        sys.exit(f"{sys.argv[0]} takes no arguments, got: {' '.join(sys.argv[1:])}")
    if "RANK" not in os.environ:  # not under torchrun: one line, not torch's traceback
        sys.exit(f"start it under torchrun: torchrun --nproc-per-node 2 {sys.argv[0]}")
    main()
    dist.destroy_process_group()
