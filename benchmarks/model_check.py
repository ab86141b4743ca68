"""``torchrun --nproc-per-node W -m benchmarks.model_check [--path nccl|p2p|auto] [--ops ...]`` (what ``flashoverlap
tune validate`` was): over docs/benchmarks.md's grid, the tuner's model against measurement. Per shape every
candidate is timed (``VALIDATE_ITERS`` calls each), in the model's order; the model's predicted T against the
measured T of its pick (what ``tune plan`` caches), and the pick against the exhaustive best. Writes
``benchmarks/results/<gpu>x<W>-<setting>-model.json``, rewritten after each shape, so that a run stopped part-way
keeps its finished rows; each row keeps the machine figures and every candidate's plan, prediction and measurement,
so that a later model can be re-checked against the same measurements. Leaves each shape's best measured plan in
the plan cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys

import torch
import torch.distributed as dist

from benchmarks.harness.gpu_tag import gpu_tag
from benchmarks.harness.run import commit, setting, start_run
from flashoverlap.bench import GRIDS
from flashoverlap.cli import DTYPES, OPS, op_list, tune_search, tune_target
from flashoverlap.plan import Plan
from flashoverlap.tune.tuner import choose, summary, tune_plan

# It times every candidate with fewer calls than `tune plan` (it times hundreds per shape).
VALIDATE_ITERS = 6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", default="nccl", choices=["nccl", "p2p", "auto"],
                        help="the communicator (default nccl; auto: both where P2P applies)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="input dtype (default: bfloat16)")
    parser.add_argument("--ops", default=",".join(OPS), type=op_list, help="comma-separated ops (default: all three)")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/...-model.json)")


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


def check_shape(op: str, shape: tuple[int, int, int], target, path: str) -> dict:
    """One shape's row: every candidate timed, the pick against the best, the machine figures and curves."""
    search = tune_search(op, shape, target, path)
    say = print if dist.get_rank() == 0 else (lambda line: None)
    _, every = tune_plan(op, shape, target, search, 0, True, say, VALIDATE_ITERS)
    for record in every:
        record["hand_set"] = Plan.from_dict(record["plan"]) in search.hand_set
    row = model_check_row(op, path, *shape, every)
    row["machines"] = {p: [{"tile": list(dataclasses.astuple(tile)), **machine.to_dict()}
                           for tile, machine in machines.items()] for p, machines in search.machines.items()}
    row["curves"] = {p: curve.to_dict() for p, curve in search.curves.items()}
    row["all"] = [{"plan": _shapeless(r["plan"]), "predicted_ms": r["predicted_ms"], "measured_ms": r["measured_ms"],
                   "hand_set": r["hand_set"]} for r in every]
    return row


def main(argv: list[str] | None = None) -> int:
    args, argv, _, out, device = start_run("python -m benchmarks.model_check", __doc__.split("\n\n")[0],
                                           add_arguments, argv, "-model")
    rank, world = dist.get_rank(), dist.get_world_size()
    name = "p2p" if args.path == "p2p" else setting() + ("-auto" if args.path == "auto" else "")
    gpu = gpu_tag(device)
    out = args.out or os.path.join("benchmarks", "results", f"{gpu}x{world}-{name}-model.json")
    command = os.environ.get("FLASHOVERLAP_COMMAND", "python -m benchmarks.model_check " + shlex.join(argv))
    target = tune_target(args.dtype, device)
    rows, meta = [], {}
    for op in args.ops.split(","):
        for m, n, k in GRIDS[op]:
            row = check_shape(op, (m, n, k), target, args.path)
            rows.append(row)
            if rank != 0:
                continue
            error = abs(row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
            print(f"{op:>15} {m:6d}x{n:6d}x{k:6d}: predicted {row['predicted_ms']:.3f} measured "
                  f"{row['measured_ms']:.3f} ({100 * error:.1f}%), pick {row['model_pick_ms']:.3f} "
                  f"({row['model_pick_plan']}) vs best {row['exhaustive_best_ms']:.3f} "
                  f"({row['exhaustive_best_plan']}), {len(row['all'])} candidates", flush=True)
            meta = {"gpus": f"{world}x {torch.cuda.get_device_name(device)}",
                    "setting": "p2p" if args.path == "p2p" else setting(), "commit": commit(), "command": command,
                    **model_check_summary(rows)}
            write_rows(out, meta, rows)
    if rank == 0 and rows:
        print(f"model error: mean {100 * meta['mean_error']:.1f}%, max {100 * meta['max_error']:.1f}%; pick within "
              f"3% of the best at {meta['picks_within_3pct']} of {len(rows)} shapes; wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
