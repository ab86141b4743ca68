"""Fit the grouped-GEMM cost model (``tune/grouped.py``) on measurements: the three ways (ours, ``torch._grouped_mm``,
the per-segment ``torch.mm`` loop) timed on one GPU at the fitting set (``grouped_gemm_ways.py`` says how), then
per way the coefficients that best predict them, written as ``tune/grouped_costs.py`` beside a results file.

Fitting set: the per-rank slices at W = 2 of docs/benchmarks.md's MoE configs, Mixtral-like (4 local experts, H 4096,
F 14336, top-2), Qwen3-30B-A3B-like (64, 2048, 768, top-8) and DeepSeek-V3-like (128, 7168, 2048, top-8), at 2048
and 8192 tokens per rank, balanced and Zipf(1.2) routing, up and down projections (24 samples).

The fit, per way: the roofline's ``tflops`` and ``tbps`` and the padding ``pad_rows`` by a grid search, and for each
grid point ``kernel_us`` and ``tile_us`` (>= 0) by least squares on the relative error of the GPU time; the grid
point of the least squared relative error wins. ``host_us``: the median over the samples of the host time per call.

    PYTHONPATH=src:. python -m benchmarks.diagnostics.grouped_gemm_fit OUT.json [--costs PATH]
    PYTHONPATH=src:. python -m benchmarks.diagnostics.grouped_gemm_fit OUT.json --refit RESULTS.json  # no GPU
    PYTHONPATH=src:. python -m benchmarks.diagnostics.grouped_gemm_fit OUT.json --dry-run  # CPU, tiny, interpreted

``--costs``: where the coefficients module goes (default: the imported package's ``tune/grouped_costs.py``; the
dry run writes none unless given). ``--refit``: fit the rows of an earlier results file instead of measuring; a dry
run's file (its ``meta`` says so) refits only into a ``--costs`` outside the package: its toy CPU figures are no GPU's.
Set ``FLASHOVERLAP_COMMIT`` to the commit of the tree measured (the results file records it).
"""

import argparse
import json
import os
import statistics
import sys
import time

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flashoverlap.tune  # noqa: E402
from benchmarks.diagnostics.grouped_gemm_ways import WAYS, Config, call_of, run_all  # noqa: E402
from benchmarks.diagnostics.results_file import in_path, out_path, require_cuda, results_meta  # noqa: E402
from flashoverlap.cli import non_negative, positive  # noqa: E402
from flashoverlap.tune.grouped import WayCosts, cost_ms, gpu_ms, host_calls, kernels  # noqa: E402

FIT_CONFIGS = [Config(f"{name}-{tokens}", local, hidden, ffn, top_k, tokens)
               for name, local, hidden, ffn, top_k in (("mixtral", 4, 4096, 14336, 2),
                                                       ("qwen3-30b-a3b", 64, 2048, 768, 8),
                                                       ("deepseek-v3", 128, 7168, 2048, 8))
               for tokens in (2048, 8192)]
DRY_CONFIGS = [Config("toy-3", 3, 32, 24, 2, 40), Config("toy-6", 6, 48, 16, 4, 24)]
PADS = (16, 32, 64, 128, 256)
TFLOPS = np.geomspace(100.0, 2000.0, 48)
TBPS = np.geomspace(0.5, 10.0, 40)


def fit_way(way: str, rows: list[dict]) -> tuple[WayCosts, list[float]]:
    """``way``'s coefficients (``way`` by the plan's name) fitted on ``rows``, and each row's relative error of the
    predicted GPU time."""
    name = next(ours for ours, plan in WAYS.items() if plan == way)
    calls = [call_of(row) for row in rows]
    t = np.array([row[f"t_{name}_gpu_ms"] for row in rows])
    best = None
    for pad in PADS:
        per_sample = [kernels(way, call, pad) for call in calls]
        flops = np.array([k[0] for ks in per_sample for k in ks])
        nbytes = np.array([k[1] for ks in per_sample for k in ks])
        starts = np.cumsum([0] + [len(ks) for ks in per_sample[:-1]])
        features = np.array([[len(ks), sum(k[2] for k in ks)] for ks in per_sample], dtype=float)  # kernels, tiles
        roof = np.maximum(flops[None, None, :] / (TFLOPS[:, None, None] * 1e9),
                          nbytes[None, None, :] / (TBPS[None, :, None] * 1e9))  # ms per kernel
        base = np.add.reduceat(roof, starts, axis=2).reshape(-1, len(rows))  # [grid, samples]
        y = (t[None, :] - base) / t[None, :]  # what the linear terms must add, relative
        a = features / t[:, None] * 1e-3  # in us
        for used in ((0, 1), (0,), (1,), ()):
            if used:
                coef = y @ np.linalg.pinv(a[:, used]).T  # [grid, len(used)]
                feasible = (coef >= 0).all(axis=1)
                residual = y - coef @ a[:, used].T
            else:
                coef, feasible, residual = np.zeros((len(y), 0)), np.ones(len(y), bool), y
            score = np.where(feasible, (residual**2).sum(axis=1), np.inf)
            g = int(np.argmin(score))
            if best is None or score[g] < best[0]:
                linear = [0.0, 0.0]
                for slot, value in zip(used, coef[g]):
                    linear[slot] = float(value)
                p, b = divmod(g, len(TBPS))
                best = (score[g], WayCosts(float(TFLOPS[p]), float(TBPS[b]), pad, linear[0], linear[1], 0.0))
    host_us = statistics.median(1e3 * row[f"t_{name}_host_ms"] / host_calls(way, call)
                                for row, call in zip(rows, calls))
    costs = WayCosts(**{**best[1].__dict__, "host_us": host_us})
    errors = [(gpu_ms(way, call, costs) - tt) / tt for call, tt in zip(calls, t)]
    return costs, errors


