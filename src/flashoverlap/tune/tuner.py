"""The tuner's measuring side (issue 5; needs GPUs, run under torchrun): bandwidth curves, the machine figures the
model needs, and the search that ranks candidates with the model, confirms the top few by timing them (or all,
exhaustively) and caches the winner. Every rank measures; timings are the maximum over ranks, so all ranks pick
the same plan. Written before any GPU run: ``python -m flashoverlap tune ...`` is its command line."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from flashoverlap.bench.op_rows import inputs
from flashoverlap.bench.timing import time_ms
from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from flashoverlap.kernels.gemm import gemm
from flashoverlap.plan import Plan, TileConfig, default_plan
from flashoverlap.tune import cache
from flashoverlap.tune.model import Curve, Machine
from flashoverlap.tune.search import candidates, cublas_band_plans, rank, tile_choices

# Mutual slowdowns (GEMM, collective) when both run at once, measured on 2x H200 (docs/why-overlap-is-hard.md;
# DESIGN.md's steady-state facts): NCCL over NVLink, NCCL through host memory, copy engines.
SLOWDOWNS = {"nvlink": (1.09, 1.8), "pcie-like": (1.13, 1.06), "p2p": (1.03, 1.0)}
MIN_CURVE_BYTES = 64 << 10


def setting(path: str) -> str:
    if path == "p2p":
        return "p2p"
    return "pcie-like" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


def curve_file(key: dict):
    path = cache.cache_file(key)
    return None if path is None else path.with_name("curve-" + path.name)


def measure_curve(op: str, path: str, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                  max_bytes: int, progress: Callable[[str], None] = print) -> Curve:
    """The time of one group's communication against the group's bytes (``Plan.group_bytes``), at log-spaced
    sizes from 64 KiB to ``max_bytes`` (a factor 2 apart): the NCCL collective, or on the P2P path what the copy
    stream does for a band (``p2p_band_work``), with every rank doing it at once as in a call."""
    world = dist.get_world_size(group)
    element = torch.empty((), dtype=dtype).element_size()
    band = _p2p_band_runner(op, group, device, dtype, max_bytes) if path == "p2p" else None
    sizes, times, size = [], [], MIN_CURVE_BYTES
    while True:
        count = max(world, size // element // world * world)
        if band is not None:
            call = functools.partial(band, count * element)
        else:
            buf = torch.randn(count, dtype=dtype, device=device)
            part = torch.empty(count // world, dtype=dtype, device=device)
            call = {"all_reduce": lambda buf=buf: dist.all_reduce(buf, group=group),
                    "reduce_scatter": lambda buf=buf, part=part: reduce_scatter_tensor(part, buf, group),
                    "all_gather": lambda buf=buf, part=part: all_gather_into_tensor(buf, part, group)}[op]
        sizes.append(count * element)
        times.append(time_ms(call, warmup=3, iters=10, group=group))
        progress(f"  {op} {path} {sizes[-1] / 2**20:10.3f} MiB: {times[-1]:.4f} ms")
        if size >= max_bytes:
            return Curve(tuple(sizes), tuple(times))
        size *= 2


def p2p_band_work(op: str, nbytes: int, world: int) -> tuple[int, int, bool]:
    """What the P2P copy stream does for a group of ``nbytes`` (``comm/p2p_schedule.py``): ``(rounds, bytes
    pulled from each peer per round, whether W pulled pieces are summed)``. Every op pulls ``nbytes / W`` from each
    peer: all-gather the peer's rows of the band; reduce-scatter the peer's partial of this rank's rows;
    all-reduce the peer's partial of this rank's share, then (second round) the peer's reduced share."""
    return (2 if op == "all_reduce" else 1), nbytes // world, op != "all_gather"


