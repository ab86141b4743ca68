"""The tuner's measuring side (needs GPUs, run under torchrun): bandwidth curves and the mutual
slowdowns of GEMM and communication, the machine figures the model needs per shape, and the search that ranks
candidates (of one path, or of both for ``--path auto``) with the model, confirms the top few by timing them (or
all, exhaustively) and caches the winner. Every rank measures; timings are the maximum over ranks, so all ranks
pick the same plan. ``python -m flashoverlap tune ...`` is its command line."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashoverlap.bench.op_rows import inputs
from flashoverlap.bench.timing import time_ms
from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from flashoverlap.comm.symmetric import p2p_unavailable_reason
from flashoverlap.kernels.gemm import gemm
from flashoverlap.plan import Plan, TileConfig
from flashoverlap.runtime import settings
from flashoverlap.runtime.policy import p2p_excluded
from flashoverlap.tune import cache
from flashoverlap.tune.defaults import default_plan
from flashoverlap.tune.model import Curve, Machine
from flashoverlap.tune.search import FREE_SMS, candidates, cublas_band_plans, rank, ring_plans, tile_choices

# Mutual slowdowns (GEMM, collective) when both run at once, for curve files written before ``tune bandwidth``
# measured them: the steady-state figures of 2x H200 (benchmarks/results/logs/why-overlap-is-hard.md): NCCL over
# NVLink, NCCL through host memory, copy engines.
SLOWDOWNS = {"nvlink": (1.09, 1.8), "pcie-like": (1.13, 1.06), "p2p": (1.03, 1.0)}
MIN_CURVE_BYTES = 64 << 10
SLOWDOWN_BYTES = 32 << 20  # the collective timed beside the GEMM: a typical group's message
SLOWDOWN_GEMMS = 20  # back-to-back GEMMs (4096x8192x8192) in the steady-state measurement


def setting(path: str) -> str:
    if path == "p2p":
        return "p2p"
    return "pcie-like" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


def curve_file(key: dict):
    path = cache.cache_file(key)
    return None if path is None else path.with_name("curve-" + path.name)


def measure_curve(op: str, path: str, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                  max_bytes: int, progress: Callable[[str], None] = print, band=None) -> Curve:
    """The time of one group's communication against the group's bytes (``Plan.group_bytes``), at log-spaced
    sizes from 64 KiB to ``max_bytes`` (a factor 2 apart): the NCCL collective, or on the P2P path one copy-engine
    pull of that many bytes (``band``: a runner from ``band_runner`` to reuse), with every rank doing it at once as
    in a call."""
    band = band or band_runner(op, path, group, device, dtype, max_bytes)
    sizes, times, size = [], [], MIN_CURVE_BYTES
    while True:
        nbytes, call = _communication(op, group, device, dtype, size, band)
        sizes.append(nbytes)
        times.append(time_ms(call, warmup=3, iters=10, group=group))
        progress(f"  {op} {path} {sizes[-1] / 2**20:10.3f} MiB: {times[-1]:.4f} ms")
        if size >= max_bytes:
            return Curve(tuple(sizes), tuple(times))
        size *= 2


def _communication(op: str, group, device, dtype, size: int, band) -> tuple[int, Callable[[], None]]:
    """One group's communication of about ``size`` bytes on the current stream: ``(bytes, call)``."""
    world = dist.get_world_size(group)
    element = torch.empty((), dtype=dtype).element_size()
    count = max(world, size // element // world * world)
    if band is not None:
        return count * element, functools.partial(band, count * element)
    buf = torch.randn(count, dtype=dtype, device=device)
    part = torch.empty(count // world, dtype=dtype, device=device)
    call = {"all_reduce": lambda: dist.all_reduce(buf, group=group),
            "reduce_scatter": lambda: reduce_scatter_tensor(part, buf, group),
            "all_gather": lambda: all_gather_into_tensor(buf, part, group)}[op]
    return count * element, call


def measure_slowdowns(op: str, path: str, group, device, dtype, max_bytes: int,
                      band=None) -> tuple[float, float]:
    """``(gemm_slowdown, comm_slowdown)`` for the model: steady state, ``SLOWDOWN_GEMMS`` back-to-back runs of our
    GEMM as the overlapped ops run it (4096x8192x8192, one program per tile, signalling) on one stream beside
    back-to-back communication of ``SLOWDOWN_BYTES`` (as ``measure_curve`` times it) on a high-priority stream,
    enough of it to outlast the GEMMs, all queued behind one GPU sleep so that both start together. The GEMM's
    factor: its span over its time alone; the communication's: the span of the calls that ended while the GEMMs
    ran, over their time alone. Maximum over ranks. (Beside cuBLAS, whose programs hold their SMs to the end of
    each GEMM, the communication's kernels wait for the GEMM's end: 4-7x slower on NVLink at 330bb22, a
    situation the ops' GEMM, whose programs retire tile by tile, does not create. The P2P path multiplies with
    cuBLAS, and its copy engines take no SM: there the GEMM is cuBLAS.)"""
    band = band or band_runner(op, path, group, device, dtype, max_bytes)
    _, move = _communication(op, group, device, dtype, min(SLOWDOWN_BYTES, max_bytes), band)
    world = dist.get_world_size(group)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    a, b = _operands("all_reduce", 4096, 8192, 8192, world, dtype, device, 0)
    plan = default_plan("all_reduce", 4096, 8192, 8192, world, num_sms=sms, allow_sequential=False)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)

    def ours() -> None:
        if path == "p2p":  # the P2P path multiplies with cuBLAS
            torch.matmul(a, b)
        else:
            gemm(a, b, plan, counters=counters)  # the counters only count up here: nothing waits on them

    gemm_alone = time_ms(ours, warmup=3, iters=10, group=group)
    move_alone = time_ms(move, warmup=3, iters=10, group=group)
    moves = min(4000, 2 + int(1.5 * SLOWDOWN_GEMMS * gemm_alone / move_alone))
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device=device, priority=-(1 << 10))
    start, gemms_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    moved = [torch.cuda.Event(enable_timing=True) for _ in range(moves)]
    dist.barrier(group=group)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(SLOWDOWN_GEMMS * 1_000_000 + moves * 100_000)  # outlasts launching both sides
    start.record(main)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for event in moved:
            move()
            event.record(side)
    for _ in range(SLOWDOWN_GEMMS):
        ours()
    gemms_end.record(main)
    main.wait_stream(side)
    torch.cuda.synchronize(device)
    span = start.elapsed_time(gemms_end)
    inside = [start.elapsed_time(event) for event in moved if start.elapsed_time(event) <= span]
    gemm_factor = span / (SLOWDOWN_GEMMS * gemm_alone)
    comm_factor = inside[-1] / (len(inside) * move_alone) if inside else span / move_alone
    factors = torch.tensor([max(1.0, gemm_factor), max(1.0, comm_factor)], dtype=torch.float64, device=device)
    dist.all_reduce(factors, op=dist.ReduceOp.MAX, group=group)
    return float(factors[0]), float(factors[1])


