"""Faults at W ranks on one GPU with ``FLASHOVERLAP_DEBUG_TIMEOUT`` set: one rank (``absent``) fails at the third
call of a sequence (two calls that every rank makes and checks first), the others make the call; each surviving rank
must raise a Python error that names the op, the group and the absent rank within the debug timeout + 10 s, and no
rank may return a tensor from that call.

Scenarios (``SCENARIOS``), each in its own set of processes (a fault leaves the group unusable):

- ``skip``: the absent rank skips the call and then sleeps past the others' deadline (it never joins);
- ``raise``: it raises a Python error before the call, and its process ends as a program's does on an uncaught
  error (the group torn down with it);
- ``stall``: it sleeps past the debug timeout (timeout + 5 s) before making the call (it is a surviving rank too,
  reported apart: ``faulty``);
- ``dies``: its process ends (``os._exit``) before the call;
- ``dies_in_call``: its process ends ``DIE_AFTER`` seconds into the call (a timer thread), or as soon as the call
  returns if that is sooner: the peers are past the agreement check, their GPU work waiting on its flags. A peer
  whose call had everything it needed before the death may return: with the right values that is no fault
  (``completed_before_the_death``); with wrong ones it is.

Ops (``FAULT_OPS``): every tensor-parallel op and the expert ops (``moe_layout``, ``moe_dispatch_gemm``,
``moe_gemm_combine``: a layer's sequence is layout, dispatch, combine; the fault is at the named one).

``testing.spawn`` ends every rank as soon as one ends without reporting, so the ranks here are started by
``launch``, which lets each report (or end, or hang) on its own and kills what is left at its deadline: the set-up's
allowance until the first rank reaches the faulty call, then the debug timeout + 30 s (``AFTER_FAULT``).
"""

from __future__ import annotations

import os
import queue as queue_module
import re
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.shared import calls as tc
from benchmarks.shared import experts as ex

SCENARIOS = ("skip", "raise", "stall", "dies", "dies_in_call")
EXPERT_FAULT_OPS = ("moe_layout", "moe_dispatch_gemm", "moe_gemm_combine")
FAULT_OPS = (*tc.TP_OPS, *EXPERT_FAULT_OPS)
MARGIN = 10.0  # seconds past the debug timeout a surviving rank may take to raise
AFTER_FAULT = 30.0  # seconds past the debug timeout before the launcher stops waiting
SETUP_ALLOWANCE = 120.0  # seconds from the start until some rank reaches the faulty call
WARMUP_CALLS = 2
DIE_AFTER = 0.02  # seconds into the faulty call at which a dies_in_call rank's process ends


# -- the verdict (pure) --------------------------------------------------------------------------------------------


_RANK_LIST = re.compile(r"\branks?(?:\s*\(s\))?\s*\[([\d,\s]*)\]", re.I)
_RANK_ONE = re.compile(r"\branks?(?:\s*\(s\))?\s+(\d+(?:\s*(?:,|and)\s*\d+)*)", re.I)
_FROM_RANK = re.compile(r"\b(?:from|of|at)\s+(\d+)\b", re.I)


def ranks_named(message: str, group_description: str | None = None, loose: bool = False) -> set[int]:
    """The ranks a message names: ``rank 3``, ``ranks [1, 3]``, ``ranks 1, 3``, ``rank(s) [2]``; ``loose``: also
    ``from 3``, ``of 3``, ``at 3`` (the P2P path's flag descriptions: ``partial 0.1 from 3``). The group's own
    description (``group 'x' (ranks [0, 1, 2, 3])``), which lists every rank, is left out first."""
    text = message
    if group_description:
        text = text.replace(group_description, " ")
    named: set[int] = set()
    for match in _RANK_LIST.finditer(text):
        named.update(int(x) for x in re.findall(r"\d+", match.group(1)))
    for match in _RANK_ONE.finditer(text):
        named.update(int(x) for x in re.findall(r"\d+", match.group(1)))
    if loose:
        named.update(int(match.group(1)) for match in _FROM_RANK.finditer(text))
    return named


def names_absent(message: str, absent: int, group_description: str | None = None, loose: bool = False) -> bool:
    return absent in ranks_named(message, group_description, loose)


def names_group(message: str, group_name: str | None, group_description: str | None) -> bool:
    if group_description and group_description in message:
        return True
    return bool(group_name) and (f"group {group_name!r}" in message or f'group "{group_name}"' in message)


