"""One all_gather_gemm shape, each piece timed on its own with a debug spin bound, to find which one stalls.

torchrun --nproc-per-node 2 -m benchmarks.diagnostics.all_gather_one_shape M N K  (M = gathered rows)
Run with FLASHOVERLAP_DEBUG_TIMEOUT set: the op then raises, naming the band, instead of spinning forever."""

import os
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.baselines import DecomposedAllGather
from flashoverlap.ops.all_gather_gemm import all_gather_gemm
from flashoverlap.runtime import plan_for


def step(name, fn):
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize()
        msg = f"{(time.perf_counter() - t0) * 1e3:.2f} ms"
    except Exception as exc:  # report and go on to the next piece
        msg = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(f"rank {dist.get_rank()} {name}: {msg}", flush=True)


def main():
    require_cuda("benchmarks.diagnostics.all_gather_one_shape", per_rank=True)
    m, n, k = (int(x) for x in sys.argv[1:4])
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    a_shard = torch.randn(m // world, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, k, dtype=torch.bfloat16, device=device).t() / k**0.5
    plan = plan_for("all_gather", (m, n, k), dist.group.WORLD, device, torch.bfloat16)
    if rank == 0:
        print(plan.describe(), flush=True)
    full = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    step("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(full, a_shard))
    step("matmul", lambda: torch.matmul(full, b))
    step("decomposition 2", lambda: DecomposedAllGather(2, device)(a_shard, b))
    for i in range(3):
        step(f"all_gather_gemm #{i}", lambda: all_gather_gemm(a_shard, b, plan=plan))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
