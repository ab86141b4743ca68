"""``python -m flashoverlap.bench`` (under ``torchrun --nproc-per-node W``): the all-reduce grid of BENCHMARK.md.

Prints, per shape: T_gemm (cuBLAS), our GEMM alone (signalling on, the overlapped op's configuration), T_comm,
T_seq, the best decomposition, flashoverlap's T, T_ideal, speedup and E; writes
``benchmarks/results/<gpus>-<setting>.json``. ``--sweep`` also times a family of plans per shape (groups, programs,
NCCL CTAs) and reports each, to show which choices matter. ``--interference`` measures how a GEMM and NCCL slow
each other down when they share the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.bench.baselines import DecomposedAllReduce, sequential_all_reduce
from flashoverlap.bench.timing import time_ms
from flashoverlap.comm import nccl
from flashoverlap.kernels.gemm import gemm
from flashoverlap.ops.gemm_all_reduce import plan_for
from flashoverlap.plan import default_plan

GRID_ALL_REDUCE = [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 4096), (8192, 8192, 14336),
                   (2048, 8192, 14336)]


def _setting() -> str:
    return "pcie-like" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


def _meta(args: argparse.Namespace, world_size: int) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        commit = commit.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("FLASHOVERLAP_COMMIT", "unknown")
    nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())
    return {
        "gpus": f"{world_size}x {torch.cuda.get_device_name()}",
        "world_size": world_size,
        "setting": _setting(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "nccl": nccl_version,
        "commit": os.environ.get("FLASHOVERLAP_COMMIT", commit),
        "command": os.environ.get("FLASHOVERLAP_COMMAND", " ".join(["python -m flashoverlap.bench", *sys.argv[1:]])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_DEV"))},
    }


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, rank: int):
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    a = torch.randn(m, k, dtype=dtype, device="cuda", generator=gen)
    w = torch.randn(n, k, dtype=dtype, device="cuda", generator=gen) / k**0.5
    return a, w.t()  # b as an nn.Linear weight's transposed view


def _efficiency(t_seq: float, t: float, t_ideal: float) -> float:
    return (t_seq - t) / (t_seq - t_ideal) if t_seq > t_ideal else float("nan")


def bench_all_reduce(m, n, k, dtype, args, rank, world_size, device) -> dict:
    a, b = _inputs(m, n, k, dtype, rank)
    group = dist.group.WORLD
    c = torch.matmul(a, b)
    t_gemm = time_ms(lambda: torch.matmul(a, b), iters=args.iters)
    t_comm = time_ms(lambda: dist.all_reduce(c), iters=args.iters)
    t_seq = time_ms(lambda: sequential_all_reduce(a, b), iters=args.iters)
    decomposition = {}
    for chunks in (2, 4, 8):
        fn = DecomposedAllReduce(chunks, device)
        decomposition[chunks] = time_ms(lambda fn=fn: fn(a, b), iters=args.iters)
    plan = plan_for(m, n, k, world_size, device, dtype)
    # Our GEMM alone with signalling on, in the plan the op uses (an overlapping plan even where the op would
    # choose sequential, so the figure always describes the kernel).
    kernel_plan = plan if not plan.sequential else default_plan(
        "all_reduce", m, n, k, world_size, num_sms=device_sms(device), allow_sequential=False)
    counters = torch.zeros(kernel_plan.num_groups, dtype=torch.int32, device=device)
    t_our_gemm = time_ms(lambda: gemm(a, b, kernel_plan, counters=counters), iters=args.iters,
                         before=counters.zero_)
    t = time_ms(lambda: fo.gemm_all_reduce(a, b, plan=plan), iters=args.iters)
    t_ideal = max(t_gemm, t_comm)
    row = {
        "op": "all_reduce", "path": "nccl", "dtype": str(dtype).replace("torch.", ""), "M": m, "N": n, "K": k,
        "t_gemm_ms": t_gemm, "t_our_gemm_ms": t_our_gemm, "t_comm_ms": t_comm, "t_seq_ms": t_seq, "t_ms": t,
        "t_ideal_ms": t_ideal, "speedup": t_seq / t, "E": _efficiency(t_seq, t, t_ideal),
        "our_gemm_vs_cublas": t_gemm / t_our_gemm,
        "baselines": {"decomposition_ms": min(decomposition.values()),
                      "decomposition_by_chunks_ms": decomposition, "async_tp_ms": None},
        "plan": {"groups": plan.num_groups, "programs": plan.grid_size, "comm_ctas": plan.comm_ctas,
                 "sequential": plan.sequential, "tile": [plan.tile.block_m, plan.tile.block_n, plan.tile.block_k,
                                                         plan.tile.group_m]},
    }
    if args.sweep:
        row["sweep"] = sweep_all_reduce(a, b, args, world_size, device, t_seq, t_ideal)
    return row


def device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sweep_all_reduce(a, b, args, world_size, device, t_seq, t_ideal) -> list[dict]:
    """Time a family of plans: how many groups, how many GEMM programs, how many NCCL CTAs."""
    m, k = a.shape
    n = b.shape[1]
    sms = device_sms(device)
    tiles = default_plan("all_reduce", m, n, k, world_size, allow_sequential=False).num_tiles
    out = []
    for groups in args.sweep_groups:
        for programs in (sms, sms - 16, sms - 32, tiles):
            for comm_ctas in args.sweep_ctas:
                plan = default_plan("all_reduce", m, n, k, world_size, num_sms=sms, num_groups=groups,
                                    num_programs=programs, comm_ctas=comm_ctas, allow_sequential=False)
                t = time_ms(lambda plan=plan: fo.gemm_all_reduce(a, b, plan=plan), warmup=2,
                            iters=args.sweep_iters)
                rec = {"groups": plan.num_groups, "programs": plan.grid_size, "comm_ctas": comm_ctas, "t_ms": t,
                       "E": _efficiency(t_seq, t, t_ideal)}
                out.append(rec)
                if dist.get_rank() == 0:
                    print(f"    sweep {m}x{n}x{k} groups={rec['groups']:3d} programs={rec['programs']:5d} "
                          f"comm_ctas={comm_ctas:3d}: {t:.3f} ms  E={rec['E']:+.2f}", flush=True)
    return out


def interference(args, rank, world_size, device, dtype) -> dict:
    """Steady state: a stream of cuBLAS GEMMs beside a stream of NCCL all-reduces, with NCCL's CTAs capped or
    not; each one's time per call alone and together."""
    m = n = k = 8192
    a, b = _inputs(m, n, k, dtype, rank)
    c = torch.matmul(a, b)
    reps = 20
    results = {}
    for comm_ctas in [0, *args.sweep_ctas]:
        comm_ctas = int(comm_ctas)
        if comm_ctas and comm_ctas in results:
            continue
        comm = nccl.communicator(dist.group.WORLD, device)
        group = comm._comm_group(comm_ctas)
        dist.all_reduce(c, group=group)
        side = torch.cuda.Stream(device=device, priority=-(1 << 10))
        main = torch.cuda.current_stream()

        def gemms():
            for _ in range(reps):
                torch.matmul(a, b)

        def comms():
            with torch.cuda.stream(side):
                for _ in range(reps):
                    dist.all_reduce(c, group=group)
            main.wait_stream(side)

        def both():
            side.wait_stream(main)
            ev_g0, ev_g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev_c0, ev_c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                ev_c0.record()
                for _ in range(reps):
                    dist.all_reduce(c, group=group)
                ev_c1.record()
            ev_g0.record()
            gemms()
            ev_g1.record()
            main.wait_stream(side)
            torch.cuda.synchronize()
            return ev_g0.elapsed_time(ev_g1) / reps, ev_c0.elapsed_time(ev_c1) / reps

        t_g = time_ms(gemms, warmup=1, iters=3) / reps
        t_c = time_ms(comms, warmup=1, iters=3) / reps
        both()
        pairs = [both() for _ in range(3)]
        g_both = sorted(p[0] for p in pairs)[1]
        c_both = sorted(p[1] for p in pairs)[1]
        results[comm_ctas] = {"gemm_alone_ms": t_g, "allreduce_alone_ms": t_c, "gemm_beside_ms": g_both,
                              "allreduce_beside_ms": c_both}
        if rank == 0:
            print(f"  interference comm_ctas={comm_ctas or 'default':>7}: GEMM {t_g:.3f} -> {g_both:.3f} ms, "
                  f"all-reduce 128 MiB {t_c:.3f} -> {c_both:.3f} ms", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashoverlap.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None, help="M,N,K;M,N,K;... (default: BENCHMARK.md's all-reduce grid)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="also time a family of plans per shape")
    parser.add_argument("--sweep-groups", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16])
    parser.add_argument("--sweep-ctas", type=lambda s: [int(x) for x in s.split(",")], default=[0, 8, 16, 32])
    parser.add_argument("--sweep-iters", type=int, default=10)
    parser.add_argument("--interference", action="store_true", help="measure GEMM/NCCL mutual slowdown")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<gpus>-<setting>.json)")
    args = parser.parse_args(argv)

    if "RANK" not in os.environ:
        parser.error("run it under torchrun, e.g. torchrun --nproc-per-node 2 -m flashoverlap.bench")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    shapes = GRID_ALL_REDUCE if args.shapes is None else [
        tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]

    meta = _meta(args, world_size)
    rows = []
    if rank == 0:
        print(f"# {meta['gpus']}, {meta['setting']}, torch {meta['torch']}, triton {meta['triton']}, "
              f"NCCL {meta['nccl']}, commit {meta['commit']}", flush=True)
    for m, n, k in shapes:
        row = bench_all_reduce(m, n, k, dtype, args, rank, world_size, device)
        rows.append(row)
        if rank == 0:
            print(f"  {m}x{n}x{k}: done, E={row['E']:+.2f}", flush=True)
    extra = {}
    if args.interference:
        extra["interference"] = interference(args, rank, world_size, device, dtype)
    if rank == 0:
        print_table(rows, meta)
        gpu = torch.cuda.get_device_name().split()[-1].lower()
        out = args.out or os.path.join("benchmarks", "results", f"{gpu}x{world_size}-{meta['setting']}.json")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows, **extra}, f, indent=1)
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def print_table(rows: list[dict], meta: dict) -> None:
    print(f"\ngemm_all_reduce, {meta['gpus']}, {meta['setting']}, {rows[0]['dtype'] if rows else ''} (ms)")
    header = (f"{'M x N x K':>20} {'T_gemm':>7} {'ourGEMM':>7} {'T_comm':>7} {'T_seq':>7} {'decomp':>7} "
              f"{'T':>7} {'T_ideal':>7} {'speedup':>7} {'E':>6}")
    print(header)
    for r in rows:
        print(f"{r['M']:>6}x{r['N']:>6}x{r['K']:>6} {r['t_gemm_ms']:7.3f} {r['t_our_gemm_ms']:7.3f} "
              f"{r['t_comm_ms']:7.3f} {r['t_seq_ms']:7.3f} {r['baselines']['decomposition_ms']:7.3f} "
              f"{r['t_ms']:7.3f} {r['t_ideal_ms']:7.3f} {r['speedup']:7.2f} {r['E']:+6.2f}")


if __name__ == "__main__":
    sys.exit(main())
