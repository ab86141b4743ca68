"""The performance model (issue 5): a plan's end-to-end time predicted from the GEMM's time per wave of tiles,
the two sides' mutual slowdown while both run, and the collective's bandwidth curve.
``docs/model.md`` states the formulas; this module is their implementation. Pure Python: no GPU needed.

Reduction ops (all-reduce, reduce-scatter): the GEMM produces groups in order; each group's collective starts
when its tiles are done and the previous collective has finished. All-gather: the collectives run first, band
after band; the GEMM computes the rank's own shard, then each band's tiles once that band has arrived.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

from flashoverlap.plan import Plan


@dataclass(frozen=True)
class Curve:
    """A collective's time (ms) against its message size (bytes), measured at increasing sizes. Between points:
    log-log interpolation; below the first: the first time (latency-bound); above the last: the last segment's
    bandwidth."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or len(self.sizes) != len(self.ms):
            raise ValueError("a Curve needs at least two (size, ms) points, as many sizes as times")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])) or min(self.sizes) < 1 or min(self.ms) <= 0:
            raise ValueError("Curve sizes must increase from >= 1 byte and times must be > 0")

    def time_ms(self, nbytes: float) -> float:
        if nbytes <= self.sizes[0]:
            return self.ms[0]
        if nbytes >= self.sizes[-1]:
            slope = (self.ms[-1] - self.ms[-2]) / (self.sizes[-1] - self.sizes[-2])
            return self.ms[-1] + max(slope, 0.0) * (nbytes - self.sizes[-1])
        i = bisect.bisect_right(self.sizes, nbytes) - 1
        x0, x1 = math.log(self.sizes[i]), math.log(self.sizes[i + 1])
        y0, y1 = math.log(self.ms[i]), math.log(self.ms[i + 1])
        return math.exp(y0 + (y1 - y0) * (math.log(nbytes) - x0) / (x1 - x0))

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "ms": list(self.ms)}

    @classmethod
    def from_dict(cls, data: dict) -> Curve:
        return cls(tuple(int(s) for s in data["sizes"]), tuple(float(t) for t in data["ms"]))


@dataclass(frozen=True)
class Machine:
    """What the model knows of the GPU for one shape.

    ``wave_ms``: our GEMM's time for one wave (every program one tile) at this shape, alone. ``cublas_ms``: the
    cuBLAS GEMM alone (the sequential baseline). ``gemm_slowdown`` / ``comm_slowdown``: each side's time factor
    while the other runs, steady state (``tune bandwidth`` measures them per op and path; NCCL's CTAs taking SMs
    from the GEMM is part of ``gemm_slowdown``). ``launch_ms``: fixed cost per collective on top of the curve (the
    stream wait, the launch). ``band_ms``: ``(rows, ms)`` pairs, one cuBLAS matmul of ``rows`` rows of this shape
    timed alone, for the band heights of the cuBLAS-band candidates (a band of a few hundred rows fills a fraction
    of a wave: its time is not its share of ``cublas_ms``); heights not listed take their share. ``grid_ms``:
    ``(programs, ms)`` pairs, our GEMM alone with a persistent grid of that many programs (fewer programs each
    run faster than a wave's share: less contention for memory); grids not listed take whole waves of
    ``wave_ms``."""

    num_sms: int
    wave_ms: float
    cublas_ms: float
    gemm_slowdown: float = 1.0
    comm_slowdown: float = 1.0
    launch_ms: float = 0.0
    band_ms: tuple[tuple[int, float], ...] = ()
    grid_ms: tuple[tuple[int, float], ...] = ()

    def band_time(self, rows: int, total_rows: int) -> float:
        """One cuBLAS matmul of ``rows`` of the ``total_rows`` rows: measured if listed, else its share."""
        return dict(self.band_ms).get(rows, self.cublas_ms * rows / total_rows)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # JSON writes the pairs' tuples as lists; from_dict reads either

    @classmethod
    def from_dict(cls, data: dict) -> Machine:
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {name: value for name, value in data.items() if name in fields}
        for name in ("band_ms", "grid_ms"):
            given[name] = tuple((int(count), float(ms)) for count, ms in given.get(name, ()))
        return cls(**given)


