"""Where an eager NCCL-path call's host time goes, fp8 row-wise beside bf16 (issue 41: the eager call's 250 µs target
holds for bf16 but not for every fp8 call): on a one-rank NCCL group, each op at the Llama-3-70B TP = 8 shapes
under its overlapped plan, issued eagerly (``FLASHOVERLAP_REPLAY=0``) with the GPU kept busy ahead; per case the host
time per call and cProfile's top functions by own and by cumulative time.

PYTHONPATH=src python -m benchmarks.diagnostics.nccl_eager_profile [out.json]
"""

from __future__ import annotations

import shlex
import sys

import torch

from benchmarks.diagnostics.results_file import one_gpu_setup, one_rank_nccl_diagnostic, results_meta
from benchmarks.harness.timing import loop_host_us, profiled
from benchmarks.host_bound import LLAMA, _row_scaled

CALLS = 30
SLEEP_CYCLES = 300_000_000  # GPU sleep ahead of the calls: longer than their issue


def main() -> dict:
    import flashoverlap as fo
    from flashoverlap.tune.fp8 import fp8_tiles

    device, sms, gen = one_gpu_setup(replay=False)
    bf16_ops, fp8_ops = fo.ops.GEMM_OPS, fo.ops.SCALED_OPS
    out = {"meta": results_meta("python -m benchmarks.diagnostics.nccl_eager_profile " + shlex.join(sys.argv[1:])),
           "rows": []}
    for name, op, m, n, k in LLAMA:
        for dtype in ("bfloat16", "fp8-row"):
            if dtype == "fp8-row":
                a, sa = _row_scaled(m, k, device, gen)
                w, sw = _row_scaled(n, k, device, gen)
                b, sb = w.t(), sw.reshape(1, n)
                plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, tile=fp8_tiles(m, n, k, "row", op).tile_config(),
                                       allow_sequential=False)

                def call(fn=fp8_ops[op], a=a, b=b, sa=sa, sb=sb, plan=plan):
                    return fn(a, b, sa, sb, path="nccl", plan=plan)
            else:
                a = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
                b = (torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5).t()
                plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False)

                def call(fn=bf16_ops[op], a=a, b=b, plan=plan):
                    return fn(a, b, path="nccl", plan=plan)

            for _ in range(3):
                call()
            row = {"shape": name, "op": op, "dtype": dtype, "M": m, "N": n, "K": k, "groups": plan.num_groups,
                   "gemm": plan.gemm, "host_us": round(loop_host_us(call, CALLS, SLEEP_CYCLES), 1),
                   "profile": profiled(call, CALLS, SLEEP_CYCLES, ("tottime", "cumulative"), 22)}
            print(f"== {name} {op} {dtype}: {row['host_us']} us, {plan.num_groups} groups, {plan.gemm}\n"
                  f"{row['profile']}", flush=True)
            out["rows"].append(row)
    return out


if __name__ == "__main__":
    one_rank_nccl_diagnostic("benchmarks.diagnostics.nccl_eager_profile", main)