def verdict(scenario: str, op: str, world: int, absent: int, outcomes: dict[int, dict], timeout: float,
            launcher_error: str | None = None) -> dict:
    """The results row of one scenario from every rank's outcome (by rank): a dict with ``status`` (``"raised"``,
    ``"returned"``, ``"reported_error"``, ``"died"``, ``"hung"``) and, for a rank that made the faulty call,
    ``message``, ``seconds``, ``wrong``; ``group``/``group_description`` name the group. ``ok``: every rank but the
    absent one raised an error naming the op, the group and the absent rank within ``timeout + MARGIN`` seconds, and
    no rank returned a tensor from the faulty call."""
    survivors = [r for r in range(world) if r != absent]
    reasons, messages, names = [], {}, {}
    seconds = []
    completed = []
    for rank in survivors:
        out = outcomes.get(rank, {"status": "hung"})
        status = out.get("status")
        if scenario == "dies_in_call" and status == "returned" and out.get("wrong") is False:
            completed.append(rank)  # the call had delivered every byte before the peer died: a right result
            continue
        if status != "raised":
            reasons.append(f"rank {rank}: {status}" + (f" ({out.get('message', '')[:200]})" if out.get("message")
                                                       else ""))
            if out.get("message"):
                messages[rank] = out["message"]
            continue
        message = out.get("message", "")
        messages[rank] = message
        description, group = out.get("group_description"), out.get("group")
        named = {"op": op in message, "group": names_group(message, group, description),
                 "absent rank": names_absent(message, absent, description)}
        missing = [what for what, ok in named.items() if not ok]
        named["absent rank, loosely (from/of/at N)"] = names_absent(message, absent, description, loose=True)
        names[rank] = named
        if missing:
            reasons.append(f"rank {rank}: the error does not name the {', '.join(missing)}")
        took = out.get("seconds")
        if took is not None:
            seconds.append(took)
            if took > timeout + MARGIN:
                reasons.append(f"rank {rank}: raised after {took:.1f} s (> {timeout:g} + {MARGIN:g})")
    faulty = outcomes.get(absent, {"status": "hung"})
    returned = [r for r, out in outcomes.items() if out.get("status") == "returned" and r not in completed]
    if returned:
        reasons.append(f"ranks {returned} returned a tensor from the faulty call"
                       + (" (wrong values)" if any(outcomes[r].get("wrong") for r in returned) else ""))
    if launcher_error:
        reasons.append(f"launcher: {launcher_error}")
    return {"scenario": scenario, "op": op, "W": world, "absent": absent, "ok": not reasons,
            "seconds": round(max(seconds), 2) if seconds else None, "message": messages or None,
            "names": names or None, "why_not": reasons or None,
            "faulty": {k: v for k, v in faulty.items() if k not in ("group", "group_description", "traceback")},
            "completed_before_the_death": completed or None,
            "statuses": {r: outcomes.get(r, {"status": "hung"}).get("status") for r in range(world)}}


# -- a rank --------------------------------------------------------------------------------------------------------


def _tp_sequence(op: str, world: int, rank: int, device):
    call = tc.TpCall(op, "row" if op in tc.FP8_OPS else "bf16", 16 * world + 3 if tc.TP_OPS[op] == "all_reduce"
                     else 5 * world, 80, 256, True, "bf16", False, "given", 1, False, seed=7)
    plan = None if device.type != "cuda" else tc.given_plan(call, world)
    path = "auto" if device.type != "cuda" else "p2p"
    everyone = [tc.operands(call, world, s, 0, device) for s in range(world)]
    want = tc.oracle(call, everyone, rank)[0]
    ops = everyone[rank]
    limit = tc.tolerance(call)

    def run(group):
        out, _ = tc.invoke(call, ops, group, plan, path)
        return out

    def wrong(out) -> bool:
        return not tc.relative_error(out, want) < limit

    return run, wrong


class _Expert:
    """A layer's sequence of expert calls: layout, dispatch, combine, each checked."""

    def __init__(self, world: int, rank: int, device) -> None:
        self.mc = ex.MoeCall("bf16", "bounded", tokens=21, local=2, top_k=2, hidden=64, ffn=32, seed=9)
        self.case = ex.moe_case(self.mc, world, rank, 1, device)
        self.world, self.device = world, device
        self.path = "auto" if device.type != "cuda" else "p2p"
        self.layout = None
        self.h = None

    def step(self, name: str, group):
        import flashoverlap as fo

        mc, case = self.mc, self.case
        if name == "moe_layout":
            self.layout = fo.moe_layout(case.idx, mc.experts(self.world), group, mode=mc.mode,
                                        bound=mc.bound(self.world))
            return None
        if name == "moe_dispatch_gemm":
            self.h = fo.moe_dispatch_gemm(case.xs[0], case.w_up, self.layout, group, path=self.path)
            return self.h
        return fo.moe_gemm_combine(case.acts[0], case.w_down, case.weights, self.layout, group, path=self.path)

    def wrong(self, name: str, out) -> bool:
        if out is None:
            return False
        want = self.case.want_h[0] if name == "moe_dispatch_gemm" else self.case.want_y[0]
        return not tc.relative_error(out, want.float()) < ex.tolerance(self.mc.dtype)


