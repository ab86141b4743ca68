"""Ranks sharing one GPU (issue 42): W = 2, 4, 8 processes on one GPU over a gloo group, running the public ops,
layers and styles on the P2P path (peers mapped by CUDA IPC), through the runtime's own set-up.

    PYTHONPATH=src python -m benchmarks.shared_ranks --step mechanics --worlds 2,4,8 --out benchmarks/results
    PYTHONPATH=src python -m benchmarks.shared_ranks --step soak --worlds 2,4,8 --calls 10000
    PYTHONPATH=src python -m benchmarks.shared_ranks --step faults --worlds 4 [--ops ...] [--scenarios ...]
    PYTHONPATH=src python -m benchmarks.shared_ranks --step host --worlds 2,4,8

Steps, each writing (merging into) its results file in ``--out``, named for the GPU (``GPUx1-``: ``h200x1-``,
``h100x1-``, from ``benchmarks/harness/gpu_tag.py``, recorded as ``meta.gpu_tag``; a ``--device cpu`` check's
``cpux1-``; a merge's the GPU its files name, one GPU per merge):

- ``mechanics`` -> ``GPUx1-shared-ranks.json``: rows {W, family, case, op, dtype, mode, calls, wrong, replays,
  replays_wanted, error, ...} (``benchmarks/shared/mechanics.py``); merged by (W, family).
- ``soak`` -> ``GPUx1-soak.json``: rows {W, calls, checked, wrong, errors, hangs, memory_mib, flat, ms_per_call,
  pool, ...} (``benchmarks/shared/soak.py``: calls from a bounded pool, the warm-up a sweep of it); merged by W. One
  W per invocation: ``--worlds 8``.
- ``faults`` -> ``GPUx1-faults.json``: rows {scenario, op, W, ok, seconds, message, ...}
  (``benchmarks/shared/faults.py``), ``FLASHOVERLAP_DEBUG_TIMEOUT=--timeout``; merged by (scenario, op, W).
- ``host`` -> ``GPUx1-host-shared.json`` (``h200x1-host.json`` is an older diagnostic's): rows {W, op, dtype,
  mode, host_us, torch_mm_us, paired_ratio, ...} (``benchmarks/shared/host.py``); merged by (W, op, mode).

``--merge FILE...`` merges results files of one step written by separate device calls into ``--out``'s.

Every step has a hard time budget (``--budget`` seconds, default ``DEFAULT_BUDGET``): the W values share it (a W
that ends early leaves its time to the next), the ranks stop before the next case once their share is spent
(checked collectively), and a spawn that hangs is ended at its share plus a margin; what the ranks finished is kept
(progress files) and the hang recorded. One case's failure is recorded in its row and the run goes on. The results
file is written after each W (faults: after each scenario). ``FLASHOVERLAP_COMMIT`` names the commit in ``meta``.

``--device cpu`` runs the same ranks on gloo CPU ranks (the reference path): a check of the harness itself, not of
the GPU paths. Its files go to a fresh temporary folder unless ``--out`` names one, never to ``benchmarks/results``
(its files are named for the GPU: a CPU check once replaced the committed soak with a row that ran nothing).

The exit status is 0 when every row ran and is right, 1 when any was not run (the budget spent), wrong, or hung. A
``--budget`` too small for any W to start (``MIN_SHARE``; mechanics ``MIN_FAMILY_SHARE``; faults a scenario's set-up,
fault timeout and wait) is refused before anything runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path("benchmarks/results")  # the committed GPU results (relative to the repository root, the working folder)
STEPS = {"mechanics": "shared-ranks.json", "soak": "soak.json", "faults": "faults.json", "host": "host-shared.json"}
# What identifies a row within its file: a later run's row replaces an earlier one with the same key.
KEYS = {
    "mechanics": lambda r: (r.get("W"), r.get("family")),
    "soak": lambda r: r.get("W"),
    "faults": lambda r: (r.get("scenario"), r.get("op"), r.get("W")),
    "host": lambda r: (r.get("W"), r.get("op"), r.get("mode")),
}
DEFAULT_BUDGET = {"mechanics": 450.0, "soak": 450.0, "faults": 450.0, "host": 300.0}
SPAWN_MARGIN = 30.0  # seconds a W's spawn may run past its share (start-up, wrap-up) before it counts as hung
WRAP_UP = 40.0  # seconds of a long soak's share kept for the ranks' wrap-up after their deadline
MIN_SHARE = 45.0  # seconds: a W's share below this is not started (soak, host)
MIN_FAMILY_SHARE = 20.0  # mechanics: a family's share below this is not started


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 2 or v > 8 for v in values):
        raise argparse.ArgumentTypeError(f"world sizes must lie in 2..8, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# The options only some steps read, and those steps: any other step refuses them.
STEP_OPTIONS = {"calls": ("soak",), "seed": ("soak",), "read_every": ("soak",), "timeout": ("faults",),
                "scenarios": ("faults",),
                "ops": ("faults", "host"), "families": ("mechanics",), "quick": ("mechanics",),
                "resume": ("mechanics",), "rounds": ("host",), "shape": ("host",),
                "graph_waits": ("mechanics", "host")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shared_ranks", description=__doc__.split("\n\n")[0])
    p.add_argument("--step", required=True, choices=sorted(STEPS))
    p.add_argument("--worlds", type=_ints, default=None, help="comma-separated W values (default: 2,4,8; faults 4)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory of the results files (default: {RESULTS}; --device cpu: a new temporary folder)")
    p.add_argument("--calls", type=int, default=10000, help="soak: calls per W (at least)")
    p.add_argument("--budget", type=float, default=None, help="hard time budget of the step, seconds")
    p.add_argument("--timeout", type=float, default=5.0, help="faults: FLASHOVERLAP_DEBUG_TIMEOUT, seconds")
    p.add_argument("--ops", type=_names, default=None, help="faults, host: only these ops (comma-separated)")
    p.add_argument("--scenarios", type=_names, default=None, help="faults: only these scenarios")
    p.add_argument("--families", type=_names, default=None,
                   help="mechanics: tp, moe, moe-fp8 (the P2P expert path in fp8), models (default: all)")
    p.add_argument("--quick", action="store_true", help="mechanics: a small subset (the GPU test's smoke)")
    p.add_argument("--resume", action="store_true",
                   help="mechanics: keep the results file's right rows (each with its commit) and run only the "
                        "cases it lacks or got wrong (a step an earlier budget cut short)")
    p.add_argument("--rounds", type=int, default=40, help="host: timed rounds per op")
    p.add_argument("--graph-waits", choices=("kernel", "memop"), default=None,
                   help="mechanics, host: how the P2P graphs wait on a flag, forced (the library's own: the wait "
                        "kernel)")
    p.add_argument("--shape", type=lambda text: tuple(int(v) for v in text.split(",")), default=None,
                   metavar="M,N,K", help="host: each rank's GEMM (default: benchmarks/shared/host.HOST_SHAPE; "
                                         "another shape's rows belong in another --out, the rows' keys omit it)")
    p.add_argument("--seed", type=int, default=0, help="soak: the random sequence's seed")
    p.add_argument("--read-every", type=int, default=None, metavar="BURSTS",
                   help="soak: bursts whose checks one host synchronisation reads (default: "
                        "benchmarks/shared/soak.READ_EVERY)")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="FILE",
                   help="merge these results files of --step (from separate device calls) into the one in --out, "
                        "later files' rows replacing earlier ones by key; runs nothing")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo CPU ranks and the reference path (checks the harness, not the GPU paths)")
    args = p.parse_args(argv)
    given = [(name, steps) for name, steps in STEP_OPTIONS.items() if getattr(args, name) != p.get_default(name)
             and (args.merge is not None or args.step not in steps)]
    if given:  # an option the step never reads (or --merge, which runs nothing) would be silently ignored
        p.error("; ".join(f"--{name.replace('_', '-')} applies to --step {' or '.join(steps)} when it runs, "
                          f"not to --step {args.step}{' --merge' if args.merge is not None else ''}"
                          for name, steps in given))
    if args.worlds is None:
        args.worlds = [4] if args.step == "faults" else [2, 4, 8]
    if args.budget is None:
        args.budget = DEFAULT_BUDGET[args.step]
    if args.calls < 1 or args.budget <= 0 or args.timeout <= 0 or args.rounds < 1 or (
            args.read_every is not None and args.read_every < 1):
        p.error("--calls, --budget, --timeout, --rounds and --read-every must be positive")
    from benchmarks.shared import faults, mechanics

    if args.merge is None:  # a W left unrun gets its share to the next: the last W may have the whole budget
        least, what = {"soak": (MIN_SHARE, "MIN_SHARE"), "host": (MIN_SHARE, "MIN_SHARE"),
                       "mechanics": (MIN_FAMILY_SHARE, "MIN_FAMILY_SHARE"),
                       "faults": (15.0 + args.timeout + faults.AFTER_FAULT,
                                  "a scenario's 15 s set-up + --timeout + faults.AFTER_FAULT")}[args.step]
        if args.budget < least:
            p.error(f"--budget {args.budget:g} s is too small for --step {args.step} to run any W: it needs at least "
                    f"{least:g} s ({what})")
    if args.device == "cpu" and args.merge is None:  # its --out default, a new temporary folder, is made by main
        if args.out is not None and _is_committed_results(args.out):
            p.error(f"--out {args.out}: --device cpu checks the harness; its rows are no GPU's figures and never "
                    f"belong in {RESULTS} (the GPUs' files): name another folder, or leave --out out (a "
                    "temporary folder)")
    elif args.out is None:
        args.out = RESULTS
    from benchmarks.shared.calls import TP_OPS

    known = {"faults": faults.FAULT_OPS, "host": tuple(TP_OPS)}.get(args.step)
    if args.ops is not None:
        unknown = [op for op in args.ops if known is None or op not in known]
        if unknown:
            p.error(f"--ops: unknown for --step {args.step}: {unknown} (known: {list(known or [])})")
    if args.scenarios is not None and set(args.scenarios) - set(faults.SCENARIOS):
        p.error(f"--scenarios: unknown {sorted(set(args.scenarios) - set(faults.SCENARIOS))} "
                f"(known: {list(faults.SCENARIOS)})")
    if args.step == "host" and args.device == "cpu":
        p.error("--step host times CUDA calls: it has no --device cpu")
    families = tuple(FAMILY_WEIGHTS)
    if args.families is not None and set(args.families) - set(families):
        p.error(f"--families: unknown {sorted(set(args.families) - set(families))} (known: {list(families)})")
    chosen = args.families or families
    if args.step == "mechanics" and all(mechanics.case_count(w, args.device, args.quick, f) == 0
                                        for f in chosen for w in args.worlds):  # it would run nothing
        p.error(f"--families: {', '.join(chosen)} has no case at W = {args.worlds}"
                + (" under --quick (the models family runs in full runs only)" if args.quick else ""))
    del mechanics
    return args


def results_path(args) -> Path:
    """The step's results file in ``--out``: ``<gpu>x1-<STEPS[step]>`` (``args.gpu``, set by ``main``)."""
    return args.out / f"{args.gpu}x1-{STEPS[args.step]}"