@dataclass(frozen=True)
class Prediction:
    total_ms: float
    group_done_ms: tuple[float, ...]  # when each group's tiles are done (reductions) or begin (all-gather)
    comm_done_ms: tuple[float, ...]  # when each group's collective ends


def gemm_slots(plan: Plan, machine: Machine) -> int:
    """Tiles in flight at once: the persistent grid's programs, or every SM with one program per tile."""
    return max(1, min(plan.grid_size, machine.num_sms))


def predict(plan: Plan, machine: Machine, curve: Curve, element_size: int = 2) -> Prediction:
    """Predicted end-to-end time of one call of ``plan`` (see ``docs/model.md``)."""
    comm = [machine.launch_ms + curve.time_ms(b) for b in plan.group_bytes(element_size)]
    if plan.sequential:
        total = sequential_ms(plan, machine, curve, element_size)
        return Prediction(total, (machine.cublas_ms,), (total,))
    if plan.path == "p2p":
        return _ring(plan, machine, curve, element_size)
    local_ms, work_ms = _compute(plan, machine)
    consumer = plan.op == "all_gather"
    return _simulate(local_ms, work_ms, comm, consumer, machine.gemm_slowdown, machine.comm_slowdown)


def _compute(plan: Plan, machine: Machine) -> tuple[float, list[float]]:
    """The GEMM side alone: the time of the tiles needing no communication (all-gather's own shard) and of each
    group's tiles. Triton plans: tiles are fluid (``wave_ms / slots`` each, or a persistent grid's measured time
    over its tiles), and the last group takes the rest of the GEMM's whole waves. cuBLAS-band plans: one matmul
    per group and row block (``comm/tp/nccl.py``'s ``compute_bands``)."""
    if plan.gemm == "cublas":
        calls = plan.blocks - 1 if plan.op == "all_gather" else plan.blocks
        bands = [machine.band_time(grp.rows, plan.m) for grp in plan.groups]
        local = sum(bands) if plan.op == "all_gather" else 0.0
        return local, [calls * band for band in bands]
    slots = gemm_slots(plan, machine)
    persistent = dict(machine.grid_ms).get(plan.grid_size) if plan.grid_size < plan.num_tiles else None
    if persistent is not None:
        tile_ms, gemm_ms = persistent / plan.num_tiles, persistent
    else:
        tile_ms, gemm_ms = machine.wave_ms / slots, math.ceil(plan.num_tiles / slots) * machine.wave_ms
    local = plan.local_tiles * tile_ms
    work = [grp.tile_count * tile_ms for grp in plan.groups]
    work[-1] += max(0.0, gemm_ms - local - sum(work))
    return local, work


def _simulate(local_ms: float, work_ms: list[float], comm_ms: list[float], consumer: bool, gemm_slowdown: float,
              comm_slowdown: float) -> Prediction:
    """Both sides as fluids, event to event: the GEMM runs at ``1 / gemm_slowdown`` of its speed while a
    collective runs, a collective at ``1 / comm_slowdown`` while the GEMM computes. Reductions (producer GEMM):
    group g's collective starts once its tiles are done and collective g - 1 has ended. All-gather (consumer
    GEMM): the collectives run back to back from the start; the GEMM computes its own shard, then each group's
    tiles once that group's band has arrived (idle while it waits)."""
    groups = len(work_ms)
    gemm_queue = ([local_ms] if consumer else []) + list(work_ms)
    gemm_left, gemm_i = gemm_queue[0], 0  # the GEMM item in progress
    comm_left, comm_i = None, 0  # the collective in progress (None: none), the next to start
    done: list[float] = []  # reductions: each group's tiles done; all-gather: each group's tiles started
    ends: list[float] = []
    t = 0.0
    while gemm_i < len(gemm_queue) or comm_i < groups or comm_left is not None:
        if comm_left is None and comm_i < groups and (consumer or comm_i < len(done)):
            comm_left = comm_ms[comm_i]
        # All-gather: the GEMM waits for item gemm_i's band (item 0 is the own shard).
        waiting = consumer and 0 < gemm_i < len(gemm_queue) and len(ends) < gemm_i
        computing = gemm_i < len(gemm_queue) and not waiting
        if computing and consumer and gemm_i > 0 and len(done) < gemm_i:
            done.append(t)
        communicating = comm_left is not None
        gemm_rate = 1.0 / gemm_slowdown if communicating else 1.0
        comm_rate = 1.0 / comm_slowdown if computing else 1.0
        step = min(gemm_left / gemm_rate if computing else math.inf,
                   comm_left / comm_rate if communicating else math.inf)
        t += step
        if computing:
            gemm_left -= step * gemm_rate
            if gemm_left <= 1e-12:
                if not consumer:
                    done.append(t)
                gemm_i += 1
                gemm_left = gemm_queue[gemm_i] if gemm_i < len(gemm_queue) else 0.0
        if communicating:
            comm_left -= step * comm_rate
            if comm_left <= 1e-12:
                ends.append(t)
                comm_left, comm_i = None, comm_i + 1
    return Prediction(t, tuple(done), tuple(ends))


