"""The soak at W ranks on one GPU: at least N random calls, each checked against an oracle each rank computes
locally, device memory sampled (after warm-up, every 1,000 calls, and at the end with no call's tensors alive).

The calls come from a bounded pool (``pool``), drawn once from the seed: every tensor-parallel op x dtype (fp8: x
tensor-, row-, block-wise), each at its smallest M on the P2P path and at a drawn one (odd ones included), ``b`` as
``w.t()`` and row-major, every fp8 output dtype with and without a bias, the plan's sub-bands 1 to 3, all_gather_gemm
returning its gathered input; and expert layers (dispatch then combine, exact and bounded, bf16 and fp16, Zipf
routing, a rank without tokens), each counting as two calls. Signatures therefore repeat: a call's first-call work
(the agreement, the plan, its kernels, the workspace) is paid once per pool entry and group, and replayed calls
replay. Each entry holds ``SETS`` sets of values; every call copies the next set into the entry's input tensors (the
same tensors, so that a repeated call may replay), and a replayed call that read stale inputs or wrote nothing shows.

The soak is the warm-up sweep (``sweep``: every entry on both groups, three calls with replay on: eager, captured,
replayed; in a drawn order) and then bursts (``bursts``): an entry drawn, a group (the world, or a second gloo
group over the same ranks), eager or replayed, repeated 1 to 4 times with new values. Every rank draws the same
sequence from one seed (``random.Random``: no hash-ordered set or dict decides anything).

The oracle (``calls.oracle``, ``experts.moe_case``: none of the library's code) is computed once per entry and value
set, on the CPU, from every rank's operands made from seeds (only what it reads: reduce-scatter this rank's rows,
all-gather this rank's weight), then kept on the device with its norm. A call's check is queued on the device behind
it (the output against the oracle into a slot of an error buffer; all_gather_gemm's gathered input compared element
for element), the output then poisoned with NaN (the next call of the shape gets that memory back), and one host
synchronisation every ``READ_EVERY`` bursts (``--read-every``) reads their errors: every call is checked, and calls are
issued back to back (a synchronisation every burst would drain each rank's queue every few calls, while W processes
time-slice the one GPU).
A row's ``checked`` counts the checks over all ranks, ``wrong`` the failed ones (an expert layer has two checks, and
so has an all_gather_gemm that returns its gathered input).

The smallest M: reduce-scatter and all-gather ``W`` (one row per rank); all-reduce ``16 (W - 1) + 1`` (the P2P
all-reduce cuts ``C`` into ``W`` rank blocks of whole 16-row tiles; below that only the sequential plan exists,
which needs NCCL).
"""

from __future__ import annotations

import gc
import itertools
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
MOE_SHARE = 0.07  # of the bursts after the sweep
SETS = 3  # value sets per pool entry (consecutive calls of a burst take consecutive sets)
SWEEP_REPEATS = 3  # the sweep's calls per entry and group, replay on: eager, captured, replayed
ERROR_SLOTS = 16  # a burst's checks (at most 4 calls, two checks each for an expert layer)
# Bursts whose checks are read at one host synchronisation (the default of --read-every). At W = 8 on one H100, 32
# ran 33.0 ms a call against 8's 41.9, back to back on one machine (logs/soak-read-every-8c36ac3-h100/): each read
# drains eight ranks' queues on the time-sliced GPU. Every call is still checked; a wrong one is named up to 32
# bursts later.
READ_EVERY = 32
FP8_COMBOS = (("bf16", False), ("bf16", True), ("fp32", False), ("fp32", True))  # (output dtype, bias)


@dataclass(frozen=True)
class Burst:
    """``repeats`` calls of ``call`` (a ``TpCall`` or ``MoeCall`` of the pool) on group ``group`` (0: the world, 1:
    the second group), ``replay`` on or off, call i taking value set ``(first + i) % SETS``."""

    call: object
    group: int
    replay: bool
    repeats: int
    first: int = 0

    @property
    def calls(self) -> int:
        return self.repeats * (2 if isinstance(self.call, ex.MoeCall) else 1)


