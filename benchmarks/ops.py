"""``torchrun --nproc-per-node W -m benchmarks.ops`` (from the root of a source checkout): docs/benchmarks.md's grid
for the ops named by ``--ops`` (default all-reduce), every baseline side by side.

Prints, per op and shape: T_gemm (cuBLAS), our GEMM alone (signalling on, the overlapped op's configuration),
T_comm, T_seq, the best decomposition, torch async TP, flashoverlap's T (and, for all-gather on NVLink, the P2P
path's), T_ideal, speedup and E, and what a plain call (``path="auto"``) gets; writes
``benchmarks/results/<gpus>-<setting>.json``. ``--sweep`` also times a family of plans per shape (groups, programs,
NCCL CTAs). ``--interference`` measures how a GEMM and NCCL slow each other down when they share the GPU,
``--movers`` the same for copy engines and SM copies over NVLink. The installed ``flashoverlap bench ops`` times
the plain columns alone (``flashoverlap.bench``); the options here are its options and more.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.harness import op_rows
from benchmarks.harness.gemm_forms import gemm_form
from benchmarks.harness.run import start_run
from flashoverlap.bench import COLUMNS, OP_NAMES, efficiency, ms, write_results
from flashoverlap.bench import print_table as print_columns
from flashoverlap.cli import add_bench_ops_arguments, non_negative_ints, positive, positive_ints
from flashoverlap.plan import nccl_free_sms
from flashoverlap.runtime import plan_for
from flashoverlap.runtime.context import context_of
from flashoverlap.tune.defaults import default_plan
from flashoverlap.tune.timing import inputs as _inputs
from flashoverlap.tune.timing import time_ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``flashoverlap bench ops``'s options and the harness's."""
    add_bench_ops_arguments(parser)
    parser.add_argument("--sweep", action="store_true", help="also time a family of plans per shape")
    parser.add_argument("--sweep-groups", type=positive_ints, default=[4, 8], metavar="G,G",
                        help="--sweep: group counts (default 4,8)")
    parser.add_argument("--sweep-profiles", type=lambda s: s.split(","), metavar="P,P",
                        default=["even", "small-first", "small-last"],
                        help="--sweep: group-size profiles (default even,small-first,small-last)")
    parser.add_argument("--sweep-programs", type=lambda s: s.split(","), default=["tiles", "16"], metavar="P,P",
                        help="--sweep: 'tiles' (one tile per program) and/or SMs left free (0 = persistent on every "
                             "SM) (default tiles,16)")
    parser.add_argument("--sweep-ctas", type=non_negative_ints, default=[0, 4, 8, 32], metavar="C,C",
                        help="--sweep: NCCL CTA counts, 0 = NCCL's default (default 0,4,8,32)")
    parser.add_argument("--sweep-iters", type=positive, default=10, help="--sweep: timed calls per plan (default 10)")
    parser.add_argument("--gemm-sweep", action="store_true", help="time our GEMM alone over tile configurations")
    parser.add_argument("--interference", action="store_true", help="measure GEMM/NCCL mutual slowdown")
    parser.add_argument("--movers", action="store_true",
                        help="measure how copy engines and SM copies over NVLink and a GEMM slow each other")
    parser.add_argument("--timeline", default=None, metavar="PNG",
                        help="also draw one gemm_all_reduce call of the first all-reduce shape on two lanes")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<gpus>-<setting>.json)")


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
    if not out and dist.get_rank() == 0:
        print(f"    sweep {op} {m}x{n}x{k}: no plan of the sweep's values applies (all-gather takes comm_ctas >= 1 "
              f"and leaves NCCL its SMs: --sweep-ctas {args.sweep_ctas}, --sweep-programs {args.sweep_programs})",
              flush=True)
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


