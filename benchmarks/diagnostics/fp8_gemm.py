"""The fp8 GEMM as each path runs it, on one GPU, at the grid's per-rank GEMMs (W = 2), in every scaling mode:

- ``nccl``: the GEMM of the NCCL path's default fp8 plan (``tune/fp8.fp8_plan``, no rates: the overlapped plan of
  a GEMM-bound call): tensor- and row-wise the signalling Triton GEMM (``kernels/gemm.py`` with ``Scaling``), signals
  included, in the plan's groups, tile order and program count (the all-gather's in-kernel waits, every band already
  arrived); block-wise the plan's cuBLAS bands of torch's block-wise scaled matmul (each band's A scales laid out as
  torch wants them, timed), or the Triton GEMM where torch's kernel does not serve the shape;
- ``nccl-triton`` (block-wise only): the signalling Triton GEMM on the same plan but ``gemm="triton"``, for the
  record of what our block-wise kernel reaches;
- ``p2p``: ``torch._scaled_mm`` on the P2P ring's sub-bands, two per half of the rows (four multiplications, each
  with its own scales laid out as ``_scaled_mm`` wants them);

each beside ``torch._scaled_mm`` in the same mode on the whole GEMM and bf16 ``torch.mm`` of the same shape; where the
plan's GEMM runs on fewer programs than the GPU has SMs (the all-gather's, persistent on the SMs NCCL leaves it:
deadlock rule 2), also beside ``torch._scaled_mm`` given the same SMs (``torch._C._set_sm_carveout_experimental``,
docs/benchmarks.md's GEMM at an SM budget): ``t_scaled_mm_budget_ms``, ``speed_vs_budget``.
Per-rank GEMMs: all-reduce and reduce-scatter ``(M, N, K/2)``, all-gather ``(M, N/2, K)`` with M gathered.
Times are medians of CUDA-event times of 25 calls after 5 warm-up calls, each queued behind a GPU sleep (the GPU's
time, not the host's); fresh random operands (randn times 3 cast to fp8, never zeros) and scales in [0.5, 1.5).
Block-wise scales are laid out as torch 2.11's block-wise ``_scaled_mm`` takes them (the only layout it took):
A ``[M, K/128]`` outer-dim-major (``s.t().contiguous().t()``), B ``[K/128, N/128]`` as the transpose of a contiguous
``[N/128, K/128]`` weight scale.

FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src:. python benchmarks/diagnostics/fp8_gemm.py [out.json]
"""

import math
import statistics

import torch

from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from flashoverlap.comm.scaled import Scales, cublas_takes, scaled_mm
from flashoverlap.comm.tp.nccl import compute_bands
from flashoverlap.kernels.gemm import GatherWait, Scaling
from flashoverlap.kernels.gemm import gemm as gemm_kernel
from flashoverlap.tune.defaults import default_plan
from flashoverlap.tune.fp8 import fp8_plan

GRID = {"all_reduce": [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 4096), (8192, 8192, 14336),
                       (2048, 8192, 14336)],
        "all_gather": [(4096, 8192, 8192), (8192, 14336, 8192), (16384, 8192, 8192), (8192, 28672, 8192)]}
GRID["reduce_scatter"] = GRID["all_reduce"]
WORLD = 2
SUB_BANDS = 2  # per half of the rows, on the P2P path
SCALINGS = ("tensor", "row", "block")
WARMUP, ITERS = 5, 25
CARVE = getattr(torch._C, "_set_sm_carveout_experimental", None)
NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
QUEUE_AHEAD_CYCLES = 400_000  # about 0.2 ms of GPU sleep: the host has queued the call before the GPU reaches it


def time_ms(fn) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in times)