def rank_main(rank: int, world: int, op: str, scenario: str, absent: int, timeout: float, ready_dir: str,
              device_kind: str) -> dict:
    """One rank of one scenario: ``WARMUP_CALLS`` rounds of the op's sequence (checked), then the faulty round.
    Returns this rank's outcome (the absent rank's, where it lives to report one)."""
    from flashoverlap.comm.protocol import describe

    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    info = {"group": group.group_name, "group_description": describe(group)}
    if op in tc.TP_OPS:
        run, wrong = _tp_sequence(op, world, rank, device)
        sequence = [op]

        def call(name):
            return run(group)

        def is_wrong(name, out):
            return wrong(out)
    else:
        layer = _Expert(world, rank, device)
        sequence = list(EXPERT_FAULT_OPS)

        def call(name):
            return layer.step(name, group)

        def is_wrong(name, out):
            return layer.wrong(name, out)
    for round_ in range(WARMUP_CALLS):
        for name in sequence:
            out = call(name)
            if out is not None and is_wrong(name, out):
                raise AssertionError(f"warm-up round {round_}: {name} returned wrong values before any fault")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    Path(ready_dir, f"ready.{rank}").write_text(str(time.time()))
    faulty = rank == absent
    for name in sequence:
        if name != op:
            out = call(name)
            continue
        if faulty:
            if scenario == "skip":
                time.sleep(timeout + AFTER_FAULT + 60)  # never joins (killed once the others have reported)
                return {**info, "status": "skipped"}
            if scenario == "raise":
                raise RuntimeError(f"injected: rank {rank} raises before {op}")
            if scenario == "dies":
                os._exit(3)
            if scenario == "stall":
                time.sleep(timeout + 5)
        start = time.monotonic()
        if faulty and scenario == "dies_in_call":  # the process ends while the call is in flight
            threading.Timer(DIE_AFTER, os._exit, args=(3,)).start()
        try:
            out = call(name)
            if faulty and scenario == "dies_in_call":
                os._exit(3)  # the call returned before the timer: end now, its GPU work queued
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 -- the outcome under test
            return {**info, "status": "raised", "seconds": round(time.monotonic() - start, 3),
                    "message": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-1500:]}
        return {**info, "status": "returned", "seconds": round(time.monotonic() - start, 3),
                "wrong": bool(is_wrong(name, out))}
    return {**info, "status": "returned", "wrong": None}


# -- the launcher --------------------------------------------------------------------------------------------------