def all_reduce_ms(world: int) -> tuple[int, ...]:
    lo = tc.min_all_reduce_m(world)
    return (lo, lo + 2, lo + 13, 2 * lo + 1, 16 * world + 16, 257, 511 + world)


def tp_pool(seed: int, world: int) -> list[tc.TpCall]:
    """The tensor-parallel entries: each op x dtype (fp8: x mode) at its smallest M and at a drawn one, ``b``'s two
    layouts, the four fp8 (output dtype, bias) pairs, sub-bands 1 to 3 and a returned gathered input among them."""
    rng = random.Random(f"flashoverlap-soak-pool-{seed}-{world}")
    pairs = [(op, d) for op in tc.HALF_OPS for d in tc.HALF] + [(op, m) for op in tc.FP8_OPS for m in tc.FP8_MODES]
    calls = []
    for index, (op, dtype) in enumerate(pairs):
        fp8, kind = op in tc.FP8_OPS, tc.TP_OPS[op]
        for variant in (0, 1):
            if kind == "all_reduce":
                m = all_reduce_ms(world)[0] if variant == 0 else rng.choice(all_reduce_ms(world)[1:])
            else:
                m = world * (1 if variant == 0 else rng.choice(ROWS_PER_RANK[1:]))
            n = rng.choice(FP8_N if fp8 else HALF_N)
            k = rng.choice((FP8_BLOCK_K if dtype == "block" else FP8_K) if fp8 else HALF_K)
            out, bias = FP8_COMBOS[(2 * index + variant) % 4] if fp8 else ("bf16", False)
            call = tc.TpCall(op, dtype, m, n, k, transposed=(index + variant) % 2 == 0, out=out, bias=bias,
                             plan="given", sub_bands=1 if variant == 0 else 1 + index % 3,
                             gathered=op == "all_gather_gemm" and variant == 1, seed=len(calls) + 1)
            assert call.problem(world) is None, (call, call.problem(world))
            calls.append(call)
    return calls


def moe_pool(seed: int, world: int) -> list[ex.MoeCall]:
    """The expert entries: bf16 and fp16 x exact and bounded, each with every rank holding tokens and with one rank
    holding none; sizes drawn (tokens 1 to 33 + 7 per rank, 1 to 3 local experts, top-1 to top-3)."""
    rng = random.Random(f"flashoverlap-soak-moe-pool-{seed}-{world}")
    calls = []
    for dtype, mode in itertools.product(tuple(ex.HALF), ex.EXPERT_MODES):
        for variant in (0, 1):
            local = rng.choice((1, 2, 3))
            top_k = rng.choice((1, 2)) if local * world < 3 else rng.choice((1, 2, 3))
            empty = rng.randrange(world) if variant == 1 else None
            call = ex.MoeCall(dtype, mode, tokens=rng.choice((1, 5, 16, 33)), local=local, top_k=top_k,
                              hidden=rng.choice((32, 64, 96)), ffn=rng.choice((16, 48)), skew=rng.random() < 0.7,
                              empty_rank=empty, seed=1000 + len(calls))
            assert call.problem(world) is None, (call, call.problem(world))
            calls.append(call)
    return calls


def sweep(seed: int, world: int) -> list[Burst]:
    """The warm-up: every pool entry on both groups, ``SWEEP_REPEATS`` calls with replay on, in a drawn order."""
    rng = random.Random(f"flashoverlap-soak-sweep-{seed}-{world}")
    out = [Burst(call, group, True, SWEEP_REPEATS, rng.randrange(SETS))
           for call in [*tp_pool(seed, world), *moe_pool(seed, world)] for group in (0, 1)]
    rng.shuffle(out)
    return out


def sweep_calls(seed: int, world: int) -> int:
    return sum(b.calls for b in sweep(seed, world))