def main(argv: list[str] | None = None) -> int:
    # `flashoverlap bench ops`'s options and the harness's (add_arguments)
    args, argv, meta, out, device = start_run("python -m benchmarks.ops", __doc__.split("\n\n")[0],
                                              add_arguments, argv, "")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    shapes = op_rows.GRID_ALL_REDUCE if args.shapes is None else args.shapes
    rows = []
    if rank == 0:
        print(f"# {meta['gpus']}, {meta['setting']}, torch {meta['torch']}, triton {meta['triton']}, "
              f"NCCL {meta['nccl']}, commit {meta['commit']}", flush=True)
    sweep = None
    if args.sweep:
        def sweep(op, call, shape, row):
            return sweep_plans(op, call, shape, args, world_size, device, row["t_seq_ms"], row["t_ideal_ms"])
    for op in args.ops:
        for m, n, k in args.shapes or op_rows.GRIDS[op]:
            for row in op_rows.bench_op(op, (m, n, k), dtype, args.iters, meta["setting"], sweep):
                rows.append(row)
                if rank == 0:
                    auto = f", auto ({row['auto']['path']}) E={row['auto']['E']:+.2f}" if "auto" in row else ""
                    print(f"  {op} {row['path']} {m}x{n}x{k}: done, E={row['E']:+.2f}{auto}", flush=True)
                    write_results(out, meta, rows)  # so far, in case a later row fails
    extra = {}
    if args.timeline:
        extra["timeline"] = draw_timeline(args.timeline, rows, meta, dtype, world_size, device)
    if args.gemm_sweep:
        extra["gemm_sweep"] = {f"{m}x{n}x{k}": sweep_gemm(m, n, k, dtype, rank, world_size, device)
                               for m, n, k in shapes}
    if args.interference:
        extra["interference"] = interference(args, rank, world_size, device, dtype)
    if args.movers:
        from benchmarks.harness.movers import movers

        extra["movers"] = movers(device, dtype)
    if rank == 0:
        print_table(rows, meta)
        write_results(out, meta, rows, extra)
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def draw_timeline(path: str, rows: list[dict], meta: dict, dtype, world_size: int, device) -> dict:
    """One call of an all-reduce row's shape with its plan, recorded and (on rank 0) drawn: the first row the op
    overlaps (NCCL path), else the first row."""
    from benchmarks.harness import timeline

    candidates = [r for r in rows if r["op"] == "all_reduce" and r["path"] == "nccl"]
    row = next((r for r in candidates if not r["plan"]["sequential"]), candidates[0] if candidates else None)
    if row is None:
        raise SystemExit("--timeline needs an all_reduce row (--ops all_reduce)")
    m, n, k = row["M"], row["N"], row["K"]
    a, b = _inputs(m, n, k, dtype, dist.get_rank())
    plan = plan_for("all_reduce", (m, n, k), dist.group.WORLD, device, dtype)
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
    from flashoverlap.cli import tune_target
    from flashoverlap.tune import tuner
    from flashoverlap.tune.model import predict
    from flashoverlap.tune.search import machine_of

    target = tune_target(str(dtype).replace("torch.", ""), device)
    key = target.key(plan.op, plan.path)
    curve = tuner.load_curve(key)
    everyone = torch.tensor([curve is not None], dtype=torch.int32, device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if not int(everyone):
        return None
    machines = tuner.measure_machine(plan.op, (plan.m, plan.n, plan.k), target, plan.path, tuner.load_slowdowns(key))
    return list(predict(plan, machine_of(plan, machines), curve).group_done_ms)


def _auto_cell(row: dict, name: str) -> str:
    auto = row.get("auto")
    if auto is None:
        return "-"
    if name == "host_us":
        return f"{auto['host_us']:.0f}" if auto.get("host_us") is not None else "-"
    return {"t_ms": f"{auto['t_ms']:7.3f}", "E": f"{auto['E']:+6.2f}", "path": auto["path"]}[name]


# The installed table's columns with our GEMM alone, the baselines and what a plain call gets.
HARNESS_COLUMNS = [*COLUMNS[:1], ("ourGEMM", 7, lambda r: ms(r["t_our_gemm_ms"])), *COLUMNS[1:3],
                   ("decomp", 7, lambda r: ms(r["baselines"]["decomposition_ms"])),
                   ("asyncTP", 7, lambda r: ms(r["baselines"]["async_tp_ms"])), *COLUMNS[3:],
                   ("auto: T", 7, lambda r: _auto_cell(r, "t_ms")), ("E", 6, lambda r: _auto_cell(r, "E")),
                   ("path", 5, lambda r: _auto_cell(r, "path")), ("host us", 7, lambda r: _auto_cell(r, "host_us"))]


def print_table(rows: list[dict], meta: dict) -> None:
    """One table per op and path."""
    for op, path in dict.fromkeys((r["op"], r["path"]) for r in rows):
        print_columns(f"{OP_NAMES[op]}, path {path}, {meta['gpus']}, {meta['setting']}, {rows[0]['dtype']} (ms)",
                      [r for r in rows if (r["op"], r["path"]) == (op, path)], HARNESS_COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
