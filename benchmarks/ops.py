"""``python -m flashoverlap.bench`` (under ``torchrun --nproc-per-node W``): docs/benchmarks.md's grid for the ops named
by ``--ops`` (default all-reduce).

Prints, per op and shape: T_gemm (cuBLAS), our GEMM alone (signalling on, the overlapped op's configuration),
T_comm, T_seq, the best decomposition, torch async TP, flashoverlap's T (and, for all-gather on NVLink, the P2P
path's), T_ideal, speedup and E; writes ``benchmarks/results/<gpus>-<setting>.json``. ``--sweep`` also times a
family of plans per shape (groups, programs, NCCL CTAs). ``--interference`` measures how a GEMM and NCCL slow each
other down when they share the GPU, ``--movers`` the same for copy engines and SM copies over NVLink.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.bench import op_rows
from flashoverlap.bench.args import add_bench_ops_arguments, join_values
from flashoverlap.bench.gemm_forms import gemm_form
from flashoverlap.bench.op_rows import inputs as _inputs
from flashoverlap.bench.rows import efficiency
from flashoverlap.bench.timing import time_ms
from flashoverlap.plan import nccl_free_sms
from flashoverlap.runtime import plan_for
from flashoverlap.runtime.context import context_of
from flashoverlap.tune.defaults import default_plan


def _setting() -> str:
    return "pcie-like" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


def _meta(args: argparse.Namespace, world_size: int, command: str | None = None) -> dict:
    """What a results file records about its run; ``command``: the module and the arguments its parser was given
    (default: this module's, from ``sys.argv``), unless ``FLASHOVERLAP_COMMAND`` names the exact command."""
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
        "triton": importlib.metadata.version("triton"),
        "nccl": nccl_version,
        "commit": os.environ.get("FLASHOVERLAP_COMMIT", commit),
        "command": os.environ.get("FLASHOVERLAP_COMMAND",
                                  command or " ".join(["python -m flashoverlap.bench", *sys.argv[1:]])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_DEV"))},
    }


def device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sweep_plans(op: str, call, shape: tuple[int, int, int], args, world_size, device, t_seq, t_ideal) -> list[dict]:
    """Time ``call(plan)`` over a family of plans of ``op`` at ``shape``: groups and their sizes, GEMM programs,
    NCCL CTAs (all-gather: only plans that leave NCCL its SMs, deadlock rule 2)."""
    m, n, k = shape
    sms = device_sms(device)
    tiles = default_plan(op, m, n, k, world_size, allow_sequential=False).num_tiles
    out = []
    for groups in args.sweep_groups:
        for profile in args.sweep_profiles:
            for programs in [tiles if p == "tiles" else sms - int(p) for p in args.sweep_programs]:
                for comm_ctas in args.sweep_ctas:
                    if op == "all_gather" and (comm_ctas < 1 or
                                               min(programs, tiles) + nccl_free_sms(sms, comm_ctas) > sms):
                        continue  # the op would refuse it (deadlock rule 2)
                    plan = default_plan(op, m, n, k, world_size, num_sms=sms, num_groups=groups,
                                        profile=profile, num_programs=programs, comm_ctas=comm_ctas,
                                        allow_sequential=False)
                    t = time_ms(lambda plan=plan: call(plan), warmup=2, iters=args.sweep_iters)
                    rec = {"groups": plan.num_groups, "profile": profile, "rows": list(plan.group_row_tiles),
                           "programs": plan.grid_size, "comm_ctas": comm_ctas, "t_ms": t,
                           "E": efficiency(t_seq, t, t_ideal)}
                    out.append(rec)
                    if dist.get_rank() == 0:
                        print(f"    sweep {op} {m}x{n}x{k} groups={rec['groups']:2d} {profile:>11} "
                              f"programs={rec['programs']:5d} comm_ctas={comm_ctas:3d}: {t:.3f} ms  "
                              f"E={rec['E']:+.2f}", flush=True)
    return out


GEMM_VARIANTS = [  # tile (block_m, block_n, block_k, group_m, stages, warps), programs, launcher options
    ((128, 256, 64, 8, 3, 8), "tiles", {}),
    ((128, 256, 64, 8, 3, 8), "sms", {}),
    ((128, 256, 64, 8, 3, 8), "sms", {"flatten": True}),
    ((128, 256, 64, 8, 3, 8), "sms", {"warp_specialize": True}),
    ((128, 256, 64, 8, 3, 8), "tiles", {"warp_specialize": True}),
    ((128, 256, 64, 8, 3, 4), "sms", {"warp_specialize": True}),
    ((128, 128, 64, 8, 4, 4), "sms", {"warp_specialize": True}),
    ((128, 256, 64, 8, 3, 8), "sms", {"flatten": True, "warp_specialize": True}),
    ((128, 256, 64, 8, 3, 8), "sms", {"tma_store": True}),
]


def sweep_gemm(m, n, k, dtype, rank, world_size, device) -> list[dict]:
    """Our GEMM alone (signalling on) against cuBLAS, over tile configurations, program counts and loop forms."""
    a, b = _inputs(m, n, k, dtype, rank)
    sms = device_sms(device)
    ref = torch.matmul(a, b)
    t_cublas = time_ms(lambda: torch.matmul(a, b), iters=20)
    out = []
    for cfg, programs, options in GEMM_VARIANTS:
        tile = fo.TileConfig(*cfg)
        base = default_plan("all_reduce", m, n, k, world_size, tile=tile, allow_sequential=False)
        plan = default_plan("all_reduce", m, n, k, world_size, tile=tile, allow_sequential=False,
                            num_programs=base.num_tiles if programs == "tiles" else sms)
        counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
        try:
            got = gemm_form(a, b, plan, counters.zero_(), options)
            torch.cuda.synchronize()
            err = float((got.float() - ref.float()).norm() / ref.float().norm())
            t = time_ms(lambda plan=plan, counters=counters, options=options: gemm_form(a, b, plan, counters,
                                                                                        options),
                        iters=20, before=counters.zero_)
        except Exception as exc:  # a loop form the compiler rejects, or out of shared memory
            t, err = float("nan"), float("nan")
            if rank == 0:
                print(f"    gemm {cfg} {options}: {type(exc).__name__}: {str(exc)[:200]}")
        out.append({"tile": list(cfg), "programs": plan.grid_size, "options": options, "t_ms": t,
                    "vs_cublas": t_cublas / t, "rel_err": err})
        if rank == 0:
            print(f"    gemm {m}x{n}x{k} {cfg} programs={plan.grid_size:5d} {options}: {t:.3f} ms vs cuBLAS "
                  f"{t_cublas:.3f} = {t_cublas / t:.3f}x (rel err {err:.1e})", flush=True)
    return out


def interference(args, rank, world_size, device, dtype) -> dict:
    """How a cuBLAS GEMM and an NCCL all-reduce slow each other down on one GPU.

    Steady state: 20 back-to-back 8192^3 GEMMs on one stream beside 20 back-to-back all-reduces of the 128 MiB
    result on a high-priority stream, per NCCL CTA count; each one's time per call alone and side by side.
    Single shot: one GEMM and one all-reduce on two streams, in either launch order, against both in sequence.
    """
    m = n = k = 8192
    a, b = _inputs(m, n, k, dtype, rank)
    c = torch.matmul(a, b)
    reps = 20
    main_stream = torch.cuda.current_stream()
    side = torch.cuda.Stream(device=device, priority=-(1 << 10))
    comm = context_of(dist.group.WORLD, device).communicator("gemm", "nccl")
    out = {"steady": {}, "single": {}}

    def timed(fn) -> tuple[float, float]:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        dist.barrier()
        torch.cuda.synchronize()
        fn(ev)
        main_stream.wait_stream(side)
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])

    for comm_ctas in dict.fromkeys([0, *args.sweep_ctas]):
        group = comm.comm_group(comm_ctas)
        dist.all_reduce(c, group=group)

        def gemms(ev):
            ev[0].record()
            for _ in range(reps):
                torch.matmul(a, b)
            ev[1].record()

        def comms(ev, group=group):
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                ev[2].record()
                for _ in range(reps):
                    dist.all_reduce(c, group=group)
                ev[3].record()

        def both(ev):
            comms(ev)
            gemms(ev)

        alone_g = sorted(timed(lambda ev: (gemms(ev), ev[2].record(), ev[3].record()))[0] for _ in range(3))[1]
        alone_c = sorted(timed(lambda ev: (ev[0].record(), ev[1].record(), comms(ev)))[1] for _ in range(3))[1]
        pairs = sorted(timed(both) for _ in range(3))
        rec = {"gemm_alone_ms": alone_g / reps, "allreduce_alone_ms": alone_c / reps,
               "gemm_beside_ms": pairs[1][0] / reps, "allreduce_beside_ms": pairs[1][1] / reps}
        out["steady"][comm_ctas] = rec
        if rank == 0:
            print(f"  steady state, NCCL CTAs {comm_ctas or 'default':>7}: GEMM {rec['gemm_alone_ms']:.3f} -> "
                  f"{rec['gemm_beside_ms']:.3f} ms, all-reduce 128 MiB {rec['allreduce_alone_ms']:.3f} -> "
                  f"{rec['allreduce_beside_ms']:.3f} ms", flush=True)

    def single(order: str) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        side.wait_stream(main_stream)
        for step in order.split("+"):
            if step == "gemm":
                torch.matmul(a, b)
            elif step == "comm-first" or step == "comm":
                with torch.cuda.stream(side):
                    dist.all_reduce(c)
            elif step == "seq":
                torch.matmul(a, b)
                dist.all_reduce(c)
        main_stream.wait_stream(side)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    for order in ("seq", "gemm+comm", "comm-first+gemm"):
        times = sorted(single(order) for _ in range(15))
        out["single"][order] = times[len(times) // 2]
        if rank == 0:
            print(f"  single shot {order:>16}: {out['single'][order]:.3f} ms", flush=True)
    return out


def start_run(prog: str, description: str, add_arguments, argv: list[str] | None,
              suffix: str) -> tuple[argparse.Namespace, list[str], dict, str, torch.device]:
    """A benchmark's start under torchrun, written once: its options parsed (``add_arguments``: the same as its
    ``flashoverlap bench`` subcommand's), the NCCL group on this rank's GPU, the results' meta and the default
    results path ``benchmarks/results/<gpu>x<W>-<setting><suffix>.json``. Returns the options, the argument list
    as parsed, the meta, the path and the device."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    argv = join_values(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error(f"run it under torchrun, e.g. torchrun --nproc-per-node 2 -m {prog.split()[-1]}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    world_size = dist.get_world_size()
    meta = _meta(args, world_size, " ".join([prog, *argv]))
    gpu = torch.cuda.get_device_name().split()[-1].lower()
    out = args.out or os.path.join("benchmarks", "results", f"{gpu}x{world_size}-{meta['setting']}{suffix}.json")
    return args, argv, meta, out, device


def main(argv: list[str] | None = None) -> int:
    # the same options as `flashoverlap bench ops`, defined once
    args, argv, meta, out, device = start_run("python -m flashoverlap.bench", __doc__.split("\n\n")[0],
                                              add_bench_ops_arguments, argv, "")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    shapes = op_rows.GRID_ALL_REDUCE if args.shapes is None else args.shapes
    rows = []
    if rank == 0:
        print(f"# {meta['gpus']}, {meta['setting']}, torch {meta['torch']}, triton {meta['triton']}, "
              f"NCCL {meta['nccl']}, commit {meta['commit']}", flush=True)
    benches = {"all_reduce": (op_rows.bench_all_reduce, op_rows.GRID_ALL_REDUCE),
               "reduce_scatter": (op_rows.bench_reduce_scatter, op_rows.GRID_REDUCE_SCATTER),
               "all_gather": (op_rows.bench_all_gather, op_rows.GRID_ALL_GATHER)}
    sweep = None
    if args.sweep:
        def sweep(op, call, shape, row):
            return sweep_plans(op, call, shape, args, world_size, device, row["t_seq_ms"], row["t_ideal_ms"])
    for op in args.ops:
        fn, grid = benches[op]
        op_shapes = grid if args.shapes is None else shapes

        def bench(m, n, k, fn=fn):
            return fn(m, n, k, dtype, args.iters, world_size, device, meta["setting"], sweep)

        for m, n, k in op_shapes:
            for row in bench(m, n, k):
                rows.append(row)
                if rank == 0:
                    auto = f", auto ({row['auto']['path']}) E={row['auto']['E']:+.2f}" if "auto" in row else ""
                    print(f"  {op} {row['path']} {m}x{n}x{k}: done, E={row['E']:+.2f}{auto}", flush=True)
                    write_results(out, meta, rows, {})  # so far, in case a later row fails
    extra = {}
    if args.timeline:
        extra["timeline"] = draw_timeline(args.timeline, rows, meta, dtype, world_size, device)
    if args.gemm_sweep:
        extra["gemm_sweep"] = {f"{m}x{n}x{k}": sweep_gemm(m, n, k, dtype, rank, world_size, device)
                               for m, n, k in shapes}
    if args.interference:
        extra["interference"] = interference(args, rank, world_size, device, dtype)
    if args.movers:
        from flashoverlap.bench.movers import movers

        extra["movers"] = movers(device, dtype)
    if rank == 0:
        print_table(rows, meta)
        write_results(out, meta, rows, extra)
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def write_results(path: str, meta: dict, rows: list[dict], extra: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows, **extra}, f, indent=1)


def finish_run(path: str, meta: dict, rows: list[dict]) -> int:
    """A torchrun benchmark's end, written once: rank 0 writes the results, then the group is taken down."""
    if dist.get_rank() == 0:
        write_results(path, meta, rows, {})
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


def draw_timeline(path: str, rows: list[dict], meta: dict, dtype, world_size: int, device) -> dict:
    """One call of an all-reduce row's shape with its plan, recorded and (on rank 0) drawn: the first row the op
    overlaps (NCCL path), else the first row."""
    from flashoverlap.bench import timeline

    candidates = [r for r in rows if r["op"] == "all_reduce" and r["path"] == "nccl"]
    row = next((r for r in candidates if not r["plan"]["sequential"]), candidates[0] if candidates else None)
    if row is None:
        raise SystemExit("--timeline needs an all_reduce row (--ops all_reduce)")
    m, n, k = row["M"], row["N"], row["K"]
    a, b = _inputs(m, n, k, dtype, dist.get_rank())
    plan = plan_for("all_reduce", m, n, k, dist.group.WORLD, device, dtype)
    note = ""
    if plan.sequential:  # draw the overlapped plan the op would use, and say so
        plan = default_plan("all_reduce", m, n, k, world_size, num_sms=device_sms(device), allow_sequential=False)
        note = " (the op runs this shape sequentially; the default overlapped plan drawn)"
    fo.gemm_all_reduce(a, b, plan=plan)  # warm
    recorded = timeline.record(lambda: fo.gemm_all_reduce(a, b, plan=plan), device)
    predicted = _predicted_group_times(plan, dtype, device)
    if dist.get_rank() == 0:
        title = (f"gemm_all_reduce {m}x{n}x{k} {row['dtype']}, {meta['gpus']}, {meta['setting']}: {plan.num_groups} "
                 f"groups, {plan.grid_size} programs, rank 0{note}")
        timeline.draw(path, title, recorded, row["t_seq_ms"], row["t_gemm_ms"], predicted)
        print(f"wrote {path}")
    return {"shape": [m, n, k], **recorded, "predicted_group_done_ms": predicted}


def _predicted_group_times(plan, dtype, device) -> list[float] | None:
    """The model's group finish times for ``plan``, where every rank has a bandwidth curve (``tune bandwidth``)."""
    from flashoverlap.bench import tuner
    from flashoverlap.runtime import settings
    from flashoverlap.tune import cache as plan_cache
    from flashoverlap.tune.model import predict
    from flashoverlap.tune.search import machine_of

    key = plan_cache.cache_key(torch.cuda.get_device_name(device), plan.world_size, plan.op, plan.path,
                               str(dtype).replace("torch.", ""), settings.current().nccl_p2p_disabled)
    curve = tuner.load_curve(key)
    everyone = torch.tensor([curve is not None], dtype=torch.int32, device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if not int(everyone):
        return None
    machines = tuner.measure_machine(plan.op, plan.m, plan.n, plan.k, dist.group.WORLD, device, dtype, plan.path,
                                     tuner.load_slowdowns(key))
    return list(predict(plan, machine_of(plan, machines), curve).group_done_ms)


def print_table(rows: list[dict], meta: dict) -> None:
    def ms(value):
        return f"{value:7.3f}" if isinstance(value, float) else f"{'-':>7}"

    for op, path in dict.fromkeys((r["op"], r["path"]) for r in rows):
        name = {"all_reduce": "gemm_all_reduce", "reduce_scatter": "gemm_reduce_scatter"}.get(op, "all_gather_gemm")
        print(f"\n{name}, path {path}, {meta['gpus']}, {meta['setting']}, {rows[0]['dtype']} (ms)")
        print(f"{'M x N x K':>20} {'T_gemm':>7} {'ourGEMM':>7} {'T_comm':>7} {'T_seq':>7} {'decomp':>7} "
              f"{'asyncTP':>7} {'T':>7} {'T_ideal':>7} {'speedup':>7} {'E':>6} {'host us seq/ours':>16} "
              f"{'auto: T':>7} {'E':>6} {'path':>5} {'host us':>7}")
        for r in (r for r in rows if (r["op"], r["path"]) == (op, path)):
            base = r["baselines"]
            host = "{seq:.0f}/{ours:.0f}".format(**r["host_us"]) if r.get("host_us") else "-"
            print(f"{r['M']:>6}x{r['N']:>6}x{r['K']:>6} {ms(r['t_gemm_ms'])} {ms(r['t_our_gemm_ms'])} "
                  f"{ms(r['t_comm_ms'])} {ms(r['t_seq_ms'])} {ms(base['decomposition_ms'])} {ms(base['async_tp_ms'])} "
                  f"{ms(r['t_ms'])} {ms(r['t_ideal_ms'])} {r['speedup']:7.2f} {r['E']:+6.2f} {host:>16}"
                  + (_auto_columns(r["auto"]) if "auto" in r else ""))


def _auto_columns(auto: dict) -> str:
    host = f"{auto['host_us']:.0f}" if auto.get("host_us") is not None else "-"
    return f" {auto['t_ms']:7.3f} {auto['E']:+6.2f} {auto['path']:>5} {host:>7}"


if __name__ == "__main__":
    sys.exit(main())
