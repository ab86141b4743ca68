"""``flashoverlap demo [--op ...] [--shape M,N,K]``: one overlapped op (GEMM+AllReduce by default, or
GEMM+ReduceScatter, AllGather+GEMM), checked against plain PyTorch.

Without two GPUs it starts 2 CPU processes (gloo) and runs the reference communicator on the plan the GPU path
overlaps with at that shape; with two or more GPUs it runs the real overlapped op and times it next to the
sequential matmul and collective. Exits non-zero if the result differs from the plain PyTorch one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.runtime import plan_for
from flashoverlap.testing import plain, spawn

OPS = {"all_reduce": ("gemm_all_reduce", "matmul + all_reduce"),
       "reduce_scatter": ("gemm_reduce_scatter", "matmul + reduce_scatter"),
       "all_gather": ("all_gather_gemm", "all_gather + matmul")}

CPU_SHAPE = (4096, 4096, 1024)
GPU_SHAPE = (16384, 8192, 4096)
# Sums of world_size products in the input dtype: a few units in the last place.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _run(rank: int, world_size: int, op: str, m: int, n: int, k: int, dtype_name: str, on_gpu: bool) -> dict:
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    rows = m // world_size if op == "all_gather" else m  # all-gather: each rank holds its shard of the rows
    a = torch.randn(rows, k, dtype=dtype, device=device, generator=gen)
    w = torch.randn(n, k, dtype=dtype, device=device, generator=gen) / k**0.5
    b = w.t()  # an nn.Linear weight's transposed view, as a parallel linear layer holds it
    fn = getattr(fo, OPS[op][0])
    if on_gpu:
        got = fn(a, b)
        plan = plan_for(op, m, n, k, dist.group.WORLD, device, dtype)
    else:
        # The plan the GPU path overlaps with at this shape (an H200's 132 SMs, NVLink-class bandwidth).
        plan = fo.default_plan(op, m, n, k, world_size, allow_sequential=False)
        got = fn(a, b, plan=plan, path="reference")
    want = plain(op, a, b)
    rel_err = float((got.double() - want.double()).norm() / want.double().norm())
    out = {"plan": plan.describe(a.element_size()), "rel_err": rel_err, "nan": bool(torch.isnan(got).any())}
    if on_gpu:
        from flashoverlap.bench.timing import time_side_by_side

        out["times"] = time_side_by_side(
            {"sequential": lambda: plain(op, a, b), "flashoverlap": lambda: fn(a, b)}, iters=20)
    return out


def main(shape: tuple[int, int, int] | None, dtype_name: str, world_size: int | None, cpu: bool,
         op: str = "all_reduce") -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    on_gpu = gpus >= 2 and not cpu
    m, n, k = shape or (GPU_SHAPE if on_gpu else CPU_SHAPE)
    if world_size is None:
        world_size = gpus if on_gpu else 2
    if on_gpu and world_size > gpus:
        raise SystemExit(f"--world-size {world_size} needs that many GPUs, found {gpus}")
    where = f"{world_size} GPUs, NCCL" if on_gpu else f"{world_size} CPU processes, gloo, reference communicator"
    if op != "all_reduce" and m % world_size:
        raise SystemExit(f"--shape {m},{n},{k}: {OPS[op][0]} needs M divisible by the {world_size} ranks")
    print(f"flashoverlap demo: {OPS[op][0]} of [{m}, {k}] @ [{k}, {n}] {dtype_name} on {where}")
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    results = spawn(_run, world_size, "nccl" if on_gpu else "gloo", args=(op, m, n, k, dtype_name, on_gpu), env=env)
    print(results[0]["plan"])
    worst = max(r["rel_err"] for r in results)
    ok = worst < TOLERANCE[getattr(torch, dtype_name)] and not any(r["nan"] for r in results)
    if on_gpu:
        t = results[0]["times"]
        print(f"time: sequential {OPS[op][1]} {t['sequential']:.3f} ms, flashoverlap {t['flashoverlap']:.3f} ms "
              f"({t['sequential'] / t['flashoverlap']:.2f}x)")
    verdict = "OK" if ok else "MISMATCH"
    print(f"verdict: {verdict}: result vs {OPS[op][1]}, worst relative error over ranks {worst:.2e}")
    return 0 if ok else 1