def band_runner(op: str, path: str, group, device, dtype, max_bytes: int) -> Callable[[int], None] | None:
    """On the P2P path, a ``_p2p_band_runner`` (it allocates symmetric memory, collectively); None on NCCL."""
    return _p2p_band_runner(op, group, device, dtype, max_bytes) if path == "p2p" else None


def _p2p_band_runner(op: str, group, device, dtype, max_bytes: int) -> Callable[[int], None]:
    """A function doing one sub-band's P2P transfer of ``nbytes`` on the current stream: one copy-engine pull from
    the next rank's symmetric memory (``comm/ring_schedule.py``: every transfer of the ring is one such pull)."""
    from flashoverlap.comm import stream_ops
    from flashoverlap.comm.symmetric import SymmetricWorkspace

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    workspace = SymmetricWorkspace(group, device)
    workspace.ensure(max_bytes, "tune bandwidth")
    workspace.local((max_bytes,), torch.uint8).random_()
    landing = torch.empty(max_bytes, dtype=torch.uint8, device=device)

    def run(nbytes: int) -> None:
        stream = torch.cuda.current_stream(device)
        stream_ops.copy(stream, landing.data_ptr(), workspace.peer_ptr((rank + 1) % world), nbytes)

    return run


def load_curve(key: dict) -> Curve | None:
    data = _curve_data(key)
    try:
        return None if data is None else Curve.from_dict(data)
    except (ValueError, KeyError, TypeError):
        return None