def costs_module(costs: dict[str, WayCosts], source: str) -> str:
    """``tune/grouped_costs.py``'s text for ``costs``, fitted from ``source``."""
    name, _, rest = source.partition(" (")
    lines = ['"""The grouped-GEMM cost model\'s coefficients (``tune/grouped.py``), one ``WayCosts`` per way.',
             "Written by ``benchmarks/diagnostics/grouped_gemm_fit.py`` from the measurements named in",
             '``FITTED_FROM``: refit, do not edit."""', "",
             f'FITTED_FROM = ("{name} "' if rest else f'FITTED_FROM = "{name}"']
    if rest:
        lines.append(f'               "({rest}")')
    lines.append("COSTS = {")
    for way, c in costs.items():
        indent = " " * (len(way) + 9)  # under the opening brace
        lines.append(f'    "{way}": {{"tflops": {c.tflops:.1f}, "tbps": {c.tbps:.3f}, "pad_rows": {c.pad_rows},')
        lines.append(f'{indent}"kernel_us": {c.kernel_us:.2f}, "tile_us": {c.tile_us:.4f}, '
                     f'"host_us": {c.host_us:.1f}}},')
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=out_path)
    parser.add_argument("--costs", type=out_path, help="where to write the coefficients module")
    parser.add_argument("--refit", type=in_path, help="fit the rows of this results file instead of measuring")
    parser.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU, Triton interpreted")
    parser.add_argument("--iters", type=positive, default=5)
    parser.add_argument("--warmup", type=non_negative, default=1)
    args = parser.parse_args()
    if not (args.dry_run or args.refit):  # a dry run and a refit run on the CPU
        require_cuda("benchmarks.diagnostics.grouped_gemm_fit")
    package_costs = os.path.join(os.path.dirname(flashoverlap.tune.__file__), "grouped_costs.py")
    t0 = time.perf_counter()
    if args.refit:
        with open(args.refit) as f:
            measured = json.load(f)
        if _dry_run(measured.get("meta", {})) and os.path.realpath(args.costs or package_costs) == \
                os.path.realpath(package_costs):
            parser.error(f"--refit {args.refit} holds a dry run's rows (toy shapes timed on the CPU): refitting them "
                         f"would replace the package's {package_costs}; name another file with --costs PATH")
        rows, meta = measured["rows"], {**measured["meta"], "refit_from": args.refit}
    else:
        configs = DRY_CONFIGS if args.dry_run else FIT_CONFIGS
        meta = results_meta(" ".join(["PYTHONPATH=src:. python -m benchmarks.diagnostics.grouped_gemm_fit",
                                      *sys.argv[1:]]), gpus=None if torch.cuda.is_available() else "cpu (dry run)",
                            triton=_triton_version(), configs=[c.__dict__ for c in configs],
                            **({"dry_run": True} if args.dry_run else {}))

        def partial(rows: list[dict]) -> None:  # what a run cut short leaves: rows to --refit
            with open(args.out, "w") as f:
                json.dump({"meta": {**meta, "partial": True}, "rows": rows}, f, indent=1)

        rows = run_all(configs, args.dry_run, iters=args.iters, warmup=args.warmup, each=partial)
    costs, errors = {}, {}
    for way in WAYS.values():
        costs[way], errors[way] = fit_way(way, rows)
        e = np.abs(errors[way])
        print(f"{way:>7}: {costs[way]}  GPU time relative error: rms {np.sqrt((e**2).mean()):.3f}, max {e.max():.3f}",
              flush=True)
    for row in rows:
        call = call_of(row)
        row["predicted_ms"] = {name: cost_ms(way, call, costs[way]) for name, way in WAYS.items()}
        row["predicted_gpu_ms"] = {name: gpu_ms(way, call, costs[way]) for name, way in WAYS.items()}
    measured_in = args.refit or f"benchmarks/results/{os.path.basename(args.out)}"  # refit: the rows' own file
    source = f"{measured_in} (commit {meta.get('commit', 'unknown')}, {str(meta.get('date', ''))[:10]})"
    text = costs_module(costs, source)
    path = args.costs or (None if args.dry_run else package_costs)
    if path:
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", flush=True)
    fit = {way: {**costs[way].__dict__, "rms_rel_err": float(np.sqrt(np.mean(np.square(errors[way])))),
                 "max_rel_err": float(np.max(np.abs(errors[way])))} for way in costs}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "fit": fit, "costs_module": text, "rows": rows}, f, indent=1)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s", flush=True)


def _dry_run(meta: dict) -> bool:
    """Whether a results file's ``meta`` is a dry run's (``dry_run``, or the GPUs named as the dry run's CPU)."""
    return bool(meta.get("dry_run")) or "dry run" in str(meta.get("gpus", ""))


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
