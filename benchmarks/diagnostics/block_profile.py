"""Where the block's training step spends its GPU time, ours beside plain PyTorch TP and the no-communication
bound: ``torch.profiler`` over a few steps of each (after warm-up) and the kernels (and copies) with the most GPU
time per step. For the cases where ``E_block`` is low, to see which kernels grew.

torchrun --nproc-per-node 2 -m benchmarks.diagnostics.block_profile [TOKENS] [train|prefill]
"""

import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.block import Block, BlockConfig, TPBlock
from benchmarks.diagnostics.results_file import require_cuda

STEPS = 3


def main():
    require_cuda("benchmarks.diagnostics.block_profile", per_rank=True)
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    mode = sys.argv[2] if len(sys.argv) > 2 else "train"
    if mode not in ("train", "prefill"):
        raise SystemExit(f"block_profile: the mode is train or prefill, got {mode!r}")
    rank = int(__import__("os").environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    cfg = BlockConfig()
    torch.manual_seed(0)
    block = Block(cfg, device="cuda", dtype=torch.bfloat16)
    variants = {impl: TPBlock(block, impl=impl) for impl in ("torch", "nocomm", "ours")}
    del block
    x = torch.randn(tokens // world, cfg.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "train")

    def step(model):
        if mode == "train":
            model(x).float().pow(2).mean().backward()
        else:
            with torch.no_grad():
                model(x)

    for impl, model in variants.items():
        for _ in range(3):
            step(model)
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(STEPS):
                step(model)
            torch.cuda.synchronize()
        if rank != 0:
            continue
        kernels = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:90]][0] += event.device_time / 1000 / STEPS
                kernels[event.name[:90]][1] += 1
        total = sum(v[0] for v in kernels.values())
        print(f"== {impl} {mode} {tokens} tokens: {total:.2f} ms of kernels per step (summed over streams)")
        for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:18]:
            print(f"  {ms:8.3f} ms  {count // STEPS:4d}x  {name}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
