"""The performance model (issue 5): a plan's end-to-end time predicted from the GEMM's time per wave of tiles,
the SMs communication takes from it, the two sides' mutual slowdown, and the collective's bandwidth curve.
``docs/model.md`` states the formulas; this module is their implementation. Pure Python: no GPU needed.

Reduction ops (all-reduce, reduce-scatter): the GEMM produces groups in order; each group's collective starts
when its tiles are done and the previous collective has finished. All-gather: the collectives run first, band
after band; the GEMM computes the rank's own shard, then each band's tiles once that band has arrived.
"""

from __future__ import annotations

import bisect
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
    cuBLAS GEMM alone (the sequential baseline). ``comm_sms``: SMs the collective's kernels occupy while they run
    (NCCL: its CTAs; P2P: 0). ``gemm_slowdown`` / ``comm_slowdown``: each side's time factor while the other runs
    (measured: ``bench --interference`` / ``--movers``). ``launch_ms``: fixed cost per collective on top of the
    curve (the stream wait, the launch). ``band_ms``: ``(rows, ms)`` pairs, one cuBLAS matmul of ``rows`` rows of
    this shape timed alone, for the band heights of the cuBLAS-band candidates (a band of a few hundred rows
    fills a fraction of a wave: its time is not its share of ``cublas_ms``); heights not listed take their
    share."""

    num_sms: int
    wave_ms: float
    cublas_ms: float
    comm_sms: int = 0
    gemm_slowdown: float = 1.0
    comm_slowdown: float = 1.0
    launch_ms: float = 0.0
    band_ms: tuple[tuple[int, float], ...] = ()

    def band_time(self, rows: int, total_rows: int) -> float:
        """One cuBLAS matmul of ``rows`` of the ``total_rows`` rows: measured if listed, else its share."""
        return dict(self.band_ms).get(rows, self.cublas_ms * rows / total_rows)


@dataclass(frozen=True)
class Prediction:
    total_ms: float
    group_done_ms: tuple[float, ...]  # when each group's tiles are done (reductions) or begin (all-gather)
    comm_done_ms: tuple[float, ...]  # when each group's collective ends


def gemm_slots(plan: Plan, machine: Machine) -> int:
    """Tiles in flight at once: the persistent grid's programs, or, with one program per tile, the SMs the
    collectives leave (their CTAs take SMs as GEMM programs retire)."""
    if plan.grid_size < plan.num_tiles:
        return max(1, min(plan.grid_size, machine.num_sms))
    return max(1, machine.num_sms - machine.comm_sms)


def predict(plan: Plan, machine: Machine, curve: Curve, element_size: int = 2) -> Prediction:
    """Predicted end-to-end time of one call of ``plan`` (see ``docs/model.md``)."""
    comm = [machine.launch_ms + curve.time_ms(b) for b in plan.group_bytes(element_size)]
    if plan.sequential:
        total = machine.cublas_ms + machine.launch_ms + curve.time_ms(sum(plan.group_bytes(element_size)))
        return Prediction(total, (machine.cublas_ms,), (total,))
    local_ms, work_ms, gemm_end = _compute(plan, machine)
    if plan.op == "all_gather":
        return _consumer(plan, machine, comm, local_ms, work_ms)
    done, ends, t_comm, t_gemm = [], [], 0.0, 0.0
    for work, c in zip(work_ms, comm):
        t_gemm += work
        done.append(min(t_gemm, gemm_end))
        t_comm = _collective_end(max(done[-1], t_comm), c, gemm_end, machine.comm_slowdown)
        ends.append(t_comm)
    return Prediction(max(gemm_end, ends[-1]), tuple(done), tuple(ends))


def _compute(plan: Plan, machine: Machine) -> tuple[float, list[float], float]:
    """The GEMM side: time of the tiles needing no communication (all-gather's own shard), of each group's
    tiles, and when the whole GEMM ends (beside the communication: ``gemm_slowdown`` applied)."""
    slow = machine.gemm_slowdown
    if plan.gemm == "cublas":  # one matmul per group and row block (see ops/_bands.py, all_gather_gemm.py)
        calls = plan.blocks - 1 if plan.op == "all_gather" else plan.blocks
        bands = [machine.band_time(grp.rows, plan.m) * slow for grp in plan.groups]
        local = sum(bands) if plan.op == "all_gather" else 0.0
        work = [calls * band for band in bands]
        return local, work, local + sum(work)
    slots = gemm_slots(plan, machine)
    tile_ms = machine.wave_ms * slow / slots  # fluid: tiles per ms
    gemm_end = math.ceil(plan.num_tiles / slots) * machine.wave_ms * slow
    return plan.local_tiles * tile_ms, [grp.tile_count * tile_ms for grp in plan.groups], gemm_end


def _collective_end(start: float, work_ms: float, gemm_end: float, slowdown: float) -> float:
    """When a collective needing ``work_ms`` alone, started at ``start``, ends: at ``1/slowdown`` speed while the
    GEMM runs (until ``gemm_end``), at full speed after."""
    beside = max(0.0, gemm_end - start)
    if beside * 1.0 >= work_ms * slowdown:
        return start + work_ms * slowdown
    return start + beside + (work_ms - beside / slowdown)


def _consumer(plan: Plan, machine: Machine, comm: list[float], local_ms: float,
              work_ms: list[float]) -> Prediction:
    """All-gather: bands arrive in order; the GEMM does its own shard's tiles, then each band's remote tiles."""
    arrived, t = [], 0.0
    for c in comm:
        t += c * machine.comm_slowdown
        arrived.append(t)
    t_gemm = local_ms  # the rank's own shard, first
    starts = []
    for work, ready in zip(work_ms, arrived):  # a group's tiles are the band's rows of the other shards
        t_gemm = max(t_gemm, ready)
        starts.append(t_gemm)
        t_gemm += work
    return Prediction(t_gemm, tuple(starts), tuple(arrived))


def sequential_ms(plan: Plan, machine: Machine, curve: Curve, element_size: int = 2) -> float:
    """cuBLAS then one collective on the whole result: what the op's sequential fallback costs."""
    return machine.cublas_ms + machine.launch_ms + curve.time_ms(sum(plan.group_bytes(element_size)))