def _ring(plan: Plan, machine: Machine, curve: Curve, element_size: int) -> Prediction:
    """The P2P path's ring (``comm/tp/ring_schedule.py``), on one rank; every rank runs the same timeline shifted by
    nothing (the ring is symmetric), so a partial from rank ``r - 1`` is ready when this rank's own of the same
    (step, sub-band) is. ``C`` runs cuBLAS matmuls one after the other (``band_time``, times ``gemm_slowdown``: a
    copy engine runs beside them); ``X`` runs the pulls one after the other (the curve at the pulled bytes, times
    ``comm_slowdown``). A matmul that adds a pulled partial starts when ``C`` is free and that pull has landed; a
    pull starts when ``X`` is free and its data is ready. Local copies (the own shard into symmetric memory, the
    own reduced rows into the output) are not counted: they run at HBM speed on the copy engine."""
    world = plan.world_size
    width = plan.k if plan.op == "all_gather" else plan.n
    mm = lambda rows: machine.band_time(rows, plan.m) * machine.gemm_slowdown  # noqa: E731
    pull = lambda rows: curve.time_ms(rows * width * element_size) * machine.comm_slowdown  # noqa: E731
    if plan.op == "all_gather":
        sub_rows = [grp.rows for grp in plan.groups]
        c_free = mm(plan.block_rows)  # the own shard first
        x_free, done, ends = 0.0, [], []
        for _ in range(world - 1):
            for rows in sub_rows:
                x_free += pull(rows)
                ends.append(x_free)
                c_free = max(c_free, x_free) + mm(rows)
                done.append(c_free)
        return Prediction(c_free, tuple(done), tuple(ends))
    per = plan.sub_bands
    groups = plan.groups
    sub_rows = [g.rows for g in groups[:per]]  # every block is cut alike (the last may differ by a tile row)
    c_free = x_free = 0.0
    ready = [0.0] * per  # when the partial of (previous step, sub-band j) was written on the sending rank
    done, ends = [], []
    for s in range(world):
        landed = list(ready)
        if s > 0:
            for j, rows in enumerate(sub_rows):
                x_free = max(x_free, ready[j]) + pull(rows)
                landed[j] = x_free
                ends.append(x_free)
        for j, rows in enumerate(sub_rows):
            c_free = max(c_free, landed[j] if s > 0 else 0.0) + mm(rows)
            ready[j] = c_free
        done.append(c_free)
    if plan.op == "all_reduce":  # every peer's reduced sub-bands, pulled once written
        for _ in range(world - 1):
            for j, rows in enumerate(sub_rows):
                x_free = max(x_free, ready[j]) + pull(rows)
                ends.append(x_free)
    return Prediction(max(c_free, x_free), tuple(done), tuple(ends))


def sequential_ms(plan: Plan, machine: Machine, curve: Curve, element_size: int = 2) -> float:
    """cuBLAS then one collective on the whole result: what the op's sequential fallback costs."""
    return machine.cublas_ms + machine.launch_ms + curve.time_ms(sum(plan.group_bytes(element_size)))