def source_tag(data: object) -> str | None:
    """The GPU tag of a results file's rows (``meta.gpu_tag``; in files written before it, ``cpu`` for a ``--device
    cpu`` check, else the tag of ``meta.gpus``' device name), or None where the file names none."""
    from benchmarks.harness.gpu_tag import model_tag

    info = data.get("meta") if isinstance(data, dict) else None
    if not isinstance(info, dict):
        return None
    if isinstance(info.get("gpu_tag"), str) and info["gpu_tag"]:
        return info["gpu_tag"]
    if info.get("device") == "cpu":
        return "cpu"
    gpus = info.get("gpus")
    if not isinstance(gpus, str) or not gpus:
        return None
    name = gpus.split(" shared by ")[0]  # meta(): "1x <device name> shared by W processes ..."
    return model_tag(name[3:] if name.startswith("1x ") else name)


def _is_committed_results(folder: Path) -> bool:
    """Whether ``folder`` is the committed results folder: the working folder's ``benchmarks/results`` (the default)
    or this checkout's."""
    here = Path(__file__).resolve().parent / "results"
    return folder.resolve() in (RESULTS.resolve(), here)


def command_line(argv: list[str]) -> str:
    return "PYTHONPATH=src python -m benchmarks.shared_ranks " + " ".join(shlex.quote(a) for a in argv)


