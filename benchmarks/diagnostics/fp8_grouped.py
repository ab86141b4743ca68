"""The fp8 grouped GEMM of the expert paths, three ways, beside bf16 ``torch._grouped_mm``, on one GPU (issue 44).

    PYTHONPATH=src python -m benchmarks.diagnostics.fp8_grouped --out benchmarks/results

writes ``<out>/GPUx1-fp8-grouped.json`` (``h200x1-``, ``h100x1-``: ``benchmarks/harness/gpu_tag.py``)
(docs/benchmarks.md, "fp8 experts"): rows {config, routing, proj, scaling, experts, rows, K, N, kernel, t_ours_ms,
t_scaled_grouped_mm_ms, t_loop_ms, t_bf16_grouped_mm_ms, chosen, t_chosen_ms, best, chosen_over_best, err_*} and
``meta`` (commit, command, torch, GPU). A sample is one rank's slice at W = 2 of an MoE config (issue 44's table, plus
two configs the starting rule was not written from: ``fit`` / ``validate``), balanced or Zipf(1.2) routing
(``grouped_gemm_ways.rows_per_expert``), rows in ``CHUNKS`` chunks as the paths run them. The ways go through the
library's own code (``comm/expert/scaled.scaled_multiply``, chunk by chunk): ``ours``
(``kernels/grouped_gemm.scaled_grouped_gemm``: the fp8 Triton kernel, or block-wise on Hopper the Gluon kernel where
it applies; the row's ``kernel`` says which ran), ``scaled_grouped_mm`` (``torch._scaled_grouped_mm``, row-wise only)
and ``loop`` (a ``torch._scaled_mm`` per segment); bf16 ``torch._grouped_mm`` on the same rows per chunk. Each way:
the median of CUDA-event times over ``--iters`` calls after a warm-up, its output checked against the loop's
(``err_<way>``: max relative difference; a way off by more than 5e-2 is marked wrong and not taken as best).
``chosen``: what ``tune/grouped_fp8.expert_gemm_fp8`` picks for the sample (exact mode). A failure in one sample or
way is recorded in the row (``error_<way>``) and the run goes on; the file is rewritten after every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.diagnostics.grouped_gemm_ways import rows_per_expert
from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.gpu_tag import gpu_tag
from flashoverlap.cli import names_of
from flashoverlap.comm.expert.scaled import ExpertScales, scaled_multiply
from flashoverlap.kernels import grouped_gemm
from flashoverlap.tune.grouped import GroupedCall
from flashoverlap.tune.grouped_fp8 import expert_gemm_fp8

CHUNKS = 2
FP8 = torch.float8_e4m3fn
# (name, local experts, K, N, rows, set): issue 44's table (fit) and two it was not written from (validate).
CONFIGS = [
    ("gpt-oss-120b-up", 64, 2880, 5760, 32768, "fit"),
    ("qwen2-57b-up", 32, 3584, 5120, 32768, "fit"),
    ("deepseek-v3-up", 32, 7168, 4096, 16384, "fit"),
    ("mixtral-8x22b-up", 4, 6144, 32768, 16384, "fit"),
    ("qwen3-30b-a3b-up", 64, 2048, 1536, 32768, "fit"),
    ("qwen3-30b-a3b-down", 64, 768, 2048, 32768, "fit"),
    ("deepseek-v3-down", 32, 2048, 7168, 16384, "validate"),
    ("qwen3-235b-a22b-up", 64, 4096, 3072, 16384, "validate"),
]
# ``--only``: names of CONFIGS (a misspelt one ran nothing and exited 0).
config_names = names_of(tuple(row[0] for row in CONFIGS), "config")
WAYS = {"ours": "triton", "scaled_grouped_mm": "cublas", "loop": "loop"}


def commit() -> str:
    env = os.environ.get("FLASHOVERLAP_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def gluon_launches() -> int:
    """Launches of the Gluon block-wise kernel so far (``kernels/block_scaled.py``): which kernel ``ours`` ran is
    recorded from it, per row (``kernel``: gluon or triton)."""
    return grouped_gemm.launches()["block_scaled"]


def timed(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # the GPU never waits for the host
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sample(name, local, k, n, rows, routing, scaling, iters, seed=0):
    per_expert = rows_per_expert(rows, local, routing, seed)
    call = GroupedCall(per_expert, k, n, 1, CHUNKS)
    chunks = call.segments()  # rows per (chunk, expert)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    x = torch.randn(rows, k, device=dev, generator=gen)
    amax = x.abs().amax(1, keepdim=True) if scaling == "row" else \
        x.view(rows, k // 128, 128).abs().amax(2)
    x_scale = (amax / 448).clamp_min(1e-12).float()
    xq = (x.view(rows, -1, 128 if scaling == "block" else k) /
          x_scale.view(rows, -1, 1)).view(rows, k).to(FP8)
    del x
    w = torch.randn(local, n, k, device=dev, generator=gen).div_(k ** 0.5)
    wq = w.to(FP8).transpose(1, 2)  # [L, K, N] view of nn.Linear-shaped storage
    w_bf16 = w.to(torch.bfloat16).transpose(1, 2)
    del w
    w_scale = (torch.rand(local, n, device=dev, generator=gen) + 0.5) if scaling == "row" else \
        (torch.rand(local, k // 128, -(-n // 128), device=dev, generator=gen) + 0.5)
    x_bf16 = xq.to(torch.bfloat16)
    starts = []
    at = 0
    for chunk in chunks:
        starts.append(at)
        at += sum(chunk)
    ends = [torch.tensor(list(torch.tensor(c).cumsum(0).tolist()), dtype=torch.int32, device=dev) for c in chunks]
    host_ends = [t.tolist() for t in ends]
    sizes = [sum(c) for c in chunks]
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    row = {"config": name, "routing": routing, "proj": name.rsplit("-", 1)[1], "scaling": scaling, "experts": local,
           "rows": rows, "K": k, "N": n, "chunks": CHUNKS}

    def run_way(kind):
        scales = ExpertScales(scaling, w_scale, x_scale)

        def fn():
            for c in range(CHUNKS):
                s = starts[c]
                scaled_multiply(kind, xq[s : s + sizes[c]], x_scale[s : s + sizes[c]], wq, scales, ends[c],
                                out[s : s + sizes[c]], host_ends[c])
        return fn

    def bf16():
        for c in range(CHUNKS):
            s = starts[c]
            out[s : s + sizes[c]].copy_(torch._grouped_mm(x_bf16[s : s + sizes[c]], w_bf16, offs=ends[c]))

    results = {}
    reference = None
    for way, kind in [("loop", "loop"), ("ours", "triton"), ("scaled_grouped_mm", "cublas")]:
        if way == "scaled_grouped_mm" and scaling != "row":
            row[f"t_{way}_ms"] = None
            continue
        try:
            fn = run_way(kind)
            out.fill_(float("nan"))
            before = gluon_launches()
            fn()
            torch.cuda.synchronize()
            if way == "ours":
                row["kernel"] = "gluon" if gluon_launches() > before else "triton"
            if reference is None:
                reference = out.float().clone()
            scale = 1 + float(reference.abs().max())
            err = float((out.float() - reference).abs().max()) / scale
            row[f"err_{way}"] = err
            row[f"t_{way}_ms"] = timed(fn, iters)
            results[way] = (row[f"t_{way}_ms"], err <= 5e-2)
        except Exception as exc:  # noqa: BLE001 -- the row records it, the run goes on
            row[f"t_{way}_ms"] = None
            row[f"error_{way}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
    try:
        row["t_bf16_grouped_mm_ms"] = timed(bf16, iters)
    except Exception as exc:  # noqa: BLE001
        row["t_bf16_grouped_mm_ms"] = None
        row["error_bf16"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    chosen_kind = expert_gemm_fp8(call, scaling, mode="exact", device_capability=torch.cuda.get_device_capability())[0]
    chosen = {v: k for k, v in WAYS.items()}[chosen_kind]
    row["chosen"] = chosen
    row["t_chosen_ms"] = row.get(f"t_{chosen}_ms")
    good = {way: t for way, (t, ok) in results.items() if ok and t is not None}
    if good:
        best = min(good, key=good.get)
        row["best"] = best
        row["chosen_over_best"] = None if row["t_chosen_ms"] is None else row["t_chosen_ms"] / good[best]
    flops = 2.0 * rows * k * n
    for key in [k_ for k_ in list(row) if k_.startswith("t_") and row[k_]]:
        row["tflops_" + key[2:-3]] = flops / (row[key] * 1e9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--only", type=config_names, default=None, help="comma-separated config names")
    args = parser.parse_args()
    require_cuda("benchmarks.diagnostics.fp8_grouped")
    path = Path(args.out) / f"{gpu_tag()}x1-fp8-grouped.json"  # named for the GPU (h200x1-, h100x1-)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"gpus": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
            "command": "python -m benchmarks.diagnostics.fp8_grouped " + shlex.join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "chunks": CHUNKS}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows = []
    started = time.monotonic()
    for name, local, k, n, count, which in CONFIGS:
        if args.only and name not in args.only:
            continue
        for scaling in ("row", "block"):
            for routing in ("balanced", "zipf"):
                if scaling == "block" and routing == "zipf" and which == "fit" and local < 32:
                    continue
                if scaling == "block" and k % 128:  # refused by every way (ours, torch's): nothing to time
                    row = {"config": name, "routing": routing, "scaling": scaling, "set": which,
                           "skipped": f"block-wise scaling needs K a multiple of 128 (K = {k})"}
                    rows.append(row)
                    print(f"{name} {scaling} {routing}: {row['skipped']}", flush=True)
                    continue
                try:
                    row = sample(name, local, k, n, count, routing, scaling, args.iters)
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    row = {"config": name, "routing": routing, "scaling": scaling, "error": f"{type(exc).__name__}: "
                           f"{str(exc)[:300]}"}
                row["set"] = which
                rows.append(row)
                torch.cuda.empty_cache()
                print(f"[{time.monotonic() - started:6.1f}s] {name} {scaling} {routing}: " + ", ".join(
                    f"{key}={row[key]:.3f}" if isinstance(row.get(key), float) else f"{key}={row.get(key)}"
                    for key in ("t_ours_ms", "t_scaled_grouped_mm_ms", "t_loop_ms", "t_bf16_grouped_mm_ms", "chosen",
                                "best")), flush=True)
                path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