def bursts(seed: int, world: int, calls: int):
    """The soak's bursts until they hold at least ``calls`` calls (the sweep first): the same sequence for the same
    arguments, on every rank and in every process."""
    tp, moe = tp_pool(seed, world), moe_pool(seed, world)
    rng = random.Random(f"flashoverlap-soak-{seed}-{world}")
    total = 0
    for burst in sweep(seed, world):
        if total >= calls:
            return
        total += burst.calls
        yield burst
    while total < calls:
        if rng.random() < MOE_SHARE:
            call, repeats = rng.choice(moe), rng.choice((1, 2, 3))
        else:
            call, repeats = rng.choice(tp), rng.choice((1, 1, 2, 3, 4))
        burst = Burst(call, rng.choice((0, 1)), rng.random() < 0.5, repeats, rng.randrange(SETS))
        total += burst.calls
        yield burst


# -- one rank: the pool's tensors and oracles ---------------------------------------------------------------------


class TpEntry:
    """A tensor-parallel entry on one rank: the live operands on the device (``a`` and fp8 ``scale_a`` overwritten
    before each call), per value set this rank's inputs, the oracle (fp32), its norm and the gathered input."""

    def __init__(self, call: tc.TpCall, world: int, rank: int, device: torch.device, sets: int = SETS) -> None:
        host = torch.device("cpu")
        mine = tc.weights(call, world, rank, host)
        # the oracle reads every rank's weights for the reductions, only this rank's for the all-gather
        weights = [mine if s == rank or call.kind == "all_gather" else tc.weights(call, world, s, host)
                   for s in range(world)]
        self.call = call
        self.values, self.wants, self.norms, self.fulls = [], [], [], []
        for index in range(sets):
            acts = [tc.activations(call, world, s, index, host) for s in range(world)]
            everyone = [tc.Operands(a, w.b, sa, w.scale_b, w.bias) for (a, sa), w in zip(acts, weights)]
            want, full = tc.oracle(call, everyone, rank)
            a, scale_a = acts[rank]
            self.values.append((a.to(device), None if scale_a is None else scale_a.to(device)))
            self.wants.append(want.to(device))
            self.norms.append(float(torch.linalg.vector_norm(want)))
            self.fulls.append(None if full is None else full.to(device))
        first_a, first_scale = self.values[0]
        b = mine.b.to(device)
        assert b.stride() == mine.b.stride(), (b.stride(), mine.b.stride())  # w.t() stays column-major
        self.ops = tc.Operands(first_a.clone(), b, None if first_scale is None else first_scale.clone(),
                               None if mine.scale_b is None else mine.scale_b.to(device),
                               None if mine.bias is None else mine.bias.to(device))
        self.scratch = torch.empty((call.out_rows(world), call.n), dtype=torch.float32, device=device)
        self.limit = tc.tolerance(call)

    def load(self, index: int) -> None:
        a, scale_a = self.values[index]
        self.ops.a.copy_(a)
        if scale_a is not None:
            self.ops.scale_a.copy_(scale_a)


class MoeEntry:
    """An expert entry on one rank: ``experts.moe_case`` made on the CPU, moved to the device, the live ``x`` and
    ``act`` overwritten before each call."""

    def __init__(self, call: ex.MoeCall, world: int, rank: int, device: torch.device, sets: int = SETS) -> None:
        case = ex.moe_case(call, world, rank, sets, "cpu")
        self.call = call
        self.idx, self.weights = case.idx.to(device), case.weights.to(device)
        self.w_up, self.w_down = case.w_up.to(device), case.w_down.to(device)
        assert self.w_up.stride() == case.w_up.stride() and self.w_down.stride() == case.w_down.stride()
        self.xs = [x.to(device) for x in case.xs]
        self.acts = [a.to(device) for a in case.acts]
        self.wants = [(h.float().to(device), y.float().to(device)) for h, y in zip(case.want_h, case.want_y)]
        self.norms = [(float(torch.linalg.vector_norm(h.float())), float(torch.linalg.vector_norm(y.float())))
                      for h, y in zip(case.want_h, case.want_y)]
        self.x, self.act = self.xs[0].clone(), self.acts[0].clone()
        self.scratch = (torch.empty(case.want_h[0].shape, dtype=torch.float32, device=device),
                        torch.empty(case.want_y[0].shape, dtype=torch.float32, device=device))
        self.limit = ex.tolerance(call.dtype)

    def load(self, index: int) -> None:
        self.x.copy_(self.xs[index])
        self.act.copy_(self.acts[index])


