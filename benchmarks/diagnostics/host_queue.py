"""Is an eager call's host time its own, or the launch queue's back-pressure? The NCCL path's eager host time per
call in a loop of L calls back to back (no synchronisation inside the loop; the GPU idle and synchronised before
each loop), for L = 1, 2, 5, 10, 25, 50, beside ``torch.mm`` / ``torch._scaled_mm``. Where the GPU takes longer
per call than the host, the launch queue fills during a long loop and the host then waits on the GPU: the host time
per call grows with L. A call issued alone (L = 1) is the eager call's own host cost.

Run (one GPU, a one-rank NCCL group; rows {shape, op, dtype, path, loop, host_us}):

    PYTHONPATH=src python -m benchmarks.diagnostics.host_queue [out.json]
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time

import torch
import torch.distributed as dist

LOOPS = (1, 2, 5, 10, 25, 50)
ROUNDS = 9
# The Llama-3-70B TP = 8 rows whose eager host time was over 250 us in the host-bound loop (issue 41), and o,
# which shares down's plan: (shape, op, M, N, K, dtype).
CASES = [("down", "reduce_scatter", 8192, 8192, 3584, "bfloat16"),
         ("o", "reduce_scatter", 8192, 8192, 1024, "bfloat16"),
         ("q,k,v", "all_gather", 8192, 1280, 8192, "fp8-row"), ("up", "all_gather", 8192, 7168, 8192, "fp8-row"),
         ("up", "all_gather", 8192, 7168, 8192, "bfloat16")]


def per_call(fn, loop: int) -> float:
    """The median over rounds of the host time per call of ``loop`` calls issued back to back, in us."""
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(loop):
            fn()
        times.append((time.perf_counter() - t0) / loop)
    torch.cuda.synchronize()
    return 1e6 * sorted(times)[len(times) // 2]


def main() -> None:
    import os

    import flashoverlap as fo
    from benchmarks.diagnostics.results_file import require_cuda, results_meta
    from benchmarks.host_bound import _row_scaled
    from flashoverlap import settings
    from flashoverlap.tune.fp8 import fp8_tiles

    require_cuda("benchmarks.diagnostics.host_queue", path_only=True)
    out = sys.argv[1] if len(sys.argv) > 1 else None
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ["FLASHOVERLAP_REPLAY"] = "0"
    settings.refresh()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1, device_id=device)
        try:
            for name, op, m, n, k, dtype in CASES:
                if dtype == "fp8-row":
                    a, sa = _row_scaled(m, k, device, gen)
                    w, sw = _row_scaled(n, k, device, gen)
                    b, sb = w.t(), sw.reshape(1, n)
                    tile = fp8_tiles(m, n, k, "row", op).tile_config()
                    plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, tile=tile, allow_sequential=False)
                    def ours(a=a, b=b, sa=sa, sb=sb, plan=plan, fn=fo.ops.SCALED_OPS[op]):
                        return fn(a, b, sa, sb, path="nccl", plan=plan)

                    def alone(a=a, b=b, sa=sa, sb=sb):
                        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
                else:
                    a = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
                    b = (torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5).t()
                    plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False)
                    def ours(a=a, b=b, plan=plan, fn=fo.ops.GEMM_OPS[op]):
                        return fn(a, b, path="nccl", plan=plan)

                    def alone(a=a, b=b):
                        return torch.mm(a, b)
                for fn in (ours, alone):
                    for _ in range(3):
                        fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    ours()
                end.record()
                torch.cuda.synchronize()
                gpu_us = 1e3 * start.elapsed_time(end) / 10
                for loop in LOOPS:
                    for path, fn in (("nccl", ours), ("alone", alone)):
                        row = {"shape": name, "op": op, "dtype": dtype, "path": path, "loop": loop,
                               "host_us": round(per_call(fn, loop), 1), "groups": plan.num_groups,
                               "ours_loop10_us": round(gpu_us, 1)}
                        print(row, flush=True)
                        rows.append(row)
        finally:
            dist.destroy_process_group()
    if out:
        meta = results_meta("PYTHONPATH=src python -m benchmarks.diagnostics.host_queue " + shlex.join(sys.argv[1:]),
                            gpus=f"1x {torch.cuda.get_device_name(device)}", loops=LOOPS, rounds=ROUNDS)
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
