"""Where an op's host time goes: cProfile over 20 calls of each op and path at one shape (default 4096x8192x8192),
each call queued behind a GPU sleep so that the host never blocks on a full launch queue. Prints, per (op, path),
the host time per call beside plain PyTorch's (matmul then the collective, unprofiled) and the functions with the
most own time.

torchrun --nproc-per-node 2 -m benchmarks.diagnostics.host_profile [nccl,p2p [M,N,K]]"""

import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.timing import host_us
from flashoverlap.testing import plain

SHAPE = (4096, 8192, 8192)
PROFILE_SLEEP = 20_000_000  # about 10 ms of GPU work ahead of each call
OPS = fo.ops.GEMM_OPS


def main():
    require_cuda("benchmarks.diagnostics.host_profile", per_rank=True)
    paths = (sys.argv[1] if len(sys.argv) > 1 else "nccl,p2p").split(",")
    m, n, k = (int(x) for x in sys.argv[2].split(",")) if len(sys.argv) > 2 else SHAPE
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    for op in OPS:
        rows = m // world if op == "all_gather" else m
        a = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t() / k**0.5
        plain_us = host_us(lambda: plain(op, a, b), sleep_cycles=PROFILE_SLEEP)  # noqa: B023
        for path in paths:
            ours_us = host_us(lambda: OPS[op](a, b, path=path), sleep_cycles=PROFILE_SLEEP)  # noqa: B023
            profile = cProfile.Profile()
            spent = 0.0
            for _ in range(20):
                dist.barrier()
                torch.cuda.synchronize()
                torch.cuda._sleep(PROFILE_SLEEP)
                t0 = time.perf_counter()
                profile.enable()
                OPS[op](a, b, path=path)
                profile.disable()
                spent += time.perf_counter() - t0
            torch.cuda.synchronize()
            if rank == 0:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
                body = "\n".join(line for line in text.getvalue().splitlines() if line.strip())
                print(f"== {op} {m}x{n}x{k} {path}: {1e6 * spent / 20:.0f} us host per call profiled, {ours_us:.0f} "
                      f"unprofiled; plain PyTorch {plain_us:.0f} us)\n{body}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