class Checks:
    """The checks of up to ``bursts`` bursts, queued on the device: each a relative error (Frobenius norm of the
    difference into a slot of ``errors``, divided by the oracle's norm on the host) or an exact comparison
    (mismatches into a slot); ``read`` synchronises once and returns the notes of the wrong ones; ``full`` says when
    ``bursts`` bursts have ended since (``end_burst``)."""

    def __init__(self, device: torch.device, bursts: int = 1) -> None:
        self.bursts = bursts
        self.errors = torch.zeros(ERROR_SLOTS * bursts, dtype=torch.float32, device=device)
        self.pending: list[tuple] = []
        self.queued_bursts = 0  # bursts ended since the last read

    def end_burst(self) -> None:
        self.queued_bursts += 1

    def full(self) -> bool:
        """Whether ``bursts`` bursts have ended since the last read (their checks fill at most every slot)."""
        return self.queued_bursts >= self.bursts

    def close(self, got: torch.Tensor, want: torch.Tensor, norm: float, limit: float, scratch: torch.Tensor,
              what: str) -> None:
        if tuple(got.shape) != tuple(want.shape):
            self.pending.append((None, f"{what}: shape {list(got.shape)}, want {list(want.shape)}"))
            return
        slot = len(self.pending)
        if want.numel() == 0:
            self.pending.append(("empty", what))
            return
        torch.linalg.vector_norm(scratch.copy_(got).sub_(want), out=self.errors[slot])
        self.pending.append(("close", what, norm, limit))

    def equal(self, got: torch.Tensor | None, want: torch.Tensor, what: str) -> None:
        if got is None or tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            self.pending.append((None, f"{what}: gathered input missing or of another shape or dtype"))
            return
        self.errors[len(self.pending)] = torch.ne(got, want).sum()
        self.pending.append(("equal", what))

    def read(self) -> tuple[int, list[str]]:
        """``(checks, notes of the wrong ones)``; empties the pending checks."""
        pending, self.pending, self.queued_bursts = self.pending, [], 0
        if not pending:
            return 0, []
        values = self.errors[: len(pending)].tolist()
        notes = []
        for value, check in zip(values, pending):
            if check[0] is None:
                notes.append(check[1])
            elif check[0] == "close":
                _, what, norm, limit = check
                err = value / max(norm, 1e-30)
                if not err < limit:  # NaN (an element never written) is not < limit
                    notes.append(f"{what}: rel err {err:.3g}")
            elif check[0] == "equal" and value != 0:
                notes.append(f"{check[1]}: {int(value)} elements differ from the gathered input")
        return len(pending), notes


class Pool:
    """One rank's pool entries, made at their first call (the sweep)."""

    def __init__(self, world: int, rank: int, device: torch.device) -> None:
        self.world, self.rank, self.device = world, rank, device
        self.entries: dict = {}
        self.seconds = 0.0

    def __call__(self, call) -> TpEntry | MoeEntry:
        entry = self.entries.get(call)
        if entry is None:
            start = time.perf_counter()
            kind = MoeEntry if isinstance(call, ex.MoeCall) else TpEntry
            entry = self.entries[call] = kind(call, self.world, self.rank, self.device)
            self.seconds += time.perf_counter() - start
        return entry