class Budget:
    """The step's hard budget, shared by its W values."""

    def __init__(self, seconds: float) -> None:
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()

    def share(self, remaining_items: int) -> float:
        return max(0.0, self.left()) / max(1, remaining_items)


def _say(text: str) -> None:
    print(f"[shared_ranks {time.strftime('%H:%M:%S')}] {text}", flush=True)


def _write(args, rows: list[dict], key, **extra) -> None:
    from benchmarks.shared.runs import meta, write_results

    path = results_path(args)
    write_results(path, meta(args.step, args.worlds, args.command, device=args.device, gpu_tag=args.gpu, **extra),
                  rows, key)


# -- steps -----------------------------------------------------------------------------------------------------------


# shares of a W's time (what one leaves, the next gets); the keys are the families, in the order they run
FAMILY_WEIGHTS = {"tp": 0.55, "moe": 0.15, "moe-fp8": 0.1, "models": 0.2}


def run_mechanics(args) -> list[dict]:
    from benchmarks.shared import mechanics
    from benchmarks.shared.runs import progress_path, spawn_ranks

    budget = Budget(args.budget)
    families = tuple(args.families or FAMILY_WEIGHTS)
    progress_dir = tempfile.mkdtemp(prefix="shared-ranks-progress-")
    all_rows = []
    earlier = mechanics.right_rows(results_path(args)) if args.resume else {}
    for i, world in enumerate(args.worlds):
        world_end = time.time() + budget.share(len(args.worlds) - i)
        rows = []
        # the families with cases left to run (all of them, unless --resume kept every case of some)
        left = [f for f in families
                if len(earlier.get((world, f), [])) < mechanics.case_count(world, args.device, args.quick, f)]
        for family in families:  # one spawn per family: a hang in one leaves the others' rows
            kept = earlier.get((world, family), [])
            if family not in left:
                rows += kept
                continue
            weights = [FAMILY_WEIGHTS[f] for f in left[left.index(family):]]
            room = max(0.0, world_end - time.time())
            # A family's weighted share may fall short of the least a spawn is given while the W still has that
            # much: it gets the least (what it leaves goes on to the next family). Before, at --budget 105 over
            # W = 2, 4, 8, the expert families' weighted shares (12 s) skipped them at W = 2 and 4 every time.
            share = max(room * weights[0] / sum(weights), min(MIN_FAMILY_SHARE, room))
            if share < MIN_FAMILY_SHARE:
                got = [{"case": "(budget)", "error": f"budget spent: W = {world} {family} not run"}]
                failure = None
            else:
                options = {"deadline": time.time() + share * 0.85, "device": args.device, "quick": args.quick,
                           "families": (family,), "skip": [[row["case"], row["mode"]] for row in kept],
                           "graph_waits": args.graph_waits}
                paths = [progress_path(progress_dir, f"mechanics-{family}", world, r) for r in range(world)]
                _say(f"mechanics W={world} {family}: share {share:.0f} s")
                results, failure = spawn_ranks(mechanics.spawned, world, (options, [str(p) for p in paths]),
                                               share + SPAWN_MARGIN, args.device)
                got = (mechanics.aggregate(results, world) if results is not None
                       else mechanics.rows_from_progress(paths, world, failure))
            for row in got:
                row["W"], row["family"] = world, family
            rows += kept + got
            _report_mechanics(world, family, got, failure)
        all_rows += rows
        _write(args, rows, key=KEYS["mechanics"])
    return all_rows


