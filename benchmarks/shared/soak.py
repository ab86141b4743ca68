"""The soak at W ranks on one GPU: at least N random calls, each checked against the oracle each rank computes
locally, device memory sampled (after warm-up, every 1,000 calls, and at the end with no call's tensors alive).

The calls come in bursts (``bursts``): one call drawn (op, dtype, fp8 mode, shape from the smallest M the op allows
on the P2P path, odd ones included, ``b``'s layout, fp8 output dtype and bias, the plan's sub-bands), a group (the
world, or a second gloo group over the same ranks), eager or replayed, repeated 1 to 4 times on the same tensors
with new values (a replayed burst's repeats replay from the second call of a signature seen before). Every rank draws
the same sequence from one seed (``random.Random``: no hash-ordered set or dict decides anything).

The smallest M: reduce-scatter and all-gather ``W`` (one row per rank); all-reduce ``16 (W - 1) + 1`` (the P2P
all-reduce cuts ``C`` into ``W`` rank blocks of whole 16-row tiles; below that only the sequential plan exists,
which needs NCCL). Expert layers (dispatch then combine, exact or bounded, Zipf routing, a rank without tokens now
and then) are drawn too, each counting as two calls.
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.shared import calls as tc
from benchmarks.shared import experts as ex
from benchmarks.shared.runs import Progress, device_of, go_on, short, synchronize

MIB = 1 << 20
FLAT_MIB = 64
SAMPLE_EVERY = 1000
HALF_N = (8, 24, 48, 80, 136)
HALF_K = (16, 40, 64, 136)
FP8_N = (16, 48, 80, 144)
FP8_K = (128, 256, 512)
# Block-wise at K = 128 is refused: its scales ([M, 1] and [1, ceil(N/128)]) read as row-wise by shape.
FP8_BLOCK_K = (256, 512)
ROWS_PER_RANK = (1, 2, 3, 5, 8, 17, 33, 64)  # reduce-scatter and all-gather: M = W * rows
MOE_SHARE = 0.07  # of the bursts


@dataclass(frozen=True)
class Burst:
    """``repeats`` calls of ``call`` (a ``TpCall`` or ``MoeCall``) on group ``group`` (0: the world, 1: the second
    group), ``replay`` on or off."""

    call: object
    group: int
    replay: bool
    repeats: int

    @property
    def calls(self) -> int:
        return self.repeats * (2 if isinstance(self.call, ex.MoeCall) else 1)


def all_reduce_ms(world: int) -> tuple[int, ...]:
    lo = tc.min_all_reduce_m(world)
    return (lo, lo + 2, lo + 13, 2 * lo + 1, 16 * world + 16, 257, 511 + world)


def draw_tp(rng: random.Random, world: int, seed: int) -> tc.TpCall:
    op = rng.choice(list(tc.TP_OPS))
    fp8 = op in tc.FP8_OPS
    dtype = rng.choice(tc.FP8_MODES if fp8 else tuple(tc.HALF))
    kind = tc.TP_OPS[op]
    m = rng.choice(all_reduce_ms(world)) if kind == "all_reduce" else world * rng.choice(ROWS_PER_RANK)
    n = rng.choice(FP8_N if fp8 else HALF_N)
    k = rng.choice((FP8_BLOCK_K if dtype == "block" else FP8_K) if fp8 else HALF_K)
    transposed = rng.random() < 0.6
    out = rng.choice(("bf16", "fp32")) if fp8 else "bf16"
    bias = fp8 and rng.random() < 0.5
    sub_bands = rng.choice((1, 1, 2, 3))
    gathered = op == "all_gather_gemm" and rng.random() < 0.3
    call = tc.TpCall(op, dtype, m, n, k, transposed, out, bias, "given", sub_bands, gathered, seed)
    return call


def draw_moe(rng: random.Random, world: int, seed: int) -> ex.MoeCall:
    mode = rng.choice(ex.EXPERT_MODES)
    local = rng.choice((1, 2, 3))
    top_k = rng.choice((1, 2)) if local * world < 3 else rng.choice((1, 2, 3))
    empty = rng.randrange(world) if rng.random() < 0.2 else None
    return ex.MoeCall(rng.choice(tuple(ex.HALF)), mode, tokens=rng.choice((1, 5, 16, 33)), local=local, top_k=top_k,
                      hidden=rng.choice((32, 64, 96)), ffn=rng.choice((16, 48)), skew=rng.random() < 0.7,
                      empty_rank=empty, seed=seed)


def bursts(seed: int, world: int, calls: int):
    """The soak's bursts until they hold at least ``calls`` calls: the same sequence for the same arguments, on
    every rank and in every process."""
    rng = random.Random(f"flashoverlap-soak-{seed}-{world}")
    total = number = 0
    while total < calls:
        number += 1
        if rng.random() < MOE_SHARE:
            call = draw_moe(rng, world, number)
            repeats = rng.choice((1, 2, 3))
        else:
            call = draw_tp(rng, world, number)
            assert call.problem(world) is None, (call, call.problem(world))
            repeats = rng.choice((1, 1, 2, 3, 4))
        burst = Burst(call, rng.choice((0, 1)), rng.random() < 0.5, repeats)
        total += burst.calls
        yield burst


# -- one rank ------------------------------------------------------------------------------------------------------


def _set_replay(on: bool) -> None:
    from flashoverlap import settings

    if on:
        os.environ.pop("FLASHOVERLAP_REPLAY", None)
    else:
        os.environ["FLASHOVERLAP_REPLAY"] = "0"
    settings.refresh()


def _tp_burst(burst: Burst, rank: int, world: int, device: torch.device, group) -> tuple[int, list[str]]:
    """Run one burst of a tensor-parallel call; ``(wrong, notes)``."""
    call = burst.call
    cpu = device.type != "cuda"
    plan = None if cpu else tc.given_plan(call, world)
    path = "auto" if cpu else "p2p"
    mine = tc.weights(call, world, rank, device)
    values, wants = [], []
    for i in range(burst.repeats):
        everyone = [tc.operands(call, world, s, i, device) for s in range(world)]
        wants.append(tc.oracle(call, everyone, rank))
        values.append((everyone[rank].a, everyone[rank].scale_a))
        del everyone
    ops = tc.Operands(values[0][0].clone(), mine.b, None if values[0][1] is None else values[0][1].clone(),
                      mine.scale_b, mine.bias)
    scratch = torch.empty((call.out_rows(world), call.n), dtype=torch.float32, device=device)
    limit = tc.tolerance(call)
    wrong, notes = 0, []
    for i in range(burst.repeats):
        ops.a.copy_(values[i][0])
        if ops.scale_a is not None:
            ops.scale_a.copy_(values[i][1])
        out, gathered = tc.invoke(call, ops, group, plan, path)
        err = tc.relative_error(out, wants[i][0], scratch)
        bad = not err < limit
        if call.gathered and (gathered is None or not torch.equal(gathered, wants[i][1])):
            bad = True
        if bad:
            wrong += 1
            notes.append(f"{call.label()} group={burst.group} replay={burst.replay} #{i}: rel err {err:.3g}")
        if out.is_floating_point():
            out.fill_(float("nan"))
        del out, gathered
    return wrong, notes


def _moe_burst(burst: Burst, rank: int, world: int, device: torch.device, group) -> tuple[int, list[str]]:
    import flashoverlap as fo

    mc = burst.call
    path = "auto" if device.type != "cuda" else "p2p"
    case = ex.moe_case(mc, world, rank, burst.repeats, device)
    layout = fo.moe_layout(case.idx, mc.experts(world), group, mode=mc.mode, bound=mc.bound(world))
    x, act = case.xs[0].clone(), case.acts[0].clone()
    limit = ex.tolerance(mc.dtype)
    wrong, notes = 0, []
    for i in range(burst.repeats):
        x.copy_(case.xs[i])
        act.copy_(case.acts[i])
        h = fo.moe_dispatch_gemm(x, case.w_up, layout, group, path=path)
        y = fo.moe_gemm_combine(act, case.w_down, case.weights, layout, group, path=path)
        for what, got, want in (("dispatch", h, case.want_h[i]), ("combine", y, case.want_y[i])):
            err = tc.relative_error(got, want.float())
            if not err < limit:
                wrong += 1
                notes.append(f"{mc.label()} {what} group={burst.group} replay={burst.replay} #{i}: rel err {err:.3g}")
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        del h, y
    return wrong, notes


def _memory(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        return 0.0, 0.0
    return torch.cuda.memory_allocated(device) / MIB, torch.cuda.memory_reserved(device) / MIB


def _replays(groups, device) -> int:
    from benchmarks.shared.mechanics import replays

    return sum(replays(g, device, kind) for g in groups for kind in ("gemm", "expert")) if device.type == "cuda" else 0


def spawned(rank: int, world: int, options: dict, paths: list[str]):
    """``rank_main`` with rank ``rank``'s progress file (``paths[rank]``): what the step spawns."""
    return rank_main(rank, world, {**options, "progress": paths[rank]})