def load_slowdowns(key: dict) -> tuple[float, float]:
    """The ``(gemm, comm)`` slowdowns ``tune bandwidth`` stored beside ``key``'s curve, else ``SLOWDOWNS``."""
    data = _curve_data(key) or {}
    try:
        gemm_factor, comm_factor = (float(x) for x in data["slowdowns"])
        if gemm_factor >= 1.0 and comm_factor >= 1.0:
            return gemm_factor, comm_factor
    except (KeyError, TypeError, ValueError):
        pass
    return SLOWDOWNS["p2p" if key["path"] == "p2p" else
                     "pcie-like" if key.get("nccl_p2p") == "disabled" else "nvlink"]


def _curve_data(key: dict) -> dict | None:
    path = curve_file(key)
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def store_curve(key: dict, curve: Curve, slowdowns: tuple[float, float] | None = None) -> None:
    path = curve_file(key)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {} if slowdowns is None else {"slowdowns": list(slowdowns)}
        path.write_text(json.dumps({**curve.to_dict(), **extra, "key": key}))


def _operands(op: str, m: int, n: int, k: int, world: int, dtype, device, rank: int):
    """Fresh random operands of one call of ``op`` (for all-gather, this rank's shard of A)."""
    with torch.cuda.device(device):
        return inputs(m // world if op == "all_gather" else m, n, k, dtype, rank)


def op_call(op: str, a, b, group):
    import flashoverlap as fo

    fn = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter,
          "all_gather": fo.all_gather_gemm}[op]
    return lambda plan: fn(a, b, group, plan=plan)