def _worker(rank: int, fn, job: tuple, queue, output: str) -> None:
    """A rank that reports once and then ends at once (``os._exit``: no teardown of a group whose peers may be
    gone or stuck), as a program's rank ends after an error."""
    world, init_file, env, args, one_gpu = job
    from flashoverlap.testing import apply_environ

    code = 0
    try:
        apply_environ(env)
        for fd, suffix in ((1, "out"), (2, "err")):
            log = os.open(f"{output}.{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, fd)
            os.close(log)
        if one_gpu:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        dist.barrier()
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 -- reported to the parent
        queue.put((rank, "error", traceback.format_exc()[-3000:]))
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        queue.close()
        queue.join_thread()  # the report is on its way before the process ends
        os._exit(code)


def launch(fn, world: int, args: tuple, env: dict, ready_dir: str, after_ready: float,
           setup: float = SETUP_ALLOWANCE, one_gpu: bool = True,
           wait_for: set[int] | None = None) -> tuple[dict[int, tuple], dict[int, str]]:
    """``fn(rank, world, *args)`` on ``world`` ranks over a gloo group (every rank on GPU 0 where ``one_gpu``),
    each left to report, end or hang on its own: returns ``({rank: (status, payload)}, {rank: its output})`` with
    status ``"ok"`` or ``"error"`` (reported), ``"died"`` (ended without a report; payload its exit code) or
    ``"hung"`` (still running at the deadline, killed). The deadline: ``setup`` seconds from the start, brought
    down to ``after_ready`` seconds after the first ``ready.<rank>`` file appears in ``ready_dir``; or as soon as
    every rank of ``wait_for`` (default: all) has an outcome (the others are killed: ``"hung"``)."""
    from flashoverlap.testing import rank_context

    environ = {**os.environ, **env}
    ctx = rank_context(environ)
    queue = ctx.Queue()
    outcomes: dict[int, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="flashoverlap-faults-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        output = os.path.join(tmp, "rank")
        job = (world, init_file, environ, args, one_gpu)
        procs = [ctx.Process(target=_worker, args=(rank, fn, job, queue, output)) for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + setup
        ready_seen = False
        ended_at: dict[int, float] = {}
        wanted = set(range(world)) if wait_for is None else set(wait_for)
        while not wanted <= set(outcomes):
            try:
                rank, status, payload = queue.get(timeout=0.2)
                outcomes[rank] = (status, payload)
                continue
            except queue_module.Empty:
                pass
            now = time.monotonic()
            if not ready_seen and any(Path(ready_dir).glob("ready.*")):
                ready_seen = True
                deadline = min(deadline, now + after_ready)
            for rank, p in enumerate(procs):
                if rank in outcomes or p.is_alive():
                    continue
                ended_at.setdefault(rank, now)
                if now - ended_at[rank] > 1.0:  # a report sent just before the end had a second to arrive
                    outcomes[rank] = ("died", p.exitcode)
            if now > deadline:
                break
        for rank, p in enumerate(procs):
            if rank not in outcomes:
                outcomes[rank] = ("hung", None)
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        logs = {}
        for rank in range(world):
            parts = []
            for suffix in ("out", "err"):
                try:
                    parts.append(Path(f"{output}.{rank}.{suffix}").read_text(errors="replace"))
                except FileNotFoundError:
                    pass
            logs[rank] = "".join(parts)[-3000:]
    return outcomes, logs


def outcome_of(status: str, payload, absent: int, rank: int, scenario: str) -> dict:
    """A rank's outcome for ``verdict`` from what ``launch`` returned."""
    if status == "ok":
        return payload
    if status == "error":
        if rank == absent and scenario == "raise":
            return {"status": "raised-injected", "message": payload[-300:]}
        return {"status": "reported_error", "message": payload[-1500:]}
    if status == "died":
        return {"status": "died", "exit_code": payload}
    return {"status": "hung"}


def run_scenario(op: str, scenario: str, world: int, timeout: float, device_kind: str = "cuda",
                 absent: int | None = None, setup: float = SETUP_ALLOWANCE) -> dict:
    """One scenario in its own processes (``setup``: seconds they get to reach the faulty call); its results row."""
    absent = world - 2 if absent is None else absent
    env = {"FLASHOVERLAP_DEBUG_TIMEOUT": f"{timeout:g}", "FLASHOVERLAP_NO_CACHE": "1"}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="flashoverlap-ready-") as ready_dir:
        try:
            survivors = set(range(world)) - {absent}
            launched, logs = launch(rank_main, world, (op, scenario, absent, timeout, ready_dir, device_kind), env,
                                    ready_dir, after_ready=timeout + AFTER_FAULT, setup=setup,
                                    one_gpu=device_kind == "cuda",
                                    wait_for=survivors if scenario == "skip" else None)
            error = None
        except Exception as exc:  # noqa: BLE001
            launched, logs, error = {}, {}, f"{type(exc).__name__}: {exc}"
    outcomes = {rank: outcome_of(status, payload, absent, rank, scenario)
                for rank, (status, payload) in launched.items()}
    if scenario == "skip" and outcomes.get(absent, {}).get("status") == "hung":
        outcomes[absent] = {"status": "skipped (never joined; killed once the others had reported)"}
    not_ready = [r for r, (status, payload) in launched.items() if status == "error" and "warm-up" in str(payload)]
    row = verdict(scenario, op, world, absent, outcomes, timeout, error)
    row["wall_s"] = round(time.time() - start, 1)
    row["timeout_s"] = timeout
    if not_ready or any(o.get("status") in ("reported_error", "hung") for o in outcomes.values()):
        row["logs"] = {r: text[-1200:] for r, text in logs.items() if text}
    if not row["ok"]:  # where each error was raised, for the reader
        row["tracebacks"] = {r: o["traceback"] for r, o in outcomes.items() if o.get("traceback")} or None
    return row