def _report_mechanics(world: int, family: str, rows: list[dict], failure: str | None) -> None:
    bad = [r for r in rows if r.get("wrong") or r.get("error")]
    short_replay = [r for r in rows if r.get("replays_wanted") is not None and r.get("replays") is not None
                    and r["replays"] < r["replays_wanted"]]
    over_replay = [r for r in rows if r.get("replays_wanted") == 0 and (r.get("replays") or 0) > 0]
    _say(f"mechanics W={world} {family}: {len(rows)} rows, {sum(r.get('wrong') or 0 for r in rows)} wrong values, "
         f"{sum(1 for r in rows if r.get('error'))} errors, {len(short_replay)} cases short of replays, "
         f"{len(over_replay)} replayed where none should" + (f"; spawn: {failure[:300]}" if failure else ""))
    for r in bad[:12]:
        _say(f"  {r.get('case')} {r.get('mode')}: wrong={r.get('wrong')} error={str(r.get('error'))[:400]}")


def run_soak(args) -> list[dict]:
    from benchmarks.shared import soak
    from benchmarks.shared.runs import Progress, progress_path, spawn_ranks

    budget = Budget(args.budget)
    progress_dir = tempfile.mkdtemp(prefix="shared-ranks-progress-")
    all_rows = []
    for i, world in enumerate(args.worlds):
        share = budget.share(len(args.worlds) - i)
        if share < MIN_SHARE:
            row = {"W": world, "calls": 0, "wrong": 0, "hangs": 0, "memory_mib": [], "flat": None,
                   "error": f"budget spent: W = {world} not run"}
        else:
            # the ranks stop issuing bursts at the deadline; the rest of the share is their wrap-up (at most a
            # check's worth of bursts, the last samples, the exit): 15 %, never more than WRAP_UP seconds
            deadline = time.time() + max(share * 0.85, share - WRAP_UP)
            options = {"deadline": deadline, "device": args.device, "calls": args.calls,
                       "seed": args.seed,
                       "read_every": soak.READ_EVERY if args.read_every is None else args.read_every}
            paths = [progress_path(progress_dir, "soak", world, r) for r in range(world)]
            _say(f"soak W={world}: {args.calls} calls, share {share:.0f} s")
            results, failure = spawn_ranks(soak.spawned, world, (options, [str(p) for p in paths]),
                                           share + SPAWN_MARGIN, args.device)
            if results is not None:
                row = soak.summarise(world, results)
            else:
                last = []
                for path in paths:
                    reports = [r["report"] for r in Progress.read(path) if r.get("report")]
                    last.append(reports[-1] if reports else None)
                row = soak.summarise(world, last, hung=failure)
            row["target_calls"] = args.calls
            row["read_every"] = options["read_every"]
        all_rows.append(row)
        _say(f"soak W={world}: {row['calls']} calls, wrong {row['wrong']}, errors {row.get('errors')}, hangs "
             f"{row['hangs']}, memory {row['memory_mib']} MiB, flat {row['flat']}, {row.get('ms_per_call')} ms/call"
             + (f", stopped: {row['stopped']}" if row.get("stopped") else "")
             + (f", hang: {str(row.get('hang'))[:300]}" if row.get("hang") else ""))
        for note in (row.get("notes") or [])[:8]:
            _say(f"  {note[:400]}")
        _write(args, [row], key=KEYS["soak"], seed=args.seed)
    return all_rows


