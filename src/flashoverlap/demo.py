"""``python -m flashoverlap demo``: one overlapped GEMM+AllReduce, checked against plain PyTorch.

Without two GPUs it starts 2 CPU processes (gloo) and runs the reference communicator on the plan the GPU path
overlaps with at that shape; with two or more GPUs it runs the real overlapped op and times it next to
sequential matmul-then-all-reduce. Exits non-zero if the result differs from ``torch.matmul`` + ``all_reduce``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.ops.gemm_all_reduce import plan_for
from flashoverlap.testing import spawn

CPU_SHAPE = (4096, 4096, 1024)
GPU_SHAPE = (16384, 8192, 4096)
# Sums of world_size products in the input dtype: a few units in the last place.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _run(rank: int, world_size: int, m: int, n: int, k: int, dtype_name: str, on_gpu: bool) -> dict:
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    a = torch.randn(m, k, dtype=dtype, device=device, generator=gen)
    w = torch.randn(n, k, dtype=dtype, device=device, generator=gen) / k**0.5
    b = w.t()  # an nn.Linear weight's transposed view, as a row-parallel layer holds it
    if on_gpu:
        got = fo.gemm_all_reduce(a, b)
        plan = plan_for(m, n, k, dist.group.WORLD, device, dtype)
    else:
        # The plan the GPU path overlaps with at this shape (an H200's 132 SMs, NVLink-class bandwidth).
        plan = fo.default_plan("all_reduce", m, n, k, world_size, allow_sequential=False)
        got = fo.gemm_all_reduce(a, b, plan=plan, path="reference")
    want = torch.matmul(a, b)  # the plain PyTorch result
    dist.all_reduce(want)
    rel_err = float((got.double() - want.double()).norm() / want.double().norm())
    out = {"plan": plan.describe(a.element_size()), "rel_err": rel_err, "nan": bool(torch.isnan(got).any())}
    if on_gpu:
        from flashoverlap.bench.baselines import sequential_all_reduce
        from flashoverlap.bench.timing import time_side_by_side

        out["times"] = time_side_by_side(
            {"sequential": lambda: sequential_all_reduce(a, b), "flashoverlap": lambda: fo.gemm_all_reduce(a, b)},
            iters=20,
        )
    return out


def main(m: int | None, n: int | None, k: int | None, dtype_name: str, world_size: int | None, cpu: bool) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    on_gpu = gpus >= 2 and not cpu
    default = GPU_SHAPE if on_gpu else CPU_SHAPE
    m, n, k = m or default[0], n or default[1], k or default[2]
    if world_size is None:
        world_size = gpus if on_gpu else 2
    if on_gpu and world_size > gpus:
        raise SystemExit(f"--world-size {world_size} needs that many GPUs, found {gpus}")
    if not on_gpu and dtype_name == "bfloat16":
        dtype_name = "float16"  # CPU matmuls in fp32 either way; fp16 keeps the printout comparable
    where = f"{world_size} GPUs, NCCL" if on_gpu else f"{world_size} CPU processes, gloo, reference communicator"
    print(f"flashoverlap demo: gemm_all_reduce of [{m}, {k}] @ [{k}, {n}] {dtype_name} on {where}")
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    results = spawn(_run, world_size, "nccl" if on_gpu else "gloo", args=(m, n, k, dtype_name, on_gpu), env=env)
    print(results[0]["plan"])
    worst = max(r["rel_err"] for r in results)
    ok = worst < TOLERANCE[getattr(torch, dtype_name)] and not any(r["nan"] for r in results)
    if on_gpu:
        t = results[0]["times"]
        print(f"time: sequential matmul + all_reduce {t['sequential']:.3f} ms, flashoverlap {t['flashoverlap']:.3f} ms "
              f"({t['sequential'] / t['flashoverlap']:.2f}x)")
    verdict = "OK" if ok else "MISMATCH"
    print(f"verdict: {verdict}: result vs torch.matmul + all_reduce, worst relative error over ranks {worst:.2e}")
    return 0 if ok else 1