def _p2p_band_runner(op: str, group, device, dtype, max_bytes: int) -> Callable[[int], None]:
    """A function doing one band's P2P work of ``nbytes`` on the current stream: copy-engine pulls from each peer's
    symmetric memory in rotated order, and the fp32-accumulated sum of the pulled partials."""
    from flashoverlap.comm import stream_ops
    from flashoverlap.comm.symmetric import SymmetricWorkspace

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    workspace = SymmetricWorkspace(group, device)
    workspace.ensure(max_bytes, "tune bandwidth")
    workspace.local((max_bytes,), torch.uint8).random_()
    scratch = torch.empty(world * max_bytes, dtype=torch.uint8, device=device)
    out = torch.empty(max_bytes, dtype=torch.uint8, device=device)
    element = torch.empty((), dtype=dtype).element_size()

    def run(nbytes: int) -> None:
        rounds, share, summed = p2p_band_work(op, nbytes, world)
        stream = torch.cuda.current_stream(device)
        for _ in range(rounds):
            for step in range(1, world):
                peer = (rank + step) % world
                stream_ops.copy(stream, scratch.data_ptr() + step * share, workspace.peer_ptr(peer), share)
            if summed:
                parts = scratch[: world * share].view(dtype).view(world, share // element)
                torch.sum(parts, dim=0, out=out[:share].view(dtype))
                summed = False  # the second round pulls reduced shares: nothing to sum

    return run


def load_curve(key: dict) -> Curve | None:
    path = curve_file(key)
    if path is None or not path.exists():
        return None
    try:
        return Curve.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_curve(key: dict, curve: Curve) -> None:
    path = curve_file(key)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**curve.to_dict(), "key": key}))


def _operands(op: str, m: int, n: int, k: int, world: int, dtype, device, rank: int):
    """Fresh random operands of one call of ``op`` (for all-gather, this rank's shard of A)."""
    with torch.cuda.device(device):
        return inputs(m // world if op == "all_gather" else m, n, k, dtype, rank)


def op_call(op: str, a, b, group):
    import flashoverlap as fo

    fn = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter,
          "all_gather": fo.all_gather_gemm}[op]
    return lambda plan: fn(a, b, group, plan=plan)


