"""The fp8 GEMM as each path runs it, on one GPU, at the grid's per-rank GEMMs (W = 2), in every scaling mode:

- ``nccl``: the signalling Triton GEMM (``kernels/gemm.py`` with ``Scaling``), signals included, on the NCCL path's
  plan (its groups and tile order; the all-gather's in-kernel waits, every band already arrived), on all SMs, with
  the tiles ``tune/fp8.py`` picks;
- ``p2p``: ``torch._scaled_mm`` on the P2P ring's sub-bands, two per half of the rows (four multiplications, each
  with its own scales laid out as ``_scaled_mm`` wants them);

each beside ``torch._scaled_mm`` in the same mode on the whole GEMM and bf16 ``torch.mm`` of the same shape.
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

from benchmarks.diagnostics.results_file import results_meta, write_results
from flashoverlap.kernels.gemm import GatherWait, Scaling, gemm
from flashoverlap.tune.defaults import default_plan
from flashoverlap.tune.fp8 import fp8_tiles

GRID = {"all_reduce": [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 4096), (8192, 8192, 14336),
                       (2048, 8192, 14336)],
        "all_gather": [(4096, 8192, 8192), (8192, 14336, 8192), (16384, 8192, 8192), (8192, 28672, 8192)]}
GRID["reduce_scatter"] = GRID["all_reduce"]
WORLD = 2
SUB_BANDS = 2  # per half of the rows, on the P2P path
SCALINGS = ("tensor", "row", "block")
WARMUP, ITERS = 5, 25
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


def our_call(op, a, b, scaling, scale_a, scale_b):
    m, k = a.shape
    n = b.shape[1]
    tiles = fp8_tiles(m, n, k, scaling)
    plan = default_plan(op, m, n, k, WORLD, tile=tiles.tile_config(), num_programs=tiles.num_programs(m, n),
                        allow_sequential=False)
    spec = Scaling(scale_a, scale_b)
    if op == "all_gather":  # every band has arrived: the waits cost their polls, never a stall
        wait = GatherWait(torch.ones(plan.num_groups, dtype=torch.int32, device="cuda"))
        return tiles, lambda: gemm(a, b, plan, scaling=spec, wait=wait)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")  # only counted up: nothing waits
    return tiles, lambda: gemm(a, b, plan, counters=counters, scaling=spec)


def main():
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
                tiles, ours = our_call(op, a, b, scaling, sa, sb)
                want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
                got = ours().float()
                if op == "all_reduce":  # row-major C (the others' outputs are laid out by their plans)
                    err = float((got - want).norm() / want.norm())
                    assert err < 1e-2, f"{op} {m}x{n}x{k} {scaling}: relative error {err:.2e}"
                for path, fn in (("nccl", ours), ("p2p", sub_band_calls(a, b, sa, sb, scaling))):
                    t = time_ms(fn)
                    rows.append({"op": op, "path": path, "scaling": scaling, "M": m, "N": n, "K": k, "t_ms": t,
                                 "t_scaled_mm_ms": t_ref, "t_bf16_mm_ms": t_bf16, "tflops": flop / t / 1e9,
                                 "speed_vs_scaled_mm": t_ref / t,
                                 "tiles": list(tiles) if path == "nccl" else None})
                    print(f"{op} {path} {scaling} {m}x{n}x{k}: {t:.3f} ms ({flop / t / 1e9:.0f} TFLOP/s), "
                          f"_scaled_mm {t_ref:.3f} ({t_ref / t:.3f}x), bf16 mm {t_bf16:.3f}", flush=True)
    ratios = {s: [r["speed_vs_scaled_mm"] for r in rows if r["path"] == "nccl" and r["scaling"] == s]
              for s in SCALINGS}
    for s, rs in ratios.items():
        print(f"nccl {s}: {min(rs):.3f}-{max(rs):.3f}x _scaled_mm", flush=True)
    write_results({"meta": results_meta("FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src:. python "
                                        "benchmarks/diagnostics/fp8_gemm.py "
                                        "benchmarks/results/h200x1-fp8-gemm.json",
                                        triton=__import__("triton").__version__), "rows": rows})


if __name__ == "__main__":
    main()
