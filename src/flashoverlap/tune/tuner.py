"""``flashoverlap tune bandwidth|plan``'s measuring side (needs GPUs; the command line starts it under torchrun):
bandwidth curves and the mutual slowdowns of GEMM and communication, the machine figures the model needs per shape,
and the search that ranks candidates (of the paths it is given) with the model, confirms the top few by timing them
(or all, exhaustively) and caches the winner. Every rank measures; timings are the maximum over ranks, so all ranks
pick the same plan. It takes values (a ``Target``, the paths to search, the hand-set plan of each): which paths
apply and what an untuned call would run are the runtime's answers, which the command line passes in."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from flashoverlap.kernels.gemm import gemm
from flashoverlap.plan import Plan, TileConfig
from flashoverlap.tune import cache
from flashoverlap.tune.defaults import default_plan
from flashoverlap.tune.model import Curve, Machine
from flashoverlap.tune.search import FREE_SMS, candidates, cublas_band_plans, rank, ring_plans, tile_choices
from flashoverlap.tune.timing import inputs, time_ms

# Mutual slowdowns (GEMM, collective) when both run at once, for curve files written before ``tune bandwidth``
# measured them: the steady-state figures of 2x H200 (benchmarks/results/logs/why-overlap-is-hard.md): NCCL over
# NVLink, NCCL through host memory, copy engines.
SLOWDOWNS = {"nvlink": (1.09, 1.8), "pcie-like": (1.13, 1.06), "p2p": (1.03, 1.0)}
MIN_CURVE_BYTES = 64 << 10
SLOWDOWN_BYTES = 32 << 20  # the collective timed beside the GEMM: a typical group's message
SLOWDOWN_GEMMS = 20  # back-to-back GEMMs (4096x8192x8192) in the steady-state measurement
# A candidate replaces running sequentially only if it was measured faster by more than this: the timings of one
# tuning run (10 calls per candidate) move by about as much between runs, and a plan cached on a 1% lead measured
# slower than sequential in the benchmark (reduce-scatter 2048x8192x14336, NVLink, b004104).
SEQUENTIAL_MARGIN = 0.02


@dataclass(frozen=True)
class Target:
    """Where a tuning measures: the process group, this rank's GPU, the input dtype, and whether NCCL's peer-to-peer
    transport is disabled (part of the cache key: the runtime's ``Settings.nccl_p2p_disabled``)."""

    group: dist.ProcessGroup
    device: torch.device
    dtype: torch.dtype
    nccl_p2p_disabled: bool = False

    @property
    def dtype_name(self) -> str:
        """The dtype as the cache key and the command line spell it (``bfloat16``)."""
        return str(self.dtype).replace("torch.", "")

    def key(self, op: str, path: str) -> dict:
        """The cache key of ``op`` on ``path`` here (``tune.cache.cache_key``)."""
        return cache.cache_key(torch.cuda.get_device_name(self.device), dist.get_world_size(self.group), op, path,
                               self.dtype_name, self.nccl_p2p_disabled)


def curve_file(key: dict):
    path = cache.cache_file(key)
    return None if path is None else path.with_name("curve-" + path.name)


def bandwidth_command(op: str, path: str, target: Target) -> str:
    """The ``tune bandwidth`` command that stores ``op``'s curve on ``path`` under the key a search of ``target``
    reads: its dtype and NCCL transport setting (``NCCL_P2P_DISABLE=1``, or unset) are part of the key."""
    setting = "NCCL_P2P_DISABLE=1 " if target.nccl_p2p_disabled else ""
    return (f"{setting}torchrun --nproc-per-node {dist.get_world_size(target.group)} -m flashoverlap tune bandwidth "
            f"--path {path} --dtype {target.dtype_name} --ops {op}")


def missing_curves(op: str, paths: list[str], target: Target) -> str | None:
    """None where a search of ``op`` over ``paths`` finds every curve it reads (``load_curve``); else one line
    naming the commands that measure the missing ones (``tune plan`` checks before measuring anything)."""
    missing = [each for each in paths if load_curve(target.key(op, each)) is None]
    if not missing:
        return None
    transport = "NCCL_P2P_DISABLE=1" if target.nccl_p2p_disabled else "NCCL_P2P_DISABLE unset"
    where = curve_file(target.key(op, missing[0]))
    where = "the cache" if where is None else where.parent
    commands = " and ".join(f"`{bandwidth_command(op, each, target)}`" for each in missing)
    return (f"no bandwidth curve of {op} on path {', '.join(missing)} ({target.dtype_name}, {transport}) in "
            f"{where}: run {commands} first")


# -- bandwidth curves and slowdowns (tune bandwidth) ---------------------------------------------------------------
def tune_bandwidth(ops: list[str], path: str, target: Target, max_bytes: int,
                   progress: Callable[[str], None] = print) -> None:
    """Measure each op's curve and slowdowns on ``path`` and store them beside its plan cache (rank 0 writes);
    refused, before measuring, with the cache off (``FLASHOVERLAP_NO_CACHE=1``): nothing could be stored."""
    if cache.cache_dir() is None:
        raise RuntimeError(cache.NO_CACHE)
    for op in ops:
        key = target.key(op, path)
        band = band_runner(op, path, target, max_bytes)  # one P2P runner (and symmetric workspace) for both
        curve = measure_curve(op, path, target, max_bytes, progress, band)
        slowdowns = measure_slowdowns(op, path, target, max_bytes, band)
        if dist.get_rank(target.group) == 0:
            store_curve(key, curve, slowdowns)
        progress(f"{op}: {len(curve.sizes)} sizes, slowdowns GEMM x{slowdowns[0]:.3f}, communication "
                 f"x{slowdowns[1]:.3f}, stored in {curve_file(key)}")


def measure_curve(op: str, path: str, target: Target, max_bytes: int, progress: Callable[[str], None] = print,
                  band=None) -> Curve:
    """The time of one group's communication against the group's bytes (``Plan.group_bytes``), at log-spaced
    sizes from 64 KiB to ``max_bytes`` (a factor 2 apart; the last is ``max_bytes`` itself, never more: the P2P
    runner's buffers hold that much): the NCCL collective, or on the P2P path one copy-engine pull of that many
    bytes (``band``: a runner from ``band_runner`` to reuse), with every rank doing it at once as in a call."""
    band = band or band_runner(op, path, target, max_bytes)
    sizes, times, size = [], [], min(MIN_CURVE_BYTES, max_bytes)
    while True:
        nbytes, call = _communication(op, target, size, band)
        sizes.append(nbytes)
        times.append(time_ms(call, warmup=3, iters=10, group=target.group))
        progress(f"  {op} {path} {sizes[-1] / 2**20:10.3f} MiB: {times[-1]:.4f} ms")
        if size >= max_bytes:
            return Curve(tuple(sizes), tuple(times))
        size = min(2 * size, max_bytes)


def _communication(op: str, target: Target, size: int, band) -> tuple[int, Callable[[], None]]:
    """One group's communication of about ``size`` bytes on the current stream: ``(bytes, call)``."""
    group, dtype = target.group, target.dtype
    world = dist.get_world_size(group)
    element = torch.empty((), dtype=dtype).element_size()
    count = max(world, size // element // world * world)
    if band is not None:
        return count * element, functools.partial(band, count * element)
    buf = torch.randn(count, dtype=dtype, device=target.device)
    part = torch.empty(count // world, dtype=dtype, device=target.device)
    call = {"all_reduce": lambda: dist.all_reduce(buf, group=group),
            "reduce_scatter": lambda: reduce_scatter_tensor(part, buf, group),
            "all_gather": lambda: all_gather_into_tensor(buf, part, group)}[op]
    return count * element, call


def measure_slowdowns(op: str, path: str, target: Target, max_bytes: int, band=None) -> tuple[float, float]:
    """``(gemm_slowdown, comm_slowdown)`` for the model: steady state, ``SLOWDOWN_GEMMS`` back-to-back runs of our
    GEMM as the overlapped ops run it (4096x8192x8192, one program per tile, signalling) on one stream beside
    back-to-back communication of ``SLOWDOWN_BYTES`` (as ``measure_curve`` times it) on a high-priority stream,
    enough of it to outlast the GEMMs, all queued behind one GPU sleep so that both start together. The GEMM's
    factor: its span over its time alone; the communication's: the span of the calls that ended while the GEMMs
    ran, over their time alone. Maximum over ranks. (Beside cuBLAS, whose programs hold their SMs to the end of
    each GEMM, the communication's kernels wait for the GEMM's end: 4-7x slower on NVLink at 330bb22, a
    situation the ops' GEMM, whose programs retire tile by tile, does not create. The P2P path multiplies with
    cuBLAS, and its copy engines take no SM: there the GEMM is cuBLAS.)"""
    group, device = target.group, target.device
    band = band or band_runner(op, path, target, max_bytes)
    _, move = _communication(op, target, min(SLOWDOWN_BYTES, max_bytes), band)
    world = dist.get_world_size(group)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    a, b = _operands("all_reduce", (4096, 8192, 8192), target, 0)
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


def band_runner(op: str, path: str, target: Target, max_bytes: int) -> Callable[[int], None] | None:
    """On the P2P path, a function doing one sub-band's P2P transfer of ``nbytes`` on the current stream: one
    copy-engine pull from the next rank's symmetric memory (``comm/ring_schedule.py``: every transfer of the ring is
    one such pull); it allocates symmetric memory, collectively. None on NCCL."""
    if path != "p2p":
        return None
    from flashoverlap.comm import stream_ops
    from flashoverlap.comm.symmetric import SymmetricWorkspace

    group, device = target.group, target.device
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


# -- the machine figures of one shape, and the search (tune plan) ---------------------------------------------------
def _operands(op: str, shape: tuple[int, int, int], target: Target, rank: int):
    """Fresh random operands of one call of ``op`` (for all-gather, this rank's shard of A)."""
    m, n, k = shape
    with torch.cuda.device(target.device):
        return inputs(m // dist.get_world_size(target.group) if op == "all_gather" else m, n, k, target.dtype, rank)


def op_call(op: str, a, b, group):
    """``call(plan)``: the public op of ``op`` on these operands, with ``plan`` (what the search times)."""
    import flashoverlap as fo  # the ops sit above tune/: imported when a search times them

    fn = fo.ops.GEMM_OPS[op]
    return lambda plan: fn(a, b, group, plan=plan)


def measure_machine(op: str, shape: tuple[int, int, int], target: Target, path: str,
                    slowdowns: tuple[float, float]) -> dict[TileConfig, Machine]:
    """Per tile configuration the search tries (``tile_choices``): our GEMM's time per wave (one program per tile,
    signalling on; all-gather: a grid of every SM, its flags set) and its time with each persistent grid the
    search tries (``FREE_SMS``); with cuBLAS's time and its time per band height, which every configuration
    shares, and the path's ``(gemm, comm)`` slowdowns (``load_slowdowns``)."""
    m, n, k = shape
    group, device = target.group, target.device
    world = dist.get_world_size(group)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    a, b = _operands("all_reduce", shape, target, dist.get_rank(group))
    cublas = time_ms(lambda: torch.matmul(a, b), iters=10, group=group)
    band_ms = tuple((rows, time_ms(lambda rows=rows: torch.matmul(a[:rows], b), iters=10, group=group))
                    for rows in band_heights(op, shape, world, sms, path))
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


def band_heights(op: str, shape: tuple[int, int, int], world: int, sms: int, path: str) -> list[int]:
    """The row counts of the matmuls the cuBLAS-band candidates issue (one per group and row block; the P2P
    ring's sub-bands, and all-gather's own shard)."""
    m, n, k = shape
    if path == "p2p":
        plans = ring_plans(op, m, n, k, world, sms)
        own = {plans[0].block_rows} if plans and op == "all_gather" else set()
        return sorted(own | {grp.rows for plan in plans for grp in plan.groups})
    return sorted({grp.rows for plan in cublas_band_plans(op, m, n, k, world, sms, path) for grp in plan.groups})


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


def model_search(op: str, shape: tuple[int, int, int], target: Target, paths: dict[str, Plan],
                 key_path: str = "nccl") -> Search:
    """Measure the machine figures and rank every candidate plan of every path of ``paths`` (path -> the plan an
    untuned call takes there, the hand-set plan) with the model; the winner is cached under ``key_path``
    (``"auto"``: the winner's path is part of its plan)."""
    m, n, k = shape
    world = dist.get_world_size(target.group)
    sms = torch.cuda.get_device_properties(target.device).multi_processor_count
    search = Search(target.key(op, key_path), [], {}, {})
    for i, (each, hand) in enumerate(paths.items()):
        key = target.key(op, each)
        curve = load_curve(key)
        if curve is None:
            raise RuntimeError(missing_curves(op, [each], target))
        machines = measure_machine(op, shape, target, each, load_slowdowns(key))
        plans = [plan for plan in candidates(op, m, n, k, world, sms, each) if i == 0 or not plan.sequential]
        # The plan an untuned call takes (the ops' default from the machine's rates) is always a candidate, and
        # always timed: the tuned pick is then never slower than it as measured (the search's grid of plans
        # need not contain it: a persistent GEMM on every SM waiting for P2P bands, say).
        if hand not in plans and (i == 0 or not hand.sequential):
            plans.append(hand)
        search.hand_set.append(hand)
        search.ranked += rank(plans, machines, curve)  # one sequential candidate: the first path's
        search.machines[each], search.curves[each] = machines, curve
    search.ranked.sort(key=lambda entry: entry[0])  # stable: ties keep each path's order
    return search


def time_plans(op: str, shape: tuple[int, int, int], target: Target, chosen: list[tuple[float, Plan]],
               iters: int = 10, progress: Callable[[str], None] = print) -> list[dict]:
    """Time each ``(predicted, plan)`` of ``chosen`` on fresh random operands: one record each."""
    group = target.group
    a, b = _operands(op, shape, target, dist.get_rank(group))
    call = op_call(op, a, b, group)
    records = []
    for i, (predicted, plan) in enumerate(chosen):
        measured = time_ms(lambda plan=plan: call(plan), warmup=2, iters=iters, group=group)
        records.append({"plan": plan.to_dict(), "predicted_ms": predicted, "measured_ms": measured})
        progress(f"  [{i + 1}/{len(chosen)}] {summary(plan)}: predicted {predicted:.3f} ms, measured "
                 f"{measured:.3f} ms")
    return records


def tune_plan(op: str, shape: tuple[int, int, int], target: Target, search: Search, top: int = 3,
              exhaustive: bool = False, progress: Callable[[str], None] = print,
              iters: int = 10) -> tuple[Plan, list[dict]]:
    """Time the top ``top`` of the ``search``'s ranking (``model_search``), the sequential plan and the hand-set
    plans (every candidate if ``exhaustive``) and cache the one ``choose`` picks under the search's key. Returns the
    winner and one record per candidate timed, in the model's order."""
    chosen = search.ranked if exhaustive else search.ranked[:top]
    if not any(plan.sequential for _, plan in chosen):  # the reference every overlapped plan must beat
        chosen = chosen + [entry for entry in search.ranked if entry[1].sequential][:1]
    timed = {plan for _, plan in chosen}
    chosen = chosen + [entry for entry in search.ranked if entry[1] in search.hand_set and entry[1] not in timed]
    records = time_plans(op, shape, target, chosen, iters, progress)
    best = choose(records)
    winner = Plan.from_dict(best["plan"])
    if dist.get_rank(target.group) == 0:
        cache.store(search.key, winner, best["measured_ms"],
                    "exhaustive" if exhaustive else f"model top {len(chosen)}")
    dist.barrier(group=target.group)
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
