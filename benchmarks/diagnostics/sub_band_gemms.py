"""What splitting a GEMM into the P2P ring's sub-bands costs in compute alone, on one GPU: at each grid shape, the
whole ``torch.mm`` beside the ring's multiplications for S sub-bands per rank block at W = 2 (for all-gather,
the own shard whole and the peer's in S sub-bands; for the reductions the first step's ``mm`` and the second
step's ``addmm_``, which adds the received partial in cuBLAS's epilogue). The excess over the whole GEMM is time
the overlap has to win back before it gains.

python -m benchmarks.diagnostics.sub_band_gemms [out.json]
"""


import torch

from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from flashoverlap.tune.timing import time_ms

GRID = {"all_reduce": [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 4096), (8192, 8192, 14336),
                       (2048, 8192, 14336)],
        "all_gather": [(4096, 8192, 8192), (8192, 14336, 8192), (16384, 8192, 8192), (8192, 28672, 8192)]}
WORLD = 2
SUB_BANDS = (1, 2, 4, 8)


def pieces(op: str, m: int, s: int) -> list[tuple[int, int, bool]]:
    """The ring's multiplications at W = 2 as ``(first row, rows, accumulate)``: block q at step q (the own block
    last for the reductions, first for all-gather, where it is one multiplication), S sub-bands each."""
    block = m // WORLD
    out = []
    for q in range(WORLD):
        if op == "all_gather" and q == 0:
            out.append((0, block, False))
            continue
        band = block // s
        out += [(q * block + j * band, band, op != "all_gather" and q > 0) for j in range(s)]
    return out


def ring_products(op, a, b, out, s):
    for lo, rows, accumulate in pieces(op, a.shape[0], s):
        if accumulate:
            out[lo : lo + rows].addmm_(a[lo : lo + rows], b)
        else:
            torch.mm(a[lo : lo + rows], b, out=out[lo : lo + rows])


def main():
    require_cuda("benchmarks.diagnostics.sub_band_gemms", path_only=True)
    rows = []
    for op, shapes in GRID.items():
        for m, n, k in shapes:
            a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            b = (torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5).t()
            out = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")  # addmm_ adds to it: no garbage
            whole = time_ms(lambda: torch.mm(a, b, out=out), iters=30)  # noqa: B023
            row = {"op": op, "M": m, "N": n, "K": k, "whole_ms": whole, "split_ms": {}}
            for s in SUB_BANDS:
                row["split_ms"][s] = time_ms(lambda s=s, a=a, b=b, out=out, op=op: ring_products(op, a, b, out, s),
                                             iters=30)
            rows.append(row)
            excess = ", ".join(f"S={s}: {100 * (t / whole - 1):+.1f}%" for s, t in row["split_ms"].items())
            print(f"{op} {m}x{n}x{k}: whole {whole:.3f} ms; {excess}", flush=True)
    write_results({"meta": results_meta("python -m benchmarks.diagnostics.sub_band_gemms"), "rows": rows})


if __name__ == "__main__":
    main()