def _set_replay(on: bool) -> None:
    from flashoverlap import settings

    if on:
        os.environ.pop("FLASHOVERLAP_REPLAY", None)
    else:
        os.environ["FLASHOVERLAP_REPLAY"] = "0"
    settings.refresh()


def _tp_burst(burst: Burst, entry: TpEntry, world: int, device: torch.device, group, checks: Checks) -> None:
    """Queue one burst of a tensor-parallel call and its checks."""
    call = burst.call
    cuda = device.type == "cuda"
    plan = tc.given_plan(call, world) if cuda else None
    path = "p2p" if cuda else "auto"
    for i in range(burst.repeats):
        index = (burst.first + i) % SETS
        entry.load(index)
        out, gathered = tc.invoke(call, entry.ops, group, plan, path)
        what = f"{call.label()} group={burst.group} replay={burst.replay} #{i}"
        checks.close(out, entry.wants[index], entry.norms[index], entry.limit, entry.scratch, what)
        if call.gathered:
            checks.equal(gathered, entry.fulls[index], what)
        if out.is_floating_point():
            out.fill_(float("nan"))  # the next call's output gets this memory back
        del out, gathered


def _moe_burst(burst: Burst, entry: MoeEntry, world: int, device: torch.device, group, checks: Checks) -> None:
    import flashoverlap as fo

    mc = burst.call
    path = "p2p" if device.type == "cuda" else "auto"
    layout = fo.moe_layout(entry.idx, mc.experts(world), group, mode=mc.mode, bound=mc.bound(world))
    for i in range(burst.repeats):
        index = (burst.first + i) % SETS
        entry.load(index)
        h = fo.moe_dispatch_gemm(entry.x, entry.w_up, layout, group, path=path)
        y = fo.moe_gemm_combine(entry.act, entry.w_down, entry.weights, layout, group, path=path)
        for what, got, want, norm, scratch in (("dispatch", h, entry.wants[index][0], entry.norms[index][0],
                                                entry.scratch[0]),
                                               ("combine", y, entry.wants[index][1], entry.norms[index][1],
                                                entry.scratch[1])):
            checks.close(got, want, norm, entry.limit, scratch,
                         f"{mc.label()} {what} group={burst.group} replay={burst.replay} #{i}")
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        del h, y


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
    """One rank of the soak: the sweep, then bursts, until ``options["calls"]`` calls or the deadline (checked
    collectively every ``check_every`` bursts); returns this rank's tallies and memory samples, and writes them to
    its progress file every ``SAMPLE_EVERY`` calls."""
    device = device_of(options.get("device", "cuda"))
    if device.type == "cuda":  # the oracles are made on the CPU: the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    progress = Progress(options.get("progress"))
    target = options["calls"]
    seed = options.get("seed", 0)
    warmup = min(target, options.get("warmup", sweep_calls(seed, world)))
    check_every = options.get("check_every", 25)
    second = dist.new_group(list(range(world)), backend="gloo")
    groups = (dist.group.WORLD, second)
    pool = Pool(world, rank, device)
    checks = Checks(device, options.get("read_every", READ_EVERY))
    calls = wrong = errors = bursts_done = checked = 0
    notes: list[str] = []
    samples: list[dict] = []
    warm: dict | None = None
    next_sample = SAMPLE_EVERY
    stopped = None
    start = time.time()
    timing_start = None

    def sample(label: str) -> dict:
        read_checks()  # the sample's synchronisation reads the checks queued since the last read
        gc.collect()
        synchronize(device)
        allocated, reserved = _memory(device)
        record = {"at": label, "calls": calls, "allocated_mib": round(allocated, 1), "reserved_mib": round(reserved, 1)}
        samples.append(record)
        return record

    def report() -> dict:
        elapsed = time.time() - (timing_start or start)
        counted = max(1, calls - (warm["calls"] if timing_start else 0))
        return {"rank": rank, "calls": calls, "checked": checked, "bursts": bursts_done, "wrong": wrong,
                "errors": errors, "notes": notes[:20], "samples": samples, "warmup": warm, "stopped": stopped,
                "seconds": round(time.time() - start, 1), "ms_per_call": round(1e3 * elapsed / counted, 2),
                "warmup_seconds": None if warm is None else warm.get("seconds"),
                "pool": {"tp": len(tp_pool(seed, world)), "moe": len(moe_pool(seed, world)), "sets": SETS,
                         "oracle_seconds": round(pool.seconds, 1)},
                "replays": _replays(groups, device)}

    def read_checks() -> None:
        nonlocal checked, wrong, errors, notes
        try:
            done, bad = checks.read()
        except Exception as exc:  # noqa: BLE001 -- a device error surfaces here
            errors += 1
            done, bad = 0, [f"{last}: reading the checks: {short(exc, 600)}"]
        checked += done
        wrong += len(bad)
        notes += bad[: max(0, 20 - len(notes))]

    last = "the soak"  # the last burst's call, named where reading the checks fails
    for burst in bursts(seed, world, target):
        if bursts_done % check_every == 0 and not go_on(options["deadline"]):
            stopped = f"budget spent after {calls} calls"
            break
        last = burst.call.label()
        group = groups[burst.group]
        _set_replay(burst.replay)
        try:
            entry = pool(burst.call)
            run = _moe_burst if isinstance(burst.call, ex.MoeCall) else _tp_burst
            run(burst, entry, world, device, group, checks)
        except Exception as exc:  # noqa: BLE001 -- counted, named, the soak goes on
            errors += 1
            if len(notes) < 20:
                notes.append(f"{burst.call.label()}: {short(exc, 600)}")
        calls += burst.calls
        bursts_done += 1
        checks.end_burst()
        if checks.full():
            read_checks()  # the host's one synchronisation for READ_EVERY bursts (a sample's reads them too)
        if warm is None and calls >= warmup:
            warm = sample("after warm-up")
            warm["seconds"] = round(time.time() - start, 1)
            timing_start = time.time()
            if rank == 0:
                print(f"soak W={world}: warm-up done ({calls} calls, {warm['seconds']} s, oracles "
                      f"{pool.seconds:.1f} s), {warm['allocated_mib']} MiB allocated", flush=True)
        if calls >= next_sample:
            next_sample += SAMPLE_EVERY
            record = sample(f"{calls} calls")
            progress.write(event="progress", report=report())
            if rank == 0:
                rate = report()["ms_per_call"]
                print(f"soak W={world}: {calls} calls, wrong {wrong}, errors {errors}, {rate} ms/call, "
                      f"{record['allocated_mib']} MiB allocated ({record['reserved_mib']} reserved)", flush=True)
    _set_replay(True)
    sample("end")  # the pool's tensors still alive, as at every sample: no call's
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
    return {"W": world, "calls": calls, "checked": sum(r.get("checked", 0) for r in reports),
            "wrong": sum(r["wrong"] for r in reports),
            "errors": sum(r["errors"] for r in reports), "hangs": 1 if hung else 0,
            "memory_mib": memory, "reserved_mib": [s["reserved_mib"] for s in rank0["samples"]] if rank0 else [],
            "sample_points": [s["at"] for s in rank0["samples"]] if rank0 else [], "flat": flat,
            "worst_rank_growth_mib": worst_rank_growth,
            "ms_per_call": max((r["ms_per_call"] for r in reports), default=None),
            "replays": rank0.get("replays") if rank0 else None,
            "stopped": next((r["stopped"] for r in reports if r.get("stopped")), None),
            "notes": sorted({n for r in reports for n in r["notes"]})[:20] or None,
            "hang": hung, "seconds": max((r["seconds"] for r in reports), default=None),
            "warmup_seconds": max((r.get("warmup_seconds") or 0 for r in reports), default=None),
            "pool": rank0.get("pool") if rank0 else None}