def run_faults(args) -> list[dict]:
    from benchmarks.shared import faults

    budget = Budget(args.budget)
    ops = args.ops or list(faults.FAULT_OPS)
    scenarios = args.scenarios or list(faults.SCENARIOS)
    rows = []
    for world in args.worlds:
        for op in ops:
            for scenario in scenarios:
                # set-up allowance: normally seconds; never more than the budget leaves after the fault's own time
                setup = min(faults.SETUP_ALLOWANCE, budget.left() - args.timeout - faults.AFTER_FAULT)
                if setup < 15.0:
                    row = {"scenario": scenario, "op": op, "W": world, "ok": None, "seconds": None,
                           "message": None, "error": "budget spent: not run"}
                else:
                    row = faults.run_scenario(op, scenario, world, args.timeout, args.device, setup=setup)
                rows.append(row)
                verdict = "OK" if row.get("ok") else ("not run" if row.get("ok") is None else "NOT OK")
                _say(f"faults W={world} {op} {scenario}: {verdict} seconds={row.get('seconds')} "
                     f"wall={row.get('wall_s')} statuses={row.get('statuses')}")
                if row.get("ok") is False:
                    for why in (row.get("why_not") or [])[:4]:
                        _say(f"  {why[:400]}")
                    for rank, message in (row.get("message") or {}).items():
                        _say(f"  rank {rank} said: {message[:400]}")
                _write(args, [row], key=KEYS["faults"],
                       debug_timeout_s=args.timeout)
    return rows


