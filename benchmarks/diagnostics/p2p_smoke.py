"""First contact of one op's P2P path with the GPUs: correctness at a few odd and grid shapes (NaN-poisoned, against
matmul + NCCL), then the op timed beside matmul-then-NCCL and the NCCL path at grid shapes. One line per step,
flushed, so that a stall shows where it happened; run each op under its own ``timeout``.

torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_smoke {all_reduce|reduce_scatter|all_gather}"""

import os
import sys
import time

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.results_file import require_cuda
from flashoverlap.testing import plain
from flashoverlap.tune.timing import time_side_by_side

SHAPES = [(256, 512, 128), (1000, 1000, 100), (778, 2000, 1234), (4096, 4096, 4096)]  # M divisible by W
GRID = {"all_reduce": [(8192, 8192, 8192), (16384, 8192, 4096)],
        "reduce_scatter": [(8192, 8192, 8192), (16384, 8192, 4096)],
        "all_gather": [(8192, 14336, 8192), (16384, 8192, 8192)]}


def call(op, a, b, path):
    fn = fo.ops.GEMM_OPS[op]
    return fn(a, b, path=path)


def operands(op, m, n, k, world, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = m // world if op == "all_gather" else m
    a = torch.randn(rows, k, dtype=dtype, device="cuda", generator=gen)
    b = torch.randn(n, k, dtype=dtype, device="cuda", generator=gen).t() / k**0.5
    return a, b


def say(msg):
    print(f"[{time.strftime('%H:%M:%S')}] rank {dist.get_rank()}: {msg}", flush=True)


def main():
    require_cuda("benchmarks.diagnostics.p2p_smoke", per_rank=True)
    op = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    for i, (m, n, k) in enumerate(SHAPES):
        for dtype in (torch.bfloat16, torch.float16):
            a, b = operands(op, m, n, k, world, dtype, 17 * i + rank)
            want = plain(op, a, b)
            torch.cuda.synchronize()
            say(f"{op} {m}x{n}x{k} {dtype}: calling")
            torch.full((1 << 28,), float("nan"), dtype=torch.float16, device="cuda")  # poison the allocator
            got = call(op, a, b, "p2p")
            torch.cuda.synchronize()
            nan = bool(torch.isnan(got).any())
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            again = torch.equal(call(op, a, b, "p2p"), got)
            say(f"{op} {m}x{n}x{k} {dtype}: nan={nan} rel_err={err:.2e} repeat_bitwise={again}")
    for m, n, k in GRID[op]:
        a, b = operands(op, m, n, k, world, torch.bfloat16, rank)
        fns = {"seq": lambda a=a, b=b: plain(op, a, b),
               "nccl": lambda a=a, b=b: call(op, a, b, "nccl"), "p2p": lambda a=a, b=b: call(op, a, b, "p2p")}
        host = {}
        times = time_side_by_side(fns, warmup=3, iters=10, host_us=host)
        say(f"{op} {m}x{n}x{k} ms: " + ", ".join(f"{k_}={v:.3f} (host {host[k_]:.0f} us)" for k_, v in times.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