def rank_main(rank: int, world: int, options: dict) -> dict:
    """One rank of the soak: bursts until ``options["calls"]`` calls or the deadline (checked collectively every
    ``check_every`` bursts); returns this rank's tallies and memory samples, and writes them to its progress file
    every ``SAMPLE_EVERY`` calls."""
    device = device_of(options.get("device", "cuda"))
    progress = Progress(options.get("progress"))
    target = options["calls"]
    warmup = options.get("warmup", min(500, max(1, target // 10)))
    check_every = options.get("check_every", 25)
    second = dist.new_group(list(range(world)), backend="gloo")
    groups = (dist.group.WORLD, second)
    calls = wrong = errors = bursts_done = 0
    notes: list[str] = []
    samples: list[dict] = []
    warm: dict | None = None
    next_sample = SAMPLE_EVERY
    stopped = None
    start = time.time()
    timing_start = None

    def sample(label: str) -> dict:
        gc.collect()
        synchronize(device)
        allocated, reserved = _memory(device)
        record = {"at": label, "calls": calls, "allocated_mib": round(allocated, 1), "reserved_mib": round(reserved, 1)}
        samples.append(record)
        return record

    def report() -> dict:
        elapsed = time.time() - (timing_start or start)
        counted = max(1, calls - (warmup if timing_start else 0))
        return {"rank": rank, "calls": calls, "bursts": bursts_done, "wrong": wrong, "errors": errors,
                "notes": notes[:20], "samples": samples, "warmup": warm, "stopped": stopped,
                "seconds": round(time.time() - start, 1), "ms_per_call": round(1e3 * elapsed / counted, 2),
                "replays": _replays(groups, device)}

    for burst in bursts(options.get("seed", 0), world, target):
        if bursts_done % check_every == 0 and not go_on(options["deadline"]):
            stopped = f"budget spent after {calls} calls"
            break
        group = groups[burst.group]
        _set_replay(burst.replay)
        try:
            run = _moe_burst if isinstance(burst.call, ex.MoeCall) else _tp_burst
            bad, burst_notes = run(burst, rank, world, device, group)
            wrong += bad
            notes += burst_notes[: max(0, 20 - len(notes))]
        except Exception as exc:  # noqa: BLE001 -- counted, named, the soak goes on
            errors += 1
            if len(notes) < 20:
                notes.append(f"{burst.call.label()}: {short(exc, 600)}")
        calls += burst.calls
        bursts_done += 1
        if warm is None and calls >= warmup:
            warm = sample("after warm-up")
            timing_start = time.time()
            if rank == 0:
                print(f"soak W={world}: warm-up done ({calls} calls, {time.time() - start:.1f} s), "
                      f"{warm['allocated_mib']} MiB allocated", flush=True)
        if calls >= next_sample:
            next_sample += SAMPLE_EVERY
            record = sample(f"{calls} calls")
            progress.write(event="progress", report=report())
            if rank == 0:
                rate = report()["ms_per_call"]
                print(f"soak W={world}: {calls} calls, wrong {wrong}, errors {errors}, {rate} ms/call, "
                      f"{record['allocated_mib']} MiB allocated ({record['reserved_mib']} reserved)", flush=True)
    _set_replay(True)
    sample("end")
    final = report()
    progress.write(event="done", report=final)
    try:
        import flashoverlap as fo

        synchronize(device)
        fo.release()
    except Exception as exc:  # noqa: BLE001
        final["release_error"] = short(exc)
    return final


def summarise(world: int, reports: list[dict], hung: str | None = None) -> dict:
    """The results row of one W from every rank's report (a hung spawn: from the ranks' last progress)."""
    reports = [r for r in reports if r]
    calls = min((r["calls"] for r in reports), default=0)
    memory = []
    flat = None
    rank0 = next((r for r in reports if r.get("rank") == 0), reports[0] if reports else None)
    if rank0:
        memory = [s["allocated_mib"] for s in rank0["samples"]]
        warm = rank0.get("warmup")
        if warm is not None:
            later = [s["allocated_mib"] for s in rank0["samples"] if s["calls"] >= warm["calls"]]
            flat = max(later, default=warm["allocated_mib"]) <= warm["allocated_mib"] + FLAT_MIB
    worst_rank_growth = None
    grown = []
    for r in reports:
        warm = r.get("warmup")
        if warm is not None:
            grown.append(max(s["allocated_mib"] for s in r["samples"] if s["calls"] >= warm["calls"])
                         - warm["allocated_mib"])
    if grown:
        worst_rank_growth = round(max(grown), 1)
        flat = flat if flat is None else flat and worst_rank_growth <= FLAT_MIB
    return {"W": world, "calls": calls, "wrong": sum(r["wrong"] for r in reports),
            "errors": sum(r["errors"] for r in reports), "hangs": 1 if hung else 0,
            "memory_mib": memory, "reserved_mib": [s["reserved_mib"] for s in rank0["samples"]] if rank0 else [],
            "sample_points": [s["at"] for s in rank0["samples"]] if rank0 else [], "flat": flat,
            "worst_rank_growth_mib": worst_rank_growth,
            "ms_per_call": max((r["ms_per_call"] for r in reports), default=None),
            "replays": rank0.get("replays") if rank0 else None,
            "stopped": next((r["stopped"] for r in reports if r.get("stopped")), None),
            "notes": sorted({n for r in reports for n in r["notes"]})[:20] or None,
            "hang": hung, "seconds": max((r["seconds"] for r in reports), default=None)}