def run_host(args) -> list[dict]:
    from benchmarks.shared import host
    from benchmarks.shared.runs import spawn_ranks

    budget = Budget(args.budget)
    all_rows = []
    for i, world in enumerate(args.worlds):
        share = budget.share(len(args.worlds) - i)
        if share < MIN_SHARE:
            rows = [{"W": world, "op": None, "mode": None, "error": f"budget spent: W = {world} not run"}]
        else:
            options = {"deadline": time.time() + share * 0.8, "device": args.device, "ops": args.ops,
                       "rounds": args.rounds, "shape": args.shape or host.HOST_SHAPE, "graph_waits": args.graph_waits}
            _say(f"host W={world}: share {share:.0f} s")
            results, failure = spawn_ranks(host.rank_main, world, (options,), share + SPAWN_MARGIN, args.device)
            rows = (host.aggregate(results, world) if results is not None
                    else [{"W": world, "op": None, "mode": None, "error": f"spawn failed or hung: {failure}"}])
        for row in rows:
            error = f" ERROR {row['error'][:300]}" if row.get("error") else ""
            _say(f"host W={world} {row.get('op')} {row.get('mode')}: {row.get('host_us')} us vs torch.mm "
                 f"{row.get('torch_mm_us')} us (paired ratio {row.get('paired_ratio')}, target "
                 f"{row.get('target_ratio')}, replay share {row.get('replay_share')}){error}")
        all_rows += rows
        _write(args, rows, key=KEYS["host"], shape=list(args.shape or host.HOST_SHAPE))
    return all_rows


RUNNERS = {"mechanics": run_mechanics, "soak": run_soak, "faults": run_faults, "host": run_host}


def merge(args) -> int:
    """``--merge``: the rows of each file, in order, into ``--out``'s file of the step (by ``KEYS``)."""
    import json

    from benchmarks.shared.runs import write_results

    loaded, tags = [], {}
    for source in args.merge:  # every file checked before any is merged: a refused merge leaves --out's file alone
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as error:
            print(f"benchmarks.shared_ranks: --merge {source}: {error}", file=sys.stderr)
            return 2
        step = data.get("meta", {}).get("step") if isinstance(data, dict) else None
        if step != args.step:
            print(f"benchmarks.shared_ranks: --merge {source} holds rows of step {step!r}, not --step {args.step} "
                  f"(its rows would land in {STEPS[args.step]})", file=sys.stderr)
            return 2
        tags.setdefault(source_tag(data), []).append(source)
        loaded.append((source, data))
    named = {tag: sources for tag, sources in tags.items() if tag is not None}
    if len(named) > 1:
        print("benchmarks.shared_ranks: --merge: the files are of different GPUs ("
              + "; ".join(f"{tag}: {', '.join(map(str, sources))}" for tag, sources in named.items())
              + "): merge each GPU's files into its own file", file=sys.stderr)
        return 2
    args.gpu = next(iter(named), "h200")  # files before the tag named no GPU: the H200's, the only one then
    if args.gpu == "cpu" and _is_committed_results(args.out):
        print(f"benchmarks.shared_ranks: --merge: the files are --device cpu checks; their rows are no GPU's figures "
              f"and never belong in {RESULTS}: name another --out", file=sys.stderr)
        return 2
    path = results_path(args)
    for source, data in loaded:
        write_results(path, data.get("meta", {}), data.get("rows", []), KEYS[args.step])
        _say(f"merged {len(data.get('rows', []))} rows of {source} into {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.command = command_line(argv)
    if args.merge:
        return merge(args)  # the GPU the files name: args.gpu
    args.gpu = "cpu"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("benchmarks.shared_ranks: needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu "
                  "checks the harness on gloo CPU ranks", file=sys.stderr)
            return 1
        from benchmarks.harness.gpu_tag import gpu_tag

        args.gpu = gpu_tag()
    if args.out is None:  # --device cpu: a harness check's files are read once, never committed
        args.out = Path(tempfile.mkdtemp(prefix=f"shared-ranks-cpu-{args.step}-"))
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    _say(f"step {args.step} at W = {args.worlds}, budget {args.budget:.0f} s -> {results_path(args)}")
    rows = RUNNERS[args.step](args)
    _say(f"step {args.step} done in {time.time() - start:.0f} s: {len(rows)} rows in {results_path(args)}")
    failed = [row for row in rows if _failed(row)]
    if failed:
        print(f"benchmarks.shared_ranks: step {args.step}: {len(failed)} of {len(rows)} rows not run, wrong or hung "
              f"(their 'error', 'wrong', 'hangs' or 'ok' say which)", file=sys.stderr)
        return 1
    return 0


def _failed(row: dict) -> bool:
    """Whether a row of any step was not run (the budget spent: its ``error``), raised, was wrong or hung."""
    return bool(row.get("error") or row.get("wrong") or row.get("errors") or row.get("hangs")
                or row.get("hang_or_crash") or ("ok" in row and row["ok"] is not True))


if __name__ == "__main__":
    sys.exit(main())