def per_rank(op: str, m: int, n: int, k: int) -> tuple[int, int, int]:
    return (m, n // WORLD, k) if op == "all_gather" else (m, n, k // WORLD)


def scales(scaling: str, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    def rand(*shape):
        return torch.rand(shape, device="cuda") + 0.5

    if scaling == "tensor":
        return rand(), rand()
    if scaling == "row":
        return rand(m, 1), rand(1, n)
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    return rand(m, kb).t().contiguous().t(), rand(nb, kb).t()


def sub_band_calls(a, b, scale_a, scale_b, scaling):
    """The P2P path's multiplications: ``_scaled_mm`` on each sub-band of rows, its A scales copied into the layout
    ``_scaled_mm`` takes for a band (a row slice of an outer-dim-major scale is not one)."""
    m = a.shape[0]
    band = m // (WORLD * SUB_BANDS)
    calls = []
    for lo in range(0, m, band):
        sa = scale_a
        if scaling == "row":
            sa = scale_a[lo : lo + band]
        elif scaling == "block":
            sa = scale_a[lo : lo + band].t().contiguous().t()
        calls.append((a[lo : lo + band], sa))
    return lambda: [torch._scaled_mm(x, b, scale_a=sa, scale_b=scale_b, out_dtype=torch.bfloat16) for x, sa in calls]


def our_call(op, a, b, scaling, scale_a, scale_b, gemm=None):
    """The NCCL path's GEMM for this call: its plan (``gemm`` overrides the plan's choice) and a callable."""
    m, k = a.shape
    n = b.shape[1]
    plan = fp8_plan(op, m, n, k, WORLD, scaling, cublas_block=cublas_takes(a, b, "block"))
    if gemm is not None and gemm != plan.gemm:
        plan = default_plan(op, m, n, k, WORLD, tile=plan.tile, gemm=gemm)
    scales = Scales.of(scale_a, scale_b)
    if plan.gemm == "cublas":
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        if op != "all_gather":
            return plan, lambda: (compute_bands(a, b, plan, out, scales), out)[1]

        # As the NCCL path's _bands_by_cublas multiplies them: the own shard (rank 0's slots, as the caller's
        # contiguous shard) in one product, then each other rank's slot of each band.
        own = torch.cat([torch.arange(g.out_row_start, g.out_row_start + g.rows) for g in plan.groups]).cuda()
        shard, shard_scales, shard_out = a[own], scale_a[own], torch.empty((len(own), n), dtype=out.dtype,
                                                                            device="cuda")

        def gathered_bands():
            scaled_mm(shard, b, scales, shard_scales, out=shard_out)
            for grp in plan.groups:
                for r in range(1, WORLD):
                    rows = slice(grp.out_row_start + r * grp.rows, grp.out_row_start + (r + 1) * grp.rows)
                    scaled_mm(a[rows], b, scales, scale_a[rows], out=out[rows])
            return out

        return plan, gathered_bands
    spec = Scaling(scale_a, scale_b)
    if op == "all_gather":  # every band has arrived: the waits cost their polls, never a stall
        wait = GatherWait(torch.ones(plan.num_groups, dtype=torch.int32, device="cuda"))
        return plan, lambda: gemm_kernel(a, b, plan, scaling=spec, wait=wait)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")  # only counted up: nothing waits
    return plan, lambda: gemm_kernel(a, b, plan, counters=counters, scaling=spec)


def _described(plan) -> dict:
    t = plan.tile
    return {"gemm": plan.gemm, "tile": [t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, t.group_m],
            "programs": plan.grid_size, "groups": plan.num_groups}


def main():
    require_cuda("benchmarks/diagnostics/fp8_gemm.py", path_only=True)
    rows = []
    for op, shapes in GRID.items():
        for shape in shapes:
            m, n, k = per_rank(op, *shape)
            a = (torch.randn(m, k, device="cuda") * 3).to(torch.float8_e4m3fn)
            b = (torch.randn(n, k, device="cuda") * 3).to(torch.float8_e4m3fn).t()  # w.t(): column-major
            a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
            t_bf16 = time_ms(lambda a16=a16, b16=b16: torch.mm(a16, b16))
            flop = 2 * m * n * k
            for scaling in SCALINGS:
                sa, sb = scales(scaling, m, n, k)
                t_ref = time_ms(lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb,
                                                                               out_dtype=torch.bfloat16))
                plan, ours = our_call(op, a, b, scaling, sa, sb)
                want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
                got = ours().float()
                if op == "all_reduce":  # row-major C (the others' outputs are laid out by their plans)
                    err = float((got - want).norm() / want.norm())
                    assert err < 1e-2, f"{op} {m}x{n}x{k} {scaling}: relative error {err:.2e}"
                budget = None
                if plan.gemm == "triton" and plan.grid_size < NUM_SMS and CARVE is not None:
                    CARVE(NUM_SMS - plan.grid_size)
                    try:
                        budget = time_ms(lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(
                            a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
                    finally:
                        CARVE(0)
                runs = [("nccl", plan, ours), ("p2p", None, sub_band_calls(a, b, sa, sb, scaling))]
                if scaling == "block" and plan.gemm == "cublas":
                    runs.append(("nccl-triton", *our_call(op, a, b, scaling, sa, sb, gemm="triton")))
                for path, run_plan, fn in runs:
                    t = time_ms(fn)
                    rows.append({"op": op, "path": path, "scaling": scaling, "M": m, "N": n, "K": k, "t_ms": t,
                                 "t_scaled_mm_ms": t_ref, "t_bf16_mm_ms": t_bf16, "tflops": flop / t / 1e9,
                                 "speed_vs_scaled_mm": t_ref / t,
                                 "plan": None if run_plan is None else _described(run_plan),
                                 **({"t_scaled_mm_budget_ms": budget, "speed_vs_budget": budget / t}
                                    if budget is not None and path == "nccl" else {})})
                    print(f"{op} {path} {scaling} {m}x{n}x{k}: {t:.3f} ms ({flop / t / 1e9:.0f} TFLOP/s), "
                          f"_scaled_mm {t_ref:.3f} ({t_ref / t:.3f}x), bf16 mm {t_bf16:.3f}", flush=True)
    ratios = {s: [r["speed_vs_scaled_mm"] for r in rows if r["path"] == "nccl" and r["scaling"] == s]
              for s in SCALINGS}
    for s, rs in ratios.items():
        print(f"nccl {s}: {min(rs):.3f}-{max(rs):.3f}x _scaled_mm", flush=True)
    budgets = [r["speed_vs_budget"] for r in rows if "speed_vs_budget" in r]
    if budgets:
        print(f"nccl at an SM budget: {min(budgets):.3f}-{max(budgets):.3f}x _scaled_mm given the same SMs", flush=True)
    write_results({"meta": results_meta("FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src:. python "
                                        "benchmarks/diagnostics/fp8_gemm.py "
                                        "benchmarks/results/h200x1-fp8-gemm.json",
                                        triton=__import__("triton").__version__), "rows": rows})


if __name__ == "__main__":
    main()