def measure_machine(op: str, m: int, n: int, k: int, group, device, dtype, path: str,
                    slowdowns: tuple[float, float]) -> dict[TileConfig, Machine]:
    """Per tile configuration the search tries (``tile_choices``): our GEMM's time per wave (one program per tile,
    signalling on; all-gather: a grid of every SM, its flags set) and its time with each persistent grid the
    search tries (``FREE_SMS``); with cuBLAS's time and its time per band height, which every configuration
    shares, and the path's ``(gemm, comm)`` slowdowns (``load_slowdowns``)."""
    world = dist.get_world_size(group)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    a, b = _operands("all_reduce", m, n, k, world, dtype, device, dist.get_rank(group))
    cublas = time_ms(lambda: torch.matmul(a, b), iters=10, group=group)
    band_ms = tuple((rows, time_ms(lambda rows=rows: torch.matmul(a[:rows], b), iters=10, group=group))
                    for rows in band_heights(op, m, n, k, world, sms, path))
    f_g, f_c = slowdowns
    machines = {}
    if path == "p2p":  # cuBLAS does every multiplication: no Triton GEMM to measure
        return {tile: Machine(sms, cublas, cublas, f_g, f_c, 0.0, band_ms) for tile in tile_choices(m, n, k)}
    for tile in tile_choices(m, n, k):
        def ours(programs: int | None, tile: TileConfig = tile) -> tuple[Plan, float]:
            plan = default_plan(op, m, n, k, world, num_sms=sms, tile=tile, allow_sequential=False, path=path,
                                num_programs=programs)
            counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
            flags = torch.ones(plan.num_groups, dtype=torch.int32, device=device)  # every band "arrived"
            signal = {"flags": flags} if op == "all_gather" else {"counters": counters}
            return plan, time_ms(lambda: gemm(a, b, plan, **signal), iters=10, group=group,
                                 before=lambda: (counters.zero_(), flags.fill_(1)))

        plan, wave_total = ours(None if op != "all_gather" else sms)
        waves = -(-plan.num_tiles // min(plan.grid_size, sms))
        grids = tuple((sms - free, ours(sms - free)[1]) for free in FREE_SMS if free > 0)
        machines[tile] = Machine(sms, wave_total / waves, cublas, f_g, f_c, 0.01, band_ms, grids)
    return machines


def band_heights(op: str, m: int, n: int, k: int, world: int, sms: int, path: str) -> list[int]:
    """The row counts of the matmuls the cuBLAS-band candidates issue (one per group and row block; the P2P
    ring's sub-bands, and all-gather's own shard)."""
    if path == "p2p":
        plans = ring_plans(op, m, n, k, world, sms)
        own = {plans[0].block_rows} if plans and op == "all_gather" else set()
        return sorted(own | {grp.rows for plan in plans for grp in plan.groups})
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


@dataclass
class Search:
    """The model's side of one tuning: every candidate of every searched path with its predicted time, fastest
    first, and what the predictions came from (per path: the machine figures per tile configuration, the
    curve)."""

    key: dict
    ranked: list[tuple[float, Plan]]
    machines: dict[str, dict[TileConfig, Machine]]
    curves: dict[str, Curve]
    hand_set: list[Plan] = dataclasses.field(default_factory=list)  # what an untuned call would use, per path


def search_paths(path: str, group, device) -> list[str]:
    """The paths a search covers: the one asked for, or for ``"auto"`` NCCL and, where it applies to this group,
    P2P (the same rule as the ops' ``path="auto"``: ``runtime.policy.p2p_excluded``)."""
    if path != "auto":
        return [path]
    disabled = settings.read().nccl_p2p_disabled
    reason = None if disabled else p2p_unavailable_reason(group, device)
    return ["nccl"] if p2p_excluded(reason, dist.get_world_size(group), disabled) else ["nccl", "p2p"]


def model_search(op: str, m: int, n: int, k: int, group, device, dtype, path: str = "nccl") -> Search:
    """Measure the machine figures and rank every candidate plan of every path searched with the model."""
    from flashoverlap.runtime import plan_for

    world = dist.get_world_size(group)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    dname = str(dtype).replace("torch.", "")
    gpu = torch.cuda.get_device_name(device)
    search = Search(cache.cache_key(gpu, world, op, path, dname), [], {}, {})
    for i, each in enumerate(search_paths(path, group, device)):
        key = cache.cache_key(gpu, world, op, each, dname)
        curve = load_curve(key)
        if curve is None:
            raise RuntimeError(f"no bandwidth curve for {key}: run `python -m flashoverlap tune bandwidth --path "
                               f"{each}` (under torchrun) first")
        machines = measure_machine(op, m, n, k, group, device, dtype, each, load_slowdowns(key))
        plans = [plan for plan in candidates(op, m, n, k, world, sms, each) if i == 0 or not plan.sequential]
        # The plan an untuned call takes (the ops' default from the machine's rates) is always a candidate, and
        # always timed: the tuned pick is then never slower than it as measured (the search's grid of plans
        # need not contain it: a persistent GEMM on every SM waiting for P2P bands, say).
        hand = plan_for(op, m, n, k, group, device, dtype, each, tuned=False)
        if hand not in plans and (i == 0 or not hand.sequential):
            plans.append(hand)
        search.hand_set.append(hand)
        search.ranked += rank(plans, machines, curve)  # one sequential candidate: the first path's
        search.machines[each], search.curves[each] = machines, curve
    search.ranked.sort(key=lambda entry: entry[0])  # stable: ties keep each path's order
    return search


def time_plans(op: str, m: int, n: int, k: int, group, device, dtype, chosen: list[tuple[float, Plan]],
               iters: int = 10, progress: Callable[[str], None] = print) -> list[dict]:
    """Time each ``(predicted, plan)`` of ``chosen`` on fresh random operands: one record each."""
    a, b = _operands(op, m, n, k, dist.get_world_size(group), dtype, device, dist.get_rank(group))
    call = op_call(op, a, b, group)
    records = []
    for i, (predicted, plan) in enumerate(chosen):
        measured = time_ms(lambda plan=plan: call(plan), warmup=2, iters=iters, group=group)
        records.append({"plan": plan.to_dict(), "predicted_ms": predicted, "measured_ms": measured})
        progress(f"  [{i + 1}/{len(chosen)}] {summary(plan)}: predicted {predicted:.3f} ms, measured "
                 f"{measured:.3f} ms")
    return records


def tune_plan(op: str, m: int, n: int, k: int, group, device, dtype, path: str = "nccl", top: int = 3,
              exhaustive: bool = False, progress: Callable[[str], None] = print,
              search: Search | None = None, iters: int = 10) -> tuple[Plan, list[dict]]:
    """Rank the candidates with the model (``model_search``, or the ``search`` given), time the top ``top``, the
    sequential plan and the hand-set plans (every candidate if ``exhaustive``) and cache the one ``choose``
    picks, under ``path`` (``"auto"``: the winner's path is part of its plan). Returns the winner and one record
    per candidate timed, in the model's order."""
    search = search or model_search(op, m, n, k, group, device, dtype, path)
    chosen = search.ranked if exhaustive else search.ranked[:top]
    if not any(plan.sequential for _, plan in chosen):  # the reference every overlapped plan must beat
        chosen = chosen + [entry for entry in search.ranked if entry[1].sequential][:1]
    timed = {plan for _, plan in chosen}
    chosen = chosen + [entry for entry in search.ranked if entry[1] in search.hand_set and entry[1] not in timed]
    records = time_plans(op, m, n, k, group, device, dtype, chosen, iters, progress)
    best = choose(records)
    winner = Plan.from_dict(best["plan"])
    if dist.get_rank(group) == 0:
        cache.store(search.key, winner, best["measured_ms"],
                    "exhaustive" if exhaustive else f"model top {len(chosen)}")
    dist.barrier(group=group)
    cache.forget_agreed()
    return winner, records


def summary(plan: Plan) -> str:
    """One line naming what the search varies in a plan."""
    if plan.sequential:
        return "sequential"
    sizes = "/".join(str(g.rows) for g in plan.groups)
    tiles = f"{plan.tile.block_m}x{plan.tile.block_n} tiles, " if plan.gemm == "triton" else ""
    ctas = f", {plan.comm_ctas} NCCL CTAs" if plan.path == "nccl" else ""
    return f"{plan.path} {plan.gemm} {plan.num_groups} groups ({sizes} rows), {tiles}{plan.grid_size} programs{ctas}"


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
    ``tune validate``: over docs/benchmarks.md's grid, the model's predicted T against the measured T of its pick, and
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
                # One P2P runner (and symmetric workspace) for both measurements of the op.
                band = band_runner(op, args.path, group, device, dtype, args.max_mib << 20)
                curve = measure_curve(op, args.path, group, device, dtype, args.max_mib << 20, say, band)
                slowdowns = measure_slowdowns(op, args.path, group, device, dtype, args.max_mib << 20, band)
                if rank == 0:
                    store_curve(key, curve, slowdowns)
                say(f"{op}: {len(curve.sizes)} sizes, slowdowns GEMM x{slowdowns[0]:.3f}, communication "
                    f"x{slowdowns[1]:.3f}, stored in {curve_file(key)}")
        elif args.tune_command == "plan":
            winner, _, _ = _tune_with_bar(args.op, *args.shape, group, device, dtype, args.path,
                                             args.top, args.exhaustive, rank)
            say(winner.describe())
        else:
            _validate(args, group, device, dtype, rank, world)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _tune_with_bar(op, m, n, k, group, device, dtype, path, top, exhaustive, rank, iters=10):
    search = model_search(op, m, n, k, group, device, dtype, path)
    update, write = _progress_bar(len(search.ranked) if exhaustive else top + 1, rank)

    def progress(line: str) -> None:
        write(line)
        update()

    winner, records = tune_plan(op, m, n, k, group, device, dtype, path, top, exhaustive, progress, search, iters)
    return winner, records, search


# `tune validate` times every candidate with fewer calls than `tune plan` (it times hundreds per shape).
VALIDATE_ITERS = 6


def model_check_row(op: str, path: str, m: int, n: int, k: int, records: list[dict], top: int = 3) -> dict:
    """docs/benchmarks.md's model-check row from every candidate's record, in the model's order: the model's pick is
    what ``tune plan`` caches (``choose`` among the model's ``top``, sequential and the records marked
    ``hand_set``, with their measured times), its predicted time against its measured one, and the exhaustive
    best."""
    confirmed = records[:top] + [r for r in records[top:] if r["plan"]["sequential"]][:1]
    confirmed += [r for r in records[top:] if r.get("hand_set") and r not in confirmed]
    pick, best = choose(confirmed), min(records, key=lambda r: r["measured_ms"])

    def name(record: dict) -> str:
        return summary(Plan.from_dict(record["plan"]))

    return {"op": op, "path": path, "M": m, "N": n, "K": k, "predicted_ms": pick["predicted_ms"],
            "measured_ms": pick["measured_ms"], "model_pick_ms": pick["measured_ms"],
            "exhaustive_best_ms": best["measured_ms"], "model_top1_ms": records[0]["measured_ms"],
            "model_pick_plan": name(pick), "exhaustive_best_plan": name(best)}


def _validate(args, group, device, dtype, rank, world) -> None:
    """Per grid shape: every candidate timed (``VALIDATE_ITERS`` calls each), in the model's order; the model's
    pick (``model_check_row``) against the exhaustive best. Rewrites the results file after each shape, so that a
    run stopped part-way keeps its finished rows; each row keeps the machine figures and every candidate's plan,
    prediction and measurement, so that a later model can be re-checked against the same measurements. Leaves each
    shape's best measured plan in the cache."""
    from flashoverlap.bench import op_rows

    grids = {"all_reduce": op_rows.GRID_ALL_REDUCE, "reduce_scatter": op_rows.GRID_REDUCE_SCATTER,
             "all_gather": op_rows.GRID_ALL_GATHER}
    gpu = torch.cuda.get_device_name(device).split()[-1].lower()
    name = setting(args.path) if args.path != "auto" else setting("nccl") + "-auto"
    out = args.out or os.path.join("benchmarks", "results", f"{gpu}x{world}-{name}-model.json")
    command = os.environ.get("FLASHOVERLAP_COMMAND", " ".join(sys.argv))
    rows, meta = [], {}
    for op in args.ops.split(","):
        for m, n, k in grids[op]:
            _, every, search = _tune_with_bar(op, m, n, k, group, device, dtype, args.path, 0, True, rank,
                                              VALIDATE_ITERS)
            for record in every:
                record["hand_set"] = Plan.from_dict(record["plan"]) in search.hand_set
            row = model_check_row(op, args.path, m, n, k, every)
            row["machines"] = {p: [{"tile": list(dataclasses.astuple(tile)), **machine.to_dict()}
                                   for tile, machine in machines.items()] for p, machines in search.machines.items()}
            row["curves"] = {p: curve.to_dict() for p, curve in search.curves.items()}
            row["all"] = [{"plan": _shapeless(r["plan"]), "predicted_ms": r["predicted_ms"],
                           "measured_ms": r["measured_ms"], "hand_set": r["hand_set"]} for r in every]
            rows.append(row)
            if rank != 0:
                continue
            error = abs(row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
            print(f"{op:>15} {m:6d}x{n:6d}x{k:6d}: predicted {row['predicted_ms']:.3f} measured "
                  f"{row['measured_ms']:.3f} ({100 * error:.1f}%), pick {row['model_pick_ms']:.3f} "
                  f"({row['model_pick_plan']}) vs best {row['exhaustive_best_ms']:.3f} "
                  f"({row['exhaustive_best_plan']}), {len(every)} candidates", flush=True)
            meta = {"gpus": f"{world}x {torch.cuda.get_device_name(device)}", "setting": setting(args.path),
                    "commit": os.environ.get("FLASHOVERLAP_COMMIT", "unknown"), "command": command,
                    **model_check_summary(rows)}
            write_rows(out, meta, rows)
    if rank == 0 and rows:
        print(f"model error: mean {100 * meta['mean_error']:.1f}%, max {100 * meta['max_error']:.1f}%; pick within "
              f"3% of the best at {meta['picks_within_3pct']} of {len(rows)} shapes; wrote {out}")


def model_check_summary(rows: list[dict]) -> dict:
    """The figures issue 5's targets name, over ``rows``."""
    errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rows]
    within = sum(r["model_pick_ms"] <= 1.03 * r["exhaustive_best_ms"] for r in rows)
    return {"mean_error": sum(errors) / len(errors), "max_error": max(errors), "picks_within_3pct": within}


def _shapeless(plan: dict) -> dict:
    return {name: value for name, value in plan.items() if name not in ("op", "m", "n", "k", "world_size")}


def write_rows(out: str, meta: dict, rows: list[dict]) -> None:
    """The results file, one row per line (each row carries hundreds of candidates)."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    lines = ",\n".join(json.dumps(row) for row in rows)
    with open(out, "w") as f:
        f.write(f'{{"meta": {json.dumps(meta, indent=1)},\n"rows": [\n{lines}\n]}}\n')
