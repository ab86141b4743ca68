"""Which tile the NCCL path's fp8 signalling GEMM should take under the overlapped plans' launch (issue 35's GEMM
target): at the grid's per-rank GEMMs (W = 2), tensor- and row-wise, each candidate tile under the plan
``default_plan`` gives it (all-reduce and reduce-scatter: one program per tile, since programs that retire let
NCCL's blocks in; all-gather: persistent on the SMs NCCL leaves, every band already arrived), signals included,
against ``torch._scaled_mm`` in the same mode on the whole GPU and, for the all-gather, given the same SMs
(``torch._C._set_sm_carveout_experimental``: docs/benchmarks.md's GEMM at an SM budget).

A diagnostic to choose the policy in ``tune/fp8.py``, not a library figure. Medians of CUDA-event times of 25 calls
after 5 warm-up calls, each queued behind a GPU sleep; fresh random operands and scales, never zeros.

FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src:. python benchmarks/diagnostics/fp8_tile_sweep.py [out.json]
"""

import torch

from benchmarks.diagnostics.fp8_gemm import GRID, WORLD, per_rank, scales, time_ms
from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from flashoverlap.kernels.gemm import GatherWait, Scaling
from flashoverlap.kernels.gemm import gemm as gemm_kernel
from flashoverlap.plan import TileConfig
from flashoverlap.tune.defaults import default_plan

# (block_m, block_n, block_k, group_m, num_stages, num_warps)
TILES = [(128, 256, 128, 8, 3, 8), (128, 256, 128, 8, 4, 8), (128, 128, 128, 8, 3, 4), (128, 128, 128, 8, 4, 4),
         (256, 128, 128, 8, 3, 8), (128, 128, 64, 8, 4, 4)]
GATHER_TILES = TILES[:2]  # the all-gather's question is the SM budget, not the tile
CARVE = getattr(torch._C, "_set_sm_carveout_experimental", None)


def main():
    require_cuda("benchmarks.diagnostics.fp8_tile_sweep", path_only=True)
    rows = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for op, shapes in GRID.items():
        for shape in shapes:
            m, n, k = per_rank(op, *shape)
            a = (torch.randn(m, k, device="cuda") * 3).to(torch.float8_e4m3fn)
            b = (torch.randn(n, k, device="cuda") * 3).to(torch.float8_e4m3fn).t()
            for scaling in ("tensor", "row"):
                sa, sb = scales(scaling, m, n, k)

                def ref(a=a, b=b, sa=sa, sb=sb):
                    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

                t_ref = time_ms(ref)
                want = ref().float()
                row = {"op": op, "scaling": scaling, "M": m, "N": n, "K": k, "t_scaled_mm_ms": t_ref, "tiles": {}}
                budget = None
                for tile in GATHER_TILES if op == "all_gather" else TILES:
                    plan = default_plan(op, m, n, k, WORLD, tile=TileConfig(*tile))
                    spec = Scaling(sa, sb)
                    if op == "all_gather":
                        wait = GatherWait(torch.ones(plan.num_groups, dtype=torch.int32, device="cuda"))

                        def ours(a=a, b=b, plan=plan, spec=spec, wait=wait):
                            return gemm_kernel(a, b, plan, scaling=spec, wait=wait)
                    else:
                        counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")

                        def ours(a=a, b=b, plan=plan, spec=spec, counters=counters):
                            return gemm_kernel(a, b, plan, counters=counters, scaling=spec)
                    try:
                        got = ours().float()
                        t = time_ms(ours)
                    except Exception as exc:  # a tile that does not fit (shared memory): recorded, not fatal
                        row["tiles"][str(tile)] = {"error": str(exc)[:200]}
                        print(op, scaling, m, n, k, tile, "error", str(exc)[:200], flush=True)
                        continue
                    if op == "all_reduce":
                        err = float((got - want).norm() / want.norm())
                        assert err < 1e-2, (op, scaling, tile, err)
                    if op == "all_gather" and budget is None and CARVE is not None:
                        CARVE(num_sms - plan.grid_size)
                        try:
                            budget = time_ms(ref)
                        finally:
                            CARVE(0)
                        row["programs"], row["t_scaled_mm_budget_ms"] = plan.grid_size, budget
                    row["tiles"][str(tile)] = {"t_ms": t, "programs": plan.grid_size, "vs_scaled_mm": t_ref / t,
                                               **({"vs_budget": budget / t} if budget else {})}
                    print(f"{op} {scaling} {m}x{n}x{k} {tile} programs {plan.grid_size}: {t:.3f} ms, "
                          f"{t_ref / t:.3f}x _scaled_mm" + (f", {budget / t:.3f}x at its SMs" if budget else ""),
                          flush=True)
                rows.append(row)
    write_results({"meta": results_meta("FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src:. python "
                                        "benchmarks/diagnostics/fp8_tile_sweep.py <out.json>",
                                        triton=__import__("triton").__version__), "rows": rows})


if __name__ == "__main__":
    main()