def measure_machine(op: str, m: int, n: int, k: int, group, device, dtype, path: str) -> dict[TileConfig, Machine]:
    """Per tile configuration the search tries (``tile_choices``): our GEMM's time per wave (one program per tile,
    signalling on); with cuBLAS's time and its time per band height, which every configuration shares."""
    world = dist.get_world_size(group)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    a, b = _operands("all_reduce", m, n, k, world, dtype, device, dist.get_rank(group))
    cublas = time_ms(lambda: torch.matmul(a, b), iters=10, group=group)
    band_ms = tuple((rows, time_ms(lambda rows=rows: torch.matmul(a[:rows], b), iters=10, group=group))
                    for rows in band_heights(op, m, n, k, world, sms, path))
    f_g, f_c = SLOWDOWNS[setting(path)]
    machines = {}
    for tile in tile_choices(m, n, k):
        plan = default_plan(op, m, n, k, world, num_sms=sms, tile=tile, allow_sequential=False, path=path,
                            num_programs=None if op != "all_gather" else sms)
        counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
        flags = torch.ones(plan.num_groups, dtype=torch.int32, device=device)
        signal = {"flags": flags} if op == "all_gather" else {"counters": counters}
        ours = time_ms(lambda plan=plan, signal=signal: gemm(a, b, plan, **signal), iters=10, group=group,
                       before=counters.zero_)
        waves = -(-plan.num_tiles // min(plan.grid_size, sms))
        machines[tile] = Machine(sms, ours / waves, cublas, 0, f_g, f_c, 0.01, band_ms)
    return machines


def band_heights(op: str, m: int, n: int, k: int, world: int, sms: int, path: str) -> list[int]:
    """The row counts of the matmuls the cuBLAS-band candidates issue (one per group and row block)."""
    return sorted({grp.rows for plan in cublas_band_plans(op, m, n, k, world, sms, path) for grp in plan.groups})


# A candidate replaces running sequentially only if it was measured faster by more than this: the timings of one
# tuning run (10 calls per candidate) move by about as much between runs, and a plan cached on a 1% lead measured
# slower than sequential in the benchmark (reduce-scatter 2048x8192x14336, NVLink, b004104).
SEQUENTIAL_MARGIN = 0.02


def choose(records: list[dict]) -> dict:
    """The record to cache among timed candidates ``{"plan": Plan.to_dict(), "measured_ms": ...}``: the fastest,
    unless a sequential candidate was timed and is within ``SEQUENTIAL_MARGIN`` of it."""
    best = min(records, key=lambda r: r["measured_ms"])
    sequential = [r for r in records if r["plan"]["sequential"]]
    if sequential and sequential[0]["measured_ms"] <= best["measured_ms"] * (1 + SEQUENTIAL_MARGIN):
        return sequential[0]
    return best


def tune_plan(op: str, m: int, n: int, k: int, group, device, dtype, path: str = "nccl", top: int = 3,
              exhaustive: bool = False, progress: Callable[[str], None] = print) -> tuple[Plan, list[dict]]:
    """Rank the candidates with the model, time the top ``top`` and the sequential plan (every candidate if
    ``exhaustive``) and cache the one ``choose`` picks. Returns the winner and one record per candidate timed, the
    model's ranking order."""
    world = dist.get_world_size(group)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    dname = str(dtype).replace("torch.", "")
    key = cache.cache_key(torch.cuda.get_device_name(device), world, op, path, dname)
    curve = load_curve(key)
    if curve is None:
        raise RuntimeError(f"no bandwidth curve for {key}: run `python -m flashoverlap tune bandwidth` first")
    machine = measure_machine(op, m, n, k, group, device, dtype, path)
    ranked = rank(candidates(op, m, n, k, world, sms, path), machine, curve)
    chosen = ranked if exhaustive else ranked[:top]
    if not any(plan.sequential for _, plan in chosen):  # the reference every overlapped plan must beat
        chosen = chosen + [entry for entry in ranked if entry[1].sequential][:1]
    a, b = _operands(op, m, n, k, world, dtype, device, dist.get_rank(group))
    call = op_call(op, a, b, group)
    records = []
    for i, (predicted, plan) in enumerate(chosen):
        measured = time_ms(lambda plan=plan: call(plan), warmup=2, iters=10, group=group)
        records.append({"plan": plan.to_dict(), "predicted_ms": predicted, "measured_ms": measured})
        progress(f"  [{i + 1}/{len(chosen)}] {plan.gemm} {plan.tile.block_m}x{plan.tile.block_n} groups "
                 f"{plan.num_groups:2d} programs {plan.grid_size:5d} ctas "
                 f"{plan.comm_ctas:2d}{' sequential' if plan.sequential else ''}: predicted {predicted:.3f} ms, "
                 f"measured {measured:.3f} ms")
    best = choose(records)
    winner = Plan.from_dict(best["plan"])
    if dist.get_rank(group) == 0:
        cache.store(key, winner, best["measured_ms"], "exhaustive" if exhaustive else f"model top {len(chosen)}")
    dist.barrier(group=group)
    cache.forget_agreed()
    return winner, records




# -- the command line: python -m flashoverlap tune ... (under torchrun) -----------------------------------------------
def _progress_bar(total: int, rank: int):
    """A tqdm bar on rank 0 where tqdm is installed (and a plain line printer elsewhere): ``(update, write)``."""
    if rank != 0:
        return (lambda: None), (lambda line: None)
    try:
        from tqdm import tqdm
    except ImportError:
        return (lambda: None), print
    bar = tqdm(total=total, unit="candidate", leave=False)
    return (lambda: bar.update(1)), bar.write


def main(args) -> int:
    """``tune bandwidth``: measure and store each op's curve. ``tune plan``: tune one shape and cache the winner.
    ``tune validate``: over BENCHMARK.md's grid, the model's predicted T against the measured T of its pick, and
    the pick against the exhaustive best; writes ``benchmarks/results/<gpus>-<setting>-model.json``."""
    if "RANK" not in os.environ:
        raise SystemExit("run it under torchrun, e.g. torchrun --nproc-per-node 2 -m flashoverlap tune ...")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    group, rank = dist.group.WORLD, dist.get_rank()
    dtype = getattr(torch, args.dtype)
    world = dist.get_world_size()
    say = print if rank == 0 else (lambda line: None)
    try:
        if args.tune_command == "bandwidth":
            for op in args.ops.split(","):
                key = cache.cache_key(torch.cuda.get_device_name(device), world, op, args.path, args.dtype)
                curve = measure_curve(op, args.path, group, device, dtype, args.max_mib << 20, say)
                if rank == 0:
                    store_curve(key, curve)
                say(f"{op}: {len(curve.sizes)} sizes stored in {curve_file(key)}")
        elif args.tune_command == "plan":
            winner, records = _tune_with_bar(args.op, *args.shape, group, device, dtype, args.path,
                                             args.top, args.exhaustive, rank)
            say(winner.describe())
        else:
            _validate(args, group, device, dtype, rank, world)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _tune_with_bar(op, m, n, k, group, device, dtype, path, top, exhaustive, rank):
    total = top + 1 if not exhaustive else len(candidates(op, m, n, k, dist.get_world_size(group),
                                                      torch.cuda.get_device_properties(device).multi_processor_count,
                                                      path))
    update, write = _progress_bar(total, rank)

    def progress(line: str) -> None:
        write(line)
        update()

    return tune_plan(op, m, n, k, group, device, dtype, path, top, exhaustive, progress)


def _summary(plan_dict: dict) -> str:
    """One line naming what the search varies in a plan."""
    plan = Plan.from_dict(plan_dict)
    if plan.sequential:
        return "sequential"
    sizes = "/".join(str(g.rows) for g in plan.groups)
    tiles = f"{plan.tile.block_m}x{plan.tile.block_n} tiles, " if plan.gemm == "triton" else ""
    return (f"{plan.gemm} {plan.num_groups} groups ({sizes} rows), {tiles}{plan.grid_size} programs, "
            f"{plan.comm_ctas} NCCL CTAs")


def _validate(args, group, device, dtype, rank, world) -> None:
    """Per grid shape: the model's pick (timed) against every candidate (timed); rewrites the results file after
    each shape, so that a run stopped part-way keeps its finished rows. The exhaustive run goes last, so the
    cache ends up holding each shape's best measured plan."""
    from flashoverlap.bench import op_rows

    grids = {"all_reduce": op_rows.GRID_ALL_REDUCE, "reduce_scatter": op_rows.GRID_REDUCE_SCATTER,
             "all_gather": op_rows.GRID_ALL_GATHER}
    gpu = torch.cuda.get_device_name(device).split()[-1].lower()
    out = args.out or os.path.join("benchmarks", "results", f"{gpu}x{world}-{setting(args.path)}-model.json")
    command = os.environ.get("FLASHOVERLAP_COMMAND", " ".join(sys.argv))
    rows = []
    for op in args.ops.split(","):
        for m, n, k in grids[op]:
            _, model_top = _tune_with_bar(op, m, n, k, group, device, dtype, args.path, 1, False, rank)
            _, every = _tune_with_bar(op, m, n, k, group, device, dtype, args.path, 0, True, rank)
            pick, best = model_top[0], min(every, key=lambda r: r["measured_ms"])
            row = {"op": op, "path": args.path, "M": m, "N": n, "K": k, "predicted_ms": pick["predicted_ms"],
                   "measured_ms": pick["measured_ms"], "model_pick_ms": pick["measured_ms"],
                   "exhaustive_best_ms": best["measured_ms"],
                   "model_pick_plan": _summary(pick["plan"]), "exhaustive_best_plan": _summary(best["plan"]),
                   "all": [{"plan": _summary(r["plan"]), "predicted_ms": r["predicted_ms"],
                            "measured_ms": r["measured_ms"]} for r in every]}
            rows.append(row)
            if rank != 0:
                continue
            error = abs(row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
            print(f"{op:>15} {m:6d}x{n:6d}x{k:6d}: predicted {row['predicted_ms']:.3f} measured "
                  f"{row['measured_ms']:.3f} ({100 * error:.1f}%), pick {row['model_pick_ms']:.3f} "
                  f"({row['model_pick_plan']}) vs best {row['exhaustive_best_ms']:.3f} "
                  f"({row['exhaustive_best_plan']})", flush=True)
            errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rows]
            meta = {"gpus": f"{world}x {torch.cuda.get_device_name(device)}", "setting": setting(args.path),
                    "commit": os.environ.get("FLASHOVERLAP_COMMIT", "unknown"), "command": command,
                    "mean_error": sum(errors) / len(errors), "max_error": max(errors)}
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if rank == 0 and rows:
        print(f"model error: mean {100 * meta['mean_error']:.1f}%, max {100 * meta['max_error']:.1f}%; wrote {out}")
