"""Check the grouped-GEMM cost model (``tune/grouped.py``, coefficients ``tune/grouped_costs.py``) on MoE configs it
was not fitted on: the three ways measured on one GPU (``grouped_gemm_ways.py``), the model's choice, and how far
the chosen way is from the best.

Validation set (per-rank slices at W = 2; none in ``grouped_gemm_fit.py``'s fitting set): 8 local experts of H 4096,
F 14336, top-2, 4096 tokens; 16 of H 6144, F 10752, top-4, 4096 tokens (DBRX-like); 32 of H 7168, F 4096, top-6,
4096 tokens; 32 of H 4096, F 1408, top-8, 4096 tokens; 8 of H 5120, F 8192, top-2, 8192 tokens; balanced and
Zipf(1.2) routing, up and down projections (20 rows).

Per row: ``t_ours_ms``, ``t_cublas_ms``, ``t_loop_ms``, each way's cost as the model defines it, the larger of its
GPU time and its host time (both in the row: ``t_*_gpu_ms``, ``t_*_host_ms``); ``best`` and ``best_ms``;
``chosen``, the model's choice given the routing's rows per expert (exact mode: all three ways allowed),
``t_chosen_ms`` and ``ratio = t_chosen_ms / best_ms``; and ``chosen_balanced`` / ``ratio_balanced``, its choice
given the balanced rows of the same total, which is what the runtime passes today (it chooses once per call
signature, before any routing is known). ``summary``: ``within_5pct`` (every row's ratio <= 1.05), the worst ratio,
the same for the balanced choice, and the coefficients' source.

    PYTHONPATH=src:. python -m benchmarks.diagnostics.grouped_gemm_validate OUT.json [--dry-run]

Set ``FLASHOVERLAP_COMMIT`` to the commit of the tree measured (the results file records it).
"""

import argparse
import json
import os
import sys
import time

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402

from benchmarks.diagnostics.grouped_gemm_ways import WAYS, Config, call_of, run_all  # noqa: E402
from benchmarks.diagnostics.results_file import out_path, require_cuda, results_meta  # noqa: E402
from flashoverlap.cli import non_negative, positive  # noqa: E402
from flashoverlap.tune import grouped, grouped_costs  # noqa: E402

VALIDATION_CONFIGS = [
    Config("8x4096x14336-top2", 8, 4096, 14336, 2, 4096),
    Config("16x6144x10752-top4", 16, 6144, 10752, 4, 4096),
    Config("32x7168x4096-top6", 32, 7168, 4096, 6, 4096),
    Config("32x4096x1408-top8", 32, 4096, 1408, 8, 4096),
    Config("8x5120x8192-top2", 8, 5120, 8192, 2, 8192),
]
DRY_CONFIGS = [Config("toy-4", 4, 40, 24, 2, 30), Config("toy-8", 8, 16, 32, 3, 20)]
TARGET = 1.05
OURS = {plan: ours for ours, plan in WAYS.items()}  # the plan's names -> the rows'


def judge(row: dict, capability: tuple[int, int] | None) -> dict:
    """The row with the model's predictions, choices and their ratios to the best measured way added."""
    call = call_of(row)
    measured = {name: row[f"t_{name}_ms"] for name in WAYS}
    best = min(measured, key=measured.get)
    balanced = grouped.GroupedCall.balanced(len(call.rows_per_expert), call.rows, call.k, call.n, call.itemsize,
                                            call.chunks)
    choose = {"chosen": call, "chosen_balanced": balanced}
    out = {**row, "predicted_ms": {name: grouped.cost_ms(way, call, grouped.COSTS[way]) for name, way in WAYS.items()},
           "best": best, "best_ms": measured[best]}
    for key, what in choose.items():
        way = OURS[grouped.choose_grouped_gemm(what, torch.bfloat16, host_counts=True, device_capability=capability)]
        ratio = measured[way] / measured[best]
        suffix = key.removeprefix("chosen")
        out[key] = way
        out[f"t_chosen{suffix}_ms"] = measured[way]
        out[f"ratio{suffix}"] = ratio
    return out


def summary(rows: list[dict]) -> dict:
    """Whether every row's choice is within 5% of the best, and the worst ratios."""
    worst = max(rows, key=lambda r: r["ratio"])
    worst_balanced = max(rows, key=lambda r: r["ratio_balanced"])
    return {"within_5pct": all(r["ratio"] <= TARGET for r in rows),
            "worst_ratio": worst["ratio"], "worst_row": [worst["config"], worst["routing"], worst["proj"]],
            "rows_within_5pct": sum(r["ratio"] <= TARGET for r in rows), "rows": len(rows),
            "within_5pct_balanced": all(r["ratio_balanced"] <= TARGET for r in rows),
            "worst_ratio_balanced": worst_balanced["ratio_balanced"],
            "worst_row_balanced": [worst_balanced["config"], worst_balanced["routing"], worst_balanced["proj"]],
            "rows_within_5pct_balanced": sum(r["ratio_balanced"] <= TARGET for r in rows),
            "costs_fitted_from": grouped_costs.FITTED_FROM}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=out_path)
    parser.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU, Triton interpreted")
    parser.add_argument("--iters", type=positive, default=5)
    parser.add_argument("--warmup", type=non_negative, default=1)
    args = parser.parse_args()
    if not args.dry_run:  # the dry run is the CPU's
        require_cuda("benchmarks.diagnostics.grouped_gemm_validate")
    t0 = time.perf_counter()
    configs = DRY_CONFIGS if args.dry_run else VALIDATION_CONFIGS
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    meta = results_meta(" ".join(["PYTHONPATH=src:. python -m benchmarks.diagnostics.grouped_gemm_validate",
                                  *sys.argv[1:]]), gpus=None if torch.cuda.is_available() else "cpu (dry run)",
                        configs=[c.__dict__ for c in configs], costs=grouped_costs.COSTS,
                        costs_fitted_from=grouped_costs.FITTED_FROM)

    def write(rows: list[dict], partial: bool) -> None:
        with open(args.out, "w") as f:
            json.dump({"meta": {**meta, "partial": partial}, "summary": summary(rows), "rows": rows}, f, indent=1)

    measured = run_all(configs, args.dry_run, iters=args.iters, warmup=args.warmup,
                       each=lambda rows: write([judge(row, capability) for row in rows], True))
    rows = [judge(row, capability) for row in measured]
    for r in rows:
        print(f"{r['config']:>24} {r['routing']:>8} {r['proj']:>4}: best {r['best']} {r['best_ms']:.3f} ms, chosen "
              f"{r['chosen']} x{r['ratio']:.3f}, chosen for balanced rows {r['chosen_balanced']} "
              f"x{r['ratio_balanced']:.3f}; predicted " +
              " ".join(f"{name} {ms:.3f}" for name, ms in r["predicted_ms"].items()), flush=True)
    print(json.dumps(summary(rows)), flush=True)
    write(rows, False)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
